"""``flash-qla``: Qwen's fused TileLang kernels, ``flash_qla.chunk_gated_delta_rule`` called directly
with its defaults. Needs an NVIDIA SM90/SM100/SM120 GPU, K=V=128 and fp16/bf16 q/k/v; importing
flash_qla without a GPU fails, so it is imported only when a GPU is present."""

from __future__ import annotations

import importlib.util

import torch

from cases.case import Case
from cases.distributions import get_distribution
from parity.backends.base import Backend, cuda_capability, unpadded

SUPPORTED_ARCHS = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}


class FlashQLA(Backend):
    name = "flash-qla"
    description = "FlashQLA flash_qla.chunk_gated_delta_rule (fused TileLang), called directly"
    needs_gpu = True
    has_backward = True
    packages = ("flash-qla", "tilelang")

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("flash_qla") is None:
            return False, "package flash-qla is not installed"
        cap = cuda_capability()
        if cap is None:
            return False, "no CUDA GPU (FlashQLA runs on SM90/SM100/SM120 only)"
        if cap not in SUPPORTED_ARCHS:
            return False, f"GPU is sm_{cap[0]}{cap[1]}; FlashQLA supports SM90, SM100/103 and SM120/121"
        return True, ""

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype not in ("bf16", "fp16"):
            return False, f"FlashQLA needs fp16/bf16 q/k/v, got {case.dtype}"
        if case.K != 128 or case.V != 128:
            return False, f"FlashQLA needs K=V=128, got K={case.K}, V={case.V}"
        dist = get_distribution(case.dist)
        if dist.gate_in_kernel or dist.beta_sigmoid_in_kernel:
            return False, "FlashQLA has no in-kernel gate (use_gate_in_kernel) or beta sigmoid"
        if cuda_capability() in {(12, 0), (12, 1)} and (case.dtype == "fp16" or case.grad):
            return False, "FlashQLA on SM120 has a bf16 forward only"
        return unpadded(case, "FlashQLA's API")

    def _forward(self, inputs):
        import flash_qla

        o, ht = flash_qla.chunk_gated_delta_rule(
            q=inputs.q, k=inputs.k, v=inputs.v, g=inputs.g, beta=inputs.beta, scale=inputs.scale,
            initial_state=inputs.initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=inputs.use_qk_l2norm_in_kernel, cu_seqlens=inputs.cu_seqlens,
            state_v_first=inputs.state_v_first,
        )
        return o, ht, "flash_qla"

    def chunk_states(self, inputs):
        """FlashQLA's low-level forward returns h with output_h=True; auto_cp is switched off so that h has the plain
        [B, NT, HV, K, V] layout (the intra-card split would reorder it)."""
        import flash_qla

        q, k = inputs.q, inputs.k
        if inputs.use_qk_l2norm_in_kernel:
            from reference.prepare import l2norm

            q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
        with torch.no_grad():
            out = flash_qla.chunk_gated_delta_rule_fwd(
                q=q, k=k, v=inputs.v, g=inputs.g, beta=inputs.beta, scale=inputs.scale or q.shape[-1] ** -0.5,
                initial_state=inputs.initial_state, cu_seqlens=inputs.cu_seqlens, output_final_state=True,
                output_h=True, auto_cp=False, state_v_first=inputs.state_v_first)
        return out[3], "flash_qla.chunk_gated_delta_rule_fwd(output_h=True, auto_cp=False)"
