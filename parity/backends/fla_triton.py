"""``fla-triton``: FLA's chunk_gated_delta_rule with every dispatch backend switched off, so that the
Triton kernels really run; a call that FLA still dispatched elsewhere is an error, not a result."""

from __future__ import annotations

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
