"""``fla-triton``: FLA's chunk_gated_delta_rule with every dispatch backend switched off, in the forward and in the
backward (``backward_context``), so that the Triton kernels really run; a call that FLA still dispatched elsewhere
is an error, not a result.  One exception, recorded in the impl: on Hopper with Triton in [3.4, 3.7.1) FLA refuses
its Triton gated chunk_bwd_dqkwg (wrong results, fla #640), so that backward sub-kernel runs on FLA's TileLang
kernel, as it does for every FLA user there."""

from __future__ import annotations

import contextlib

import torch

from cases.case import Case
from parity.backends import fla_common
from parity.backends.base import Backend


class FlaTriton(Backend):
    name = "fla-triton"
    description = "FLA chunk_gated_delta_rule, Triton kernels only (FLA_FLASH_QLA=0, FLA_TILELANG=0, ...)"
    has_backward = True
    packages = ("fla-core", "triton")

    def available(self) -> tuple[bool, str]:
        return fla_common.fla_available()

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype == "fp64":
            return False, "FLA's Triton kernels take fp16/bf16/fp32 inputs, not fp64"
        return fla_common.cpu_interpreter_supports(case)

    def _forward(self, inputs):
        gdn = fla_common.import_gdn()
        with fla_common.dispatch_off(), fla_common.trace_dispatch() as calls:
            o, ht = gdn.chunk_gated_delta_rule(**fla_common.fla_kwargs(inputs))
        if calls:
            raise RuntimeError(f"FLA dispatched to {calls} although every backend was switched off")
        return o, ht, "fla/triton"

    @contextlib.contextmanager
    def backward_context(self):
        """FLA's backward dispatches at call time too: every backend off (``fla_common.triton_backward``), except
        the TileLang chunk_bwd_dqkwg where FLA refuses its Triton one (Hopper, Triton in [3.4, 3.7.1)); then the
        run's impl names it."""
        with fla_common.triton_backward() as note:
            yield note

    def chunk_states(self, inputs):
        """FLA computes h (the chunk-start states, [B, NT, HV, K, V] in the input dtype) inside its forward and does
        not return it: wrap the stage function it calls, chunk_gated_delta_rule_fwd_h, to keep its output."""
        gdn = fla_common.import_gdn()
        import fla.ops.gated_delta_rule.chunk as chunk_mod

        original = chunk_mod.chunk_gated_delta_rule_fwd_h
        captured = []

        def keep_h(*args, **kwargs):
            out = original(*args, **kwargs)
            captured.append(out[0])
            return out

        chunk_mod.chunk_gated_delta_rule_fwd_h = keep_h
        try:
            with torch.no_grad(), fla_common.dispatch_off():
                gdn.chunk_gated_delta_rule(**fla_common.fla_kwargs(inputs))
        finally:
            chunk_mod.chunk_gated_delta_rule_fwd_h = original
        if len(captured) != 1:
            raise RuntimeError(f"expected one call of chunk_gated_delta_rule_fwd_h, saw {len(captured)}")
        return captured[0], "fla chunk_gated_delta_rule_fwd_h output h"
