"""Metrics on constructed pairs with known answers (meta-tests of the harness's own yardstick)."""

from __future__ import annotations

import math

import pytest
import torch

from parity import metrics
from parity.metrics import Location, compare, locate


def test_identical_tensors():
    ref = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    m = compare(ref.clone(), ref)
    assert (m.max_diff, m.mean_diff, m.rel_rmse) == (0.0, 0.0, 0.0)
    assert m.cos_sim == pytest.approx(1.0, abs=1e-15)
    assert m.max_ref == float(ref.abs().max()) and m.numel == ref.numel() and m.finite


def test_single_perturbation_located():
    ref = torch.zeros(2, 5, 3, 4, dtype=torch.float64)
    ref[...] = 1.0
    out = ref.clone()
    out[1, 2, 0, 3] += 0.5
    m = compare(out, ref)
    assert m.max_diff == 0.5
    assert m.mean_diff == pytest.approx(0.5 / ref.numel())
    assert m.rel_rmse == pytest.approx(math.sqrt(0.25 / ref.numel()))
    assert m.where == Location(seq=1, token=2, head=0, channel=3)


def test_scaled_output_rel_rmse_and_cos():
    ref = torch.randn(1000, dtype=torch.float64).reshape(1, 10, 10, 10)
    m = compare(ref * 1.01, ref)
    assert m.rel_rmse == pytest.approx(0.01, rel=1e-9)
    assert m.cos_sim == pytest.approx(1.0, abs=1e-12)
    m = compare(-ref, ref)
    assert m.cos_sim == pytest.approx(-1.0, abs=1e-12) and m.rel_rmse == pytest.approx(2.0)


def test_orthogonal_cos_is_zero():
    ref = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(1, 1, 1, 2)
    out = torch.tensor([0.0, 1.0], dtype=torch.float32).reshape(1, 1, 1, 2)
    assert compare(out, ref).cos_sim == 0.0


def test_nan_and_inf_are_counted_and_poison_the_diffs():
    ref = torch.ones(1, 4, 1, 2, dtype=torch.float64)
    out = ref.clone().float()
    out[0, 1, 0, 1] = float("nan")
    out[0, 3, 0, 0] = float("inf")
    m = compare(out, ref)
    assert (m.nan_count, m.inf_count) == (1, 1) and not m.finite
    assert math.isnan(m.max_diff) and math.isnan(m.rel_rmse) and math.isnan(m.cos_sim)
    assert m.where == Location(seq=0, token=1, head=0, channel=1)  # the first non-finite element


def test_varlen_location_maps_to_sequence_and_token():
    ref = torch.zeros(1, 10, 2, 3, dtype=torch.float64)
    out = ref.clone()
    out[0, 7, 1, 2] = 1.0
    m = compare(out, ref, cu_seqlens=torch.tensor([0, 3, 3, 10]))
    assert m.where == Location(seq=2, token=4, head=1, channel=2)


def test_state_location():
    assert locate(2 * 3 * 4 * 5 - 1, (2, 3, 4, 5), metrics.STATE_KIND) == Location(1, None, 2, "3,4")
    assert str(Location(1, None, 2, "3,4")) == "sequence 1, final, head 2, channel 3,4"


def test_blockwise_equals_direct(monkeypatch):
    monkeypatch.setattr(metrics, "BLOCK", 7)  # force many blocks
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 9, 3, 5, generator=gen, dtype=torch.float64)
    out = (ref + 1e-3 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    m = compare(out, ref)
    d = out.double() - ref
    assert m.max_diff == pytest.approx(float(d.abs().max()), rel=1e-12)
    assert m.mean_diff == pytest.approx(float(d.abs().mean()), rel=1e-12)
    assert m.rel_rmse == pytest.approx(float(d.norm() / ref.norm()), rel=1e-12)
    assert m.cos_sim == pytest.approx(float((out.double() * ref).sum() / (out.double().norm() * ref.norm())),
                                      rel=1e-12)
    flat = int(d.abs().argmax())
    assert m.where == locate(flat, tuple(ref.shape))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"shape mismatch: output \(1, 2\) vs reference \(2, 1\)"):
        compare(torch.zeros(1, 2), torch.zeros(2, 1, dtype=torch.float64))


def test_empty_tensor():
    m = compare(torch.zeros(1, 0, 2, 3), torch.zeros(1, 0, 2, 3, dtype=torch.float64))
    assert m.numel == 0 and m.max_diff == 0.0 and m.rel_rmse == 0.0 and m.where is None


def test_as_row_flattens_location():
    ref = torch.zeros(1, 2, 1, 1, dtype=torch.float64)
    out = ref.clone()
    out[0, 1] = 2.0
    row = compare(out, ref).as_row()
    assert row["where_seq"] == 0 and row["where_token"] == 1 and row["where_head"] == 0 and row["where_channel"] == 0
    assert row["rel_rmse"] == math.inf  # a zero reference with a non-zero output
