"""Per-GVA-group powers of two of the one-term backward (``BackwardPlan.one_term``): dO, dht (by ``ea``) and v, h0
(by ``eb``) are multiplied by ``2^-e`` so that each group's largest magnitude lies in [1, 2), which keeps fp16 tables
in range whatever the gradient's scale; the backward is linear in dO and dht and homogeneous in (v, h0), so the
gradients are scaled back exactly: dv, dh0 by ``2^ea``; dq, dk, dg, dbeta by ``2^(ea + eb)``."""

from __future__ import annotations

import torch

# the exponents lie in [-EXP_MAX, EXP_MAX] (2^-e a normal fp32 number)
EXP_MAX = 126


def group_exponents(x: torch.Tensor, extra: torch.Tensor | None, H: int) -> torch.Tensor:
    """[HV] int32 ``e = floor(log2 m)`` clamped to [-EXP_MAX, EXP_MAX], ``m`` the largest magnitude of ``x [..., HV,
    D]`` and of ``extra [N, HV, ., .]`` (or None) over each GVA group of ``HV / H`` value heads; 0 where ``m`` is 0 or
    not finite (the values pass unscaled)."""
    HV = x.shape[-2]
    f32 = torch.float32
    dims = tuple(d for d in range(x.dim()) if d != x.dim() - 2)
    m = torch.linalg.vector_norm(x.detach(), float("inf"), dim=dims, dtype=f32)
    if extra is not None:
        m = torch.maximum(m, torch.linalg.vector_norm(extra.detach(), float("inf"), dim=(0, 2, 3), dtype=f32))
    m = m.view(H, HV // H).amax(-1)
    _, e = torch.frexp(m)                               # m = f 2^e, f in [0.5, 1): floor(log2 m) = e - 1
    e = torch.where((m > 0) & torch.isfinite(m), (e - 1).clamp(-EXP_MAX, EXP_MAX), 0)
    return e.to(torch.int32).repeat_interleave(HV // H)


def pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^e`` exactly (built from exponent bits) for int ``e``: fp32 for ``e`` in [-126, 127], fp64 for
    [-1022, 1023]."""
    if dtype == torch.float32:
        return ((e.to(torch.int32) + 127) << 23).view(torch.float32)
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    raise ValueError(f"pow2 builds fp32 or fp64 powers of two, got {dtype}")


def unscale(grads, ea: torch.Tensor, eb: torch.Tensor, H: int):
    """(dq, dk, dv, dg, dbeta, dh0) of the scaled inputs (dq, dk [..., H, K], dv [..., HV, V], dg, dbeta [..., HV],
    dh0 [N, HV, ., .] or None) as the unscaled inputs' gradients, each in its dtype: dv, dh0 times ``2^ea``, the
    others times ``2^(ea + eb)`` (per q/k head: its group's)."""
    dq, dk, dv, dg, db, dh0 = grads
    a, ab = pow2(ea, torch.float64), pow2(ea + eb, torch.float64)
    HV = ea.numel()
    abh = ab[::HV // H]
    return (_times(dq, abh[:, None]), _times(dk, abh[:, None]), _times(dv, a[:, None]), _times(dg, ab),
            _times(db, ab), None if dh0 is None else _times(dh0, a[:, None, None]))


def _times(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x *= s`` in place (fp64 powers of two broadcast over ``x``'s trailing dims, the product rounded once to
    ``x``'s dtype)."""
    return x.mul_(s)
