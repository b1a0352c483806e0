"""Per-GVA-group powers of two of the one-term backward (``BackwardPlan.one_term``): dO, dht (by ``ea``) and v, h0
(by ``eb``) are multiplied by ``2^-e`` so that each group's largest magnitude lies in [1, 2), which keeps fp16 tables
in range whatever the gradient's scale; the backward is linear in dO and dht and homogeneous in (v, h0), so the
gradients are scaled back exactly: dv, dh0 by ``2^ea``; dq, dk, dg, dbeta by ``2^(ea + eb)``."""

from __future__ import annotations

import torch

# the exponents of the groups' (and dh_ws's chunks') powers of two lie in [-EXP_MAX, EXP_MAX] (a power of two and its
# reciprocal normal fp32 numbers)
EXP_MAX = 126


def group_exponents(x: torch.Tensor, extra: torch.Tensor | None, H: int) -> torch.Tensor:
    """[HV] int32 ``e = floor(log2 m)`` clamped to [-EXP_MAX, EXP_MAX], ``m`` the largest magnitude of ``x [..., HV,
    D]`` and of ``extra [N, HV, ., .]`` (or None) over each GVA group of ``HV / H`` value heads; 0 where ``m`` is 0 or
    not finite (the values pass unscaled)."""
    dims = tuple(d for d in range(x.dim()) if d != x.dim() - 2)
    m = torch.linalg.vector_norm(x.detach(), float("inf"), dim=dims, dtype=torch.float32)
    return exponents_of_maxima(m, extra, H)


def exponents_of_maxima(m: torch.Tensor, extra: torch.Tensor | None, H: int) -> torch.Tensor:
    """``group_exponents`` from the per-value-head maxima ``m [HV]`` fp32 of ``x``."""
    bits = magnitude_bits(m)
    if extra is not None:
        bits = torch.maximum(bits, state_bits(extra))
    return exponents_of_bits(bits, H)


def magnitude_bits(m: torch.Tensor) -> torch.Tensor:
    """The fp32 bits of ``|m|`` as int32 (they order as the magnitudes do, NaN above inf; ``gdn_bwd_amax``'s form)."""
    return m.to(torch.float32).contiguous().view(torch.int32) & 0x7FFFFFFF


def state_bits(s: torch.Tensor) -> torch.Tensor:
    """[HV] ``magnitude_bits`` of the largest magnitude of each value head of ``s [N, HV, ., .]``."""
    return magnitude_bits(torch.linalg.vector_norm(s.detach(), float("inf"), dim=(0, 2, 3), dtype=torch.float32))


def exponents_of_bits(bits: torch.Tensor, H: int) -> torch.Tensor:
    """[HV] int32 ``floor(log2 m)`` clamped to [-EXP_MAX, EXP_MAX] (0 where m is 0 or not finite), m the largest
    magnitude over each GVA group of ``HV / H`` value heads, from their ``magnitude_bits`` ``bits [HV]``: the exponent
    field, which is exact (subnormal maxima clamp)."""
    HV = bits.numel()
    b = bits.view(H, HV // H).amax(-1)
    field = (b >> 23) & 255
    e = torch.where((b == 0) | (field == 255), 0, (field - 127).clamp(-EXP_MAX, EXP_MAX))
    return e.to(torch.int32).repeat_interleave(HV // H)


def scales_and_factors(bits: torch.Tensor, H: int) -> torch.Tensor:
    """[4, HV] fp32 from ``bits [2, HV]`` (row 0 dO's and dht's ``magnitude_bits``, row 1 v's and h0's): ``2^-ea``,
    ``2^-eb`` (the powers of two applied to dO, dht and v, h0), then ``factors(ea, eb)``; what ``gdn_bwd_convert``
    writes."""
    ea, eb = exponents_of_bits(bits[0], H), exponents_of_bits(bits[1], H)
    return torch.cat([torch.stack([pow2(-ea), pow2(-eb)]), factors(ea, eb)])


def times(x, f):
    """``x * f``, or ``x`` itself where ``f`` is None (a kernel form without the power of two: the same expression)."""
    return x if f is None else x * f


def scale_states(x: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor | None:
    """``x [N, HV, ., .]`` (a state or its gradient; None passes) times ``s [HV]`` per value head, in ``x``'s dtype."""
    return None if x is None else (x.float() * s[:, None, None]).to(x.dtype)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` fp32, exactly (built from exponent bits), for int ``e`` in [-126, 127]."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def factors(ea: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
    """[2, HV] fp32: ``2^ea`` (dv, dh0) and ``2^(ea + eb)`` (dq, dk, dg, dbeta; the exponent clamped to [-126, 127],
    past which the gradient is out of fp32's normal range anyway)."""
    return torch.stack([pow2(ea), pow2((ea + eb).clamp(-126, 127))])


def unscale(grads, f: torch.Tensor, H: int, in_kernels: bool = False):
    """(dq, dk, dv, dg, dbeta, dh0) of the scaled inputs (dq, dk [..., H, K], dv [..., HV, V], dg, dbeta [..., HV],
    dh0 [N, HV, ., .] or None) as the unscaled inputs' gradients, in place, each in its dtype, by ``f = factors(ea,
    eb)``: dv, dh0 times ``2^ea``, the others times ``2^(ea + eb)`` (per q/k head: its group's).  ``in_kernels``: dq,
    dk, dv are already (the one forms of dh_ws and dqk store them so)."""
    dq, dk, dv, dg, db, dh0 = grads
    HV = f.shape[1]
    if not in_kernels:
        dq.mul_(f[1, ::HV // H, None])
        dk.mul_(f[1, ::HV // H, None])
        dv.mul_(f[0, :, None])
    dg.mul_(f[1])
    db.mul_(f[1])
    if dh0 is not None:
        dh0.mul_(f[0, :, None, None])
    return dq, dk, dv, dg, db, dh0
