"""``fla-recurrent``: FLA's fused recurrent GDN kernel (the decode path), token by token on the GPU.
Its signature has gk/gv before beta, so beta is passed by keyword. FLA 0.6 has no backward for it."""

from __future__ import annotations

import torch

from cases.case import Case
from parity.backends import fla_common
from parity.backends.base import Backend


class FlaRecurrent(Backend):
    name = "fla-recurrent"
    description = "FLA fused_recurrent_gated_delta_rule (token-by-token Triton kernel)"
    has_backward = False
    packages = ("fla-core", "triton")

    def available(self) -> tuple[bool, str]:
        return fla_common.fla_available()

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype == "fp64":
            return False, "FLA takes fp16/bf16/fp32 inputs, not fp64"
        return fla_common.cpu_interpreter_supports(case, max_tokens=32)

    def _forward(self, inputs):
        gdn = fla_common.import_gdn()
        kw = fla_common.fla_kwargs(inputs)
        q, k, v, g, beta = (kw.pop(n) for n in ("q", "k", "v", "g", "beta"))
        with fla_common.dispatch_off(), fla_common.trace_dispatch() as calls:
            o, ht = gdn.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
        return o, ht, "fla/fused_recurrent" + ("" if not calls else f"+{fla_common.describe(calls)}")
