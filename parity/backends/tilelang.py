"""``tilelang``: gdn-parity's own TileLang kernels from ``kernels/`` (SM90, chunk 64), with FLA's call
signature (the in-kernel gate and beta sigmoid, padded varlen included), forward and backward
(``kernels.autograd``, a ``torch.autograd.Function``). Available on an SM90 GPU with tilelang installed and the
kernels present. A gradient run records its backward's plan where it is the fused one-term one
(``kernels.plan.dispatches_fused``): ``gdn-parity/tilelang; backward: gdn-parity/tilelang fused one-term fp16``."""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from cases.case import Case
from parity.backends.base import Backend, cuda_capability

SUPPORTED_HEAD_DIMS = {64, 128}
FUSED_IMPL = "gdn-parity/tilelang fused one-term fp16"


class TileLangKernels(Backend):
    name = "tilelang"
    description = "gdn-parity's TileLang GDN forward and backward (kernels/), SM90"
    needs_gpu = True
    has_backward = True
    packages = ("tilelang",)

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("tilelang") is None:
            return False, "package tilelang is not installed"
        cap = cuda_capability()
        if cap is None:
            return False, "no CUDA GPU (our TileLang kernels target SM90)"
        if cap != (9, 0):
            return False, f"GPU is sm_{cap[0]}{cap[1]}; our TileLang kernels target SM90 (H100/H200)"
        try:
            import kernels

            getattr(kernels, "chunk_gated_delta_rule")
        except (ImportError, AttributeError) as err:
            return False, f"kernels.chunk_gated_delta_rule is not importable: {err}"
        return True, ""

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype not in ("bf16", "fp16"):
            return False, f"our TileLang kernels take fp16/bf16 q/k/v, got {case.dtype}"
        if case.K != case.V or case.K not in SUPPORTED_HEAD_DIMS:
            return False, f"our TileLang kernels need K=V in {sorted(SUPPORTED_HEAD_DIMS)}, got K={case.K}, V={case.V}"
        if case.h0_dtype not in (None, "fp32"):
            return False, f"our TileLang kernels take an fp32 initial state, got {case.h0_dtype}"
        return True, ""

    def _forward(self, inputs):
        import kernels
        from kernels.backward.pipeline import runs_fused

        # the backward of this call (run_with_grads runs it right after, inside backward_context)
        self._backward_impl = FUSED_IMPL if runs_fused(inputs.q, inputs.v, inputs.cu_seqlens) else None

        o, ht = kernels.chunk_gated_delta_rule(
            inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, scale=inputs.scale,
            initial_state=inputs.initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=inputs.use_qk_l2norm_in_kernel, state_v_first=inputs.state_v_first,
            cu_seqlens=inputs.cu_seqlens, use_gate_in_kernel=inputs.use_gate_in_kernel,
            A_log=inputs.A_log if inputs.use_gate_in_kernel else None,
            dt_bias=inputs.dt_bias if inputs.use_gate_in_kernel else None,
            use_beta_sigmoid_in_kernel=inputs.use_beta_sigmoid_in_kernel,
        )
        return o, ht, "gdn-parity/tilelang"

    @contextlib.contextmanager
    def backward_context(self):
        """Records the backward's plan where the last forward's call runs the fused one."""
        note: dict = {}
        yield note
        if getattr(self, "_backward_impl", None):
            note["impl"] = self._backward_impl
