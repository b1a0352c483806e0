"""What the serving engines' own FLA copies share (vLLM ``vllm/model_executor/layers/fla/ops``, SGLang
``sglang/srt/layers/attention/fla``): imported from the installed engine at call time, called the way the engines'
GDN layers (Qwen3-Next) call them:

- always varlen: q/k/v packed to ``[1, B*T, H, K]`` with ``cu_seqlens`` int64 (a dense batch becomes B sequences);
- g (log space) and beta as the case has them; for a case with the gate computed in the kernel
  (``qwen-gates-kernel``) the engine's own ``fused_gdn_gating(A_log, a, b, dt_bias)`` computes them first, as the
  layer does (g fp32; beta in b's dtype in SGLang's copy);
- the state in the layout the installed copy documents (``[N, H, V, K]`` or ``[N, H, K, V]`` in its
  ``chunk_gated_delta_rule`` docstring), in the case's h0 dtype, transposed in and back as needed;
- ``use_qk_l2norm_in_kernel`` as the case says (the copy L2-normalises with its own ``l2norm_fwd``).

Forward only (the engines run inference); fp16/bf16 q/k/v (the copies assert it is not fp32).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from cases.case import Case
from parity.backends.base import Backend, cuda_capability, unpadded

CONVERSION = ("packed [1, B*T, H, K] + cu_seqlens int64 (dense -> B sequences); g log-space and beta as given (the "
              "engine's fused_gdn_gating for in-kernel gates); state in the copy's documented layout, h0 dtype kept")


def state_v_first(fn) -> bool:
    """True when the copy's ``chunk_gated_delta_rule`` documents its state as ``[N, H, V, K]``."""
    return "[N, H, V, K]" in (fn.__doc__ or "")


class EngineFla(Backend):
    """Base of ``vllm-fla`` and ``sglang-fla``: subclasses set ``package`` (the top-level module), ``chunk_module``
    and ``gating_module``."""

    package: str = ""
    chunk_module: str = ""
    gating_module: str = ""
    conversion = CONVERSION
    needs_gpu = True

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec(self.package) is None:
            return False, (f"package {self.package} is not installed (run gdn-parity inside the engine's own "
                           f"environment: pip install gdn-parity there)")
        if cuda_capability() is None:
            return False, f"no CUDA GPU ({self.package}'s FLA copy runs Triton kernels on a GPU)"
        try:
            importlib.import_module(self.chunk_module)
        except Exception as err:  # noqa: BLE001 - an engine that does not import is unavailable, with the reason
            return False, f"{self.chunk_module} does not import: {type(err).__name__}: {err}"
        return True, ""

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype not in ("bf16", "fp16"):
            return False, (f"{self.package}'s FLA copy takes fp16/bf16 q/k/v (it asserts q is not fp32), "
                           f"got {case.dtype}")
        return unpadded(case, f"{self.package}'s FLA copy")

    def gates(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """g and beta [1, B*T, HV] as the engine feeds its chunk function."""
        B, T, HV = inputs.g.shape
        if not inputs.use_gate_in_kernel:
            return inputs.g.reshape(1, B * T, HV), inputs.beta.reshape(1, B * T, HV)
        gating = importlib.import_module(self.gating_module).fused_gdn_gating
        out = gating(inputs.A_log, inputs.g.reshape(B * T, HV), inputs.beta.reshape(B * T, HV), inputs.dt_bias)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{self.gating_module}.fused_gdn_gating(A_log, a, b, dt_bias) returned {type(out)}, "
                            "expected (g, beta)")
        return out[0].reshape(1, B * T, HV), out[1].reshape(1, B * T, HV)

    def _forward(self, inputs):
        fn = importlib.import_module(self.chunk_module).chunk_gated_delta_rule
        B, T, H, K = inputs.q.shape
        HV = inputs.v.shape[2]
        cu = inputs.cu_seqlens
        if cu is None:
            cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=inputs.q.device)
        flip = state_v_first(fn) != inputs.state_v_first
        h0 = inputs.initial_state
        if h0 is not None and flip:
            h0 = h0.transpose(-1, -2).contiguous()
        g, beta = self.gates(inputs)
        out = fn(q=inputs.q.reshape(1, B * T, H, K), k=inputs.k.reshape(1, B * T, H, K),
                 v=inputs.v.reshape(1, B * T, HV, -1), g=g, beta=beta, scale=inputs.scale, initial_state=h0,
                 output_final_state=True, cu_seqlens=cu.to(torch.int64),
                 use_qk_l2norm_in_kernel=inputs.use_qk_l2norm_in_kernel)
        o, ht = out[0], out[1]
        if ht is not None and flip:
            ht = ht.transpose(-1, -2)
        return o.reshape(B, T, HV, -1), ht, f"{self.package}/fla-copy"
