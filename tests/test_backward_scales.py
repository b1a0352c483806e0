"""``kernels.backward.scales`` on the CPU: the one-term backward's per-GVA-group exponents, powers of two and
scale-back."""

import math

import pytest
import torch

from kernels.backward.scales import (EXP_MAX, exponents_of_bits, exponents_of_maxima, factors, group_exponents,
                                     magnitude_bits, pow2, scales_and_factors, unscale)


def test_group_exponents_put_each_groups_largest_magnitude_in_one_to_two():
    """Each GVA group's largest magnitude over x and extra lands in [1, 2) under 2^-e; the group's heads share e."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 8, 16, generator=g)
    x[..., 0:2, :] *= 2.0 ** -30
    x[..., 2:4, :] *= 2.0 ** 20
    extra = torch.randn(2, 8, 16, 16, generator=g)
    extra[:, 4] = 1e6                                  # group 2 (heads 4, 5) set by extra alone
    e = group_exponents(x, extra, 4)
    s = pow2(-e)
    for grp in range(4):
        heads = slice(2 * grp, 2 * grp + 2)
        m = max(x[..., heads, :].abs().max(), extra[:, heads].abs().max())
        assert e[2 * grp] == e[2 * grp + 1], grp
        assert 1 <= float(m) * float(s[2 * grp]) < 2, (grp, float(m), int(e[2 * grp]))


@pytest.mark.parametrize("m, want", [(0.0, 0), (float("inf"), 0), (float("nan"), 0), (2.0 ** -149, -EXP_MAX),
                                     (2.0 ** 127, EXP_MAX), (1.0, 0), (1.9999999, 0), (0.5, -1), (3.0, 1)])
def test_exponents_of_maxima_edges(m, want):
    """Zero and non-finite maxima pass unscaled (e = 0); subnormal and huge ones clamp to +-EXP_MAX (2^-e normal);
    near a power of two the exponent is floor(log2 m) exactly (frexp, no rounded log)."""
    e = exponents_of_maxima(torch.tensor([m, m], dtype=torch.float32), None, 1)
    assert e.tolist() == [want, want], (m, e.tolist())


def test_pow2_and_factors_are_exact_powers_of_two():
    e = torch.arange(-126, 128)
    assert torch.equal(pow2(e), torch.exp2(e.double()).float())
    ea, eb = torch.tensor([100, -3, -120]), torch.tensor([100, 5, -120])
    f = factors(ea, eb)
    assert f[0].tolist() == [2.0 ** 100, 2.0 ** -3, 2.0 ** -120]
    assert f[1].tolist() == [2.0 ** 127, 2.0 ** 2, 2.0 ** -126], "the combined exponent clamps to fp32's range"


def test_unscale_scales_each_gradient_by_its_power_of_two_in_its_dtype():
    """dv, dh0 by 2^ea, dq, dk (per q/k head, its group's), dg, dbeta by 2^(ea + eb), in place, dtypes kept, and
    exactly: a bf16 value times a power of two is a bf16 value."""
    g = torch.Generator().manual_seed(1)
    H, HV = 2, 4
    ea, eb = torch.tensor([3, 3, -5, -5], dtype=torch.int32), torch.tensor([-1, -1, 7, 7], dtype=torch.int32)
    dq = torch.randn(1, 9, H, 8, generator=g).bfloat16()
    dk = torch.randn(1, 9, H, 8, generator=g).bfloat16()
    dv = torch.randn(1, 9, HV, 8, generator=g).bfloat16()
    dg, db = torch.randn(1, 9, HV, generator=g), torch.randn(1, 9, HV, generator=g).bfloat16()
    dh0 = torch.randn(2, HV, 8, 8, generator=g)
    before = [t.clone() for t in (dq, dk, dv, dg, db, dh0)]
    out = unscale((dq, dk, dv, dg, db, dh0), factors(ea, eb), H)
    a, ab = 2.0 ** ea.double(), 2.0 ** (ea + eb).double()
    want = [before[0].double() * ab[::2, None], before[1].double() * ab[::2, None], before[2].double() * a[:, None],
            before[3].double() * ab, before[4].double() * ab, before[5].double() * a[:, None, None]]
    for name, got, src, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out, before, want):
        assert got.dtype == src.dtype, name
        assert torch.equal(got.double(), w), name
    assert out[0] is dq and out[5] is dh0, "in place"
    dq2, dv2 = before[0].clone(), before[2].clone()
    kept = unscale((dq2, dk, dv2, dg, db, None), factors(ea, eb), H, in_kernels=True)
    assert torch.equal(kept[0], before[0]) and torch.equal(kept[2], before[2]), "in_kernels: dq, dk, dv as they are"


def test_exponents_of_bits_are_floor_log2_of_each_groups_largest_magnitude():
    """From the maxima's bits alone (``gdn_bwd_convert``'s form): floor(log2 m) of each group's largest magnitude
    (frexp), clamped to +-EXP_MAX; 0 for a group whose maximum is 0, inf or NaN."""
    g = torch.Generator().manual_seed(2)
    m = torch.rand(64, generator=g) * torch.exp2(torch.randint(-140, 128, (64,), generator=g).float())
    m[0:4] = 0
    m[5] = float("nan")
    m[9] = float("inf")
    e = exponents_of_bits(magnitude_bits(m), 16)
    for grp in range(16):
        mx = m[4 * grp:4 * grp + 4]
        top = float(mx.max()) if not mx.isnan().any() else float("nan")
        want = 0 if top == 0 or not math.isfinite(top) else max(-EXP_MAX, min(EXP_MAX, math.frexp(top)[1] - 1))
        assert e[4 * grp:4 * grp + 4].tolist() == [want] * 4, (grp, top, e[4 * grp].item())


def test_scales_and_factors_are_the_applied_powers_and_their_inverses():
    """Rows ``2^-ea``, ``2^-eb`` (applied to dO, v) and ``factors(ea, eb)``: row 2 times row 0 is 1, row 3 times rows
    0 and 1 is 1 where the combined exponent is in range."""
    bits = magnitude_bits(torch.tensor([[3.0, 0.25, 1e30, 5.0], [0.1, 7.0, 1e-30, 0.0]]))
    sf = scales_and_factors(bits, 4)
    ea = exponents_of_bits(bits[0], 4)
    eb = exponents_of_bits(bits[1], 4)
    assert torch.equal(sf[0], pow2(-ea)) and torch.equal(sf[1], pow2(-eb))
    assert torch.equal(sf[2:], factors(ea, eb))
    assert torch.equal(sf[2] * sf[0], torch.ones(4)) and torch.equal(sf[3] * sf[0] * sf[1], torch.ones(4))
