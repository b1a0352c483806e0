"""``fla-dispatch``: FLA's public chunk_gated_delta_rule exactly as users get it. On Hopper with
flash_qla installed FLA routes to FlashQLA; the run records which implementation executed."""

from __future__ import annotations

import contextlib

import torch

from cases.case import Case
from parity.backends import fla_common
from parity.backends.base import Backend, unpadded


class FlaDispatch(Backend):
    name = "fla-dispatch"
    description = "FLA chunk_gated_delta_rule as users call it (FLA picks FlashQLA / TileLang / Triton)"
    needs_gpu = True
    has_backward = True
    packages = ("fla-core", "flash-qla", "tilelang")

    def available(self) -> tuple[bool, str]:
        return fla_common.fla_available()

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype == "fp64":
            return False, "FLA takes fp16/bf16/fp32 inputs, not fp64"
        ok, why = unpadded(case, fla_common.FLA_PADDING)
        if ok and fla_common.on_cpu_interpreter():
            return False, "no GPU: FLA has nothing to dispatch to, the run would repeat fla-triton"
        return ok, why

    def _forward(self, inputs):
        gdn = fla_common.import_gdn()
        with fla_common.trace_dispatch() as calls:
            o, ht = gdn.chunk_gated_delta_rule(**fla_common.fla_kwargs(inputs))
        return o, ht, fla_common.describe(calls)

    @contextlib.contextmanager
    def backward_context(self):
        """Records what FLA's backward dispatched to (it decides at call time, sub-kernel by sub-kernel); nothing
        when it dispatched nothing (then the backward is that of the forward's implementation)."""
        note = {}
        with fla_common.trace_dispatch() as calls:
            yield note
        if calls:
            note["impl"] = fla_common.describe(calls)
