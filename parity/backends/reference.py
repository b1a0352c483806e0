"""Backends made of the references themselves, so a CPU run has something real to show.

- ``ref-recurrent``: the token-by-token fp64 recurrence, checked against the chunked fp64 reference
  the harness uses as ground truth (they must agree to ~1e-15: a check of the reference itself).
- ``torch-emulated``: the chunked algorithm with the input dtype's operands and fp32 accumulation
  (reference.emulated): the plain same-precision implementation that verdicts are calibrated against.
"""

from __future__ import annotations

import torch

import reference
from cases.case import Case
from cases.inputs import GDNInputs
from parity.backends.base import Backend
from reference import emulated

RECURRENT_MAX_TOKENS = 4096


class RefRecurrent(Backend):
    name = "ref-recurrent"
    description = "fp64 token-by-token recurrence (reference.fused_recurrent_gated_delta_rule)"
    has_backward = True

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        tokens = case.B * case.T
        if tokens > RECURRENT_MAX_TOKENS:
            return False, f"the token loop is only run up to {RECURRENT_MAX_TOKENS} tokens (this case has {tokens})"
        return True, ""

    def _forward(self, inputs: GDNInputs):
        o, ht = reference.fused_recurrent_gated_delta_rule(**inputs.reference_kwargs())
        return o, ht, "reference/recurrent-fp64"


class TorchEmulated(Backend):
    name = "torch-emulated"
    description = "chunked GDN with input-dtype operands and fp32 accumulation (reference.emulated)"
    has_backward = True

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype == "fp64":
            return False, "fp64 inputs: the emulated low-precision path is for fp16/bf16/fp32"
        return True, ""

    def _forward(self, inputs: GDNInputs):
        o, ht = emulated.chunk_gated_delta_rule(**inputs.reference_kwargs())
        return o, ht, f"reference/emulated-{str(inputs.q.dtype).replace('torch.', '')}"

    def chunk_states(self, inputs: GDNInputs):
        with torch.no_grad():
            _, _, hs = emulated.chunk_gated_delta_rule(**inputs.reference_kwargs(), output_chunk_states=True)
        return hs, "reference.emulated (chunk-start states, rounded as the output stage reads them)"
