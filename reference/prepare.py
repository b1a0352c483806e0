"""The in-kernel transforms of FLA's GDN call, written once in plain torch for every reference.

FLA (and FlashQLA) can apply three transforms inside the kernel; the references apply them here,
in the precision of their inputs (fp64 for the exact references):
  - q/k L2 norm:  x / sqrt(sum(x^2) + 1e-6) over the last dim
  - the gate:     g = -exp(A_log) * softplus(a + dt_bias)       (a is the raw gate input)
  - beta sigmoid: beta = sigmoid(beta_logits)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """FLA's L2 norm over the last dim: x / sqrt(sum(x^2) + eps). Shape and dtype of ``x``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate_from_raw(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Mamba/Qwen gate: g = -exp(A_log) * softplus(a + dt_bias). a: [B, T, HV]; A_log, dt_bias: [HV]."""
    x = a if dt_bias is None else a + dt_bias
    return -torch.exp(A_log) * F.softplus(x)


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """GVA: [B, T, H, D] -> [B, T, HV, D] where value head j reads q/k head j // (HV // H)."""
    H = x.shape[2]
    if H == HV:
        return x
    return x.repeat_interleave(HV // H, dim=2)


def prepare(
    q, k, v, g, beta, *, dtype: torch.dtype, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel: bool = False,
):
    """Cast to ``dtype`` and apply the in-kernel transforms. Returns q, k (expanded to HV heads), v, g, beta.

    In: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]. Out: q, k [B, T, HV, K], the rest unchanged in
    shape, all in ``dtype``.
    """
    HV = v.shape[2]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log ([HV])")
        g = gate_from_raw(g, A_log.to(dtype), None if dt_bias is None else dt_bias.to(dtype))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    return expand_heads(q, HV), expand_heads(k, HV), v, g, beta
