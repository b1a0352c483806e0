"""Error by token position and by head (parity.positional) on constructed inputs with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from cases import Case
from parity import metrics, positional
from parity.backends import get_backend
from parity.execute import FP64, run_case
from parity.positional import N_BINS, bin_index, decode, encode, row_columns, state_profile, token_profile


def _direct(out, ref, cu=None):
    """Token by token in plain Python: the bin of token p of a sequence of length L is floor(16 p / L)."""
    B, T, H = out.shape[:3]
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    d2, r2 = [0.0] * N_BINS, [0.0] * N_BINS
    hd2, hr2 = [0.0] * H, [0.0] * H
    for b, start, end in seqs:
        for t in range(start, end):
            i = (t - start) * N_BINS // (end - start)
            x, r = out[b, t].double().reshape(H, -1), ref[b, t].double().reshape(H, -1)
            dd, rr = ((x - r) ** 2).sum(-1), (r * r).sum(-1)
            d2[i] += float(dd.sum())
            r2[i] += float(rr.sum())
            for h in range(H):
                hd2[h] += float(dd[h])
                hr2[h] += float(rr[h])
    pos = [math.sqrt(a / c) if c > 0 else math.nan for a, c in zip(d2, r2)]
    return pos, [math.sqrt(a / c) for a, c in zip(hd2, hr2)]


def _close(got, want, rel=2e-3):  # stored values carry 4 significant digits
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if math.isnan(w):
            assert math.isnan(g)
        else:
            assert g == pytest.approx(w, rel=rel, abs=1e-300)


def test_error_in_one_token_range_and_head_lands_in_one_bin_and_head():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 32, 3, 4, generator=gen, dtype=torch.float64)
    out = ref.clone()
    out[1, 10:12, 1] += 0.25  # tokens 10, 11 of 32 -> bin floor(16 * 10 / 32) = 5, head 1
    pos, head = token_profile(out, ref)
    assert [i for i, v in enumerate(pos) if v != 0] == [5]
    bin_ref = ref[:, 10:12].pow(2).sum()  # both rows' tokens 10 and 11, every head
    assert pos[5] == pytest.approx(math.sqrt(2 * 4 * 0.0625 / float(bin_ref)), rel=1e-3)
    assert head[0] == 0 and head[2] == 0
    assert head[1] == pytest.approx(math.sqrt(2 * 4 * 0.0625 / float(ref[:, :, 1].pow(2).sum())), rel=1e-3)


def test_dense_bins_are_sixteenths_of_the_row():
    t = torch.arange(100)
    idx = bin_index(t, 100, None)
    assert idx.tolist() == [p * 16 // 100 for p in range(100)]
    counts = torch.bincount(idx).tolist()  # bin i: tokens [ceil(100 i / 16), ceil(100 (i + 1) / 16))
    assert counts == [math.ceil(100 * (i + 1) / 16) - math.ceil(100 * i / 16) for i in range(16)]
    assert sum(counts) == 100 and set(counts) == {6, 7}


def test_varlen_positions_are_normalised_per_sequence():
    cu = torch.tensor([0, 3, 3, 10])  # lengths 3, 0 (empty), 7
    assert bin_index(torch.arange(10), 10, cu).tolist() == [0, 5, 10, 0, 2, 4, 6, 9, 11, 13]
    ref = torch.ones(1, 10, 2, 3, dtype=torch.float64)
    out = ref.clone()
    out[0, 9, 0] += 1.0  # the last token of the third sequence: position 6 of 7 -> bin 13
    pos, head = token_profile(out, ref, cu)
    occupied = {0, 2, 4, 5, 6, 9, 10, 11, 13}
    for i, v in enumerate(pos):
        if i == 13:
            assert v == pytest.approx(math.sqrt(3 / 6), rel=1e-3)  # 3 of the bin's 2 x 3 values off by 1
        elif i in occupied:
            assert v == 0.0
        else:
            assert math.isnan(v), (i, v)  # no token falls into this bin
    assert head[1] == 0.0 and head[0] == pytest.approx(math.sqrt(3 / 30), rel=1e-3)


def test_blockwise_equals_direct(monkeypatch):
    monkeypatch.setattr(metrics, "BLOCK", 7)  # smaller than one token: one token per block
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 37, 3, 5, generator=gen, dtype=torch.float64)
    out = (ref + 1e-2 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    pos, head = token_profile(out, ref)
    want_pos, want_head = _direct(out, ref)
    _close(pos, want_pos)
    _close(head, want_head)
    monkeypatch.setattr(metrics, "BLOCK", 40)  # a few tokens per block, packed sequences
    cu = [0, 5, 5, 29, 37]
    ref1, out1 = ref[:1], out[:1]
    pos, head = token_profile(out1, ref1, torch.tensor(cu))
    want_pos, want_head = _direct(out1, ref1, cu)
    _close(pos, want_pos)
    _close(head, want_head)


def test_never_upcasts_more_than_a_block(monkeypatch):
    monkeypatch.setattr(metrics, "BLOCK", 64)
    seen = []
    real = positional._block_sums

    def spy(x, r):
        seen.append(x.numel())
        assert x.dtype == torch.float64
        return real(x, r)

    monkeypatch.setattr(positional, "_block_sums", spy)
    ref = torch.randn(1, 200, 4, 4, dtype=torch.float64)
    token_profile(ref.float(), ref)
    assert seen and max(seen) <= 64 and sum(seen) == ref.numel()
    seen.clear()
    state_profile(torch.zeros(10, 2, 4, 4), torch.ones(10, 2, 4, 4, dtype=torch.float64))
    assert max(seen) <= 64 and sum(seen) == 320


def test_non_finite_outputs_poison_only_their_bin_and_head():
    ref = torch.ones(1, 32, 2, 2, dtype=torch.float64)
    out = ref.float().clone()
    out[0, 31, 1, 0] = float("nan")
    out[0, 0, 1, 1] = float("inf")
    pos, head = token_profile(out, ref)
    assert math.isnan(pos[0]) and math.isnan(pos[15]) and all(v == 0.0 for v in pos[1:15])
    assert head[0] == 0.0 and math.isnan(head[1])


def test_zero_reference_conventions_match_compare():
    ref = torch.zeros(1, 16, 1, 2, dtype=torch.float64)
    out = ref.clone()
    out[0, 3] = 1.0
    pos, head = token_profile(out, ref)
    assert pos[3] == math.inf and pos[2] == 0.0 and head == [math.inf]
    assert metrics.compare(out, ref).rel_rmse == math.inf


def test_state_per_head():
    ref = torch.ones(3, 4, 2, 2, dtype=torch.float64)
    out = ref.clone()
    out[2, 3] *= 1.5  # head 3 of the last sequence: 4 elements off by 0.5 out of 3 x 4 elements
    assert state_profile(out, ref) == [0.0, 0.0, 0.0, pytest.approx(math.sqrt(4 * 0.25 / 12), rel=1e-3)]


def test_columns_encode_as_strict_json_and_decode_back():
    vals = [0.0, 1.234567e-3, math.nan, math.inf]
    enc = encode(vals)
    assert enc == [0.0, 1.234567e-3, None, "inf"]
    dec = decode(enc)
    assert dec[:2] == vals[:2] and math.isnan(dec[2]) and dec[3] == math.inf
    assert decode(None) is None and decode(math.nan) is None  # rows written before these columns
    ref = torch.randn(1, 20, 2, 3, dtype=torch.float64)
    cols = row_columns("o", ref.to(torch.bfloat16), ref)
    assert len(cols["pos_rel_rmse"]) == N_BINS and len(cols["head_rel_rmse"]) == 2
    assert cols["pos_convention"] == positional.POS_CONVENTION
    assert all(v == float(f"{v:.3e}") for v in cols["head_rel_rmse"] + cols["pos_rel_rmse"])  # 4 digits
    assert set(row_columns("ht", ref[:, 0], ref[:, 0])) == {"head_rel_rmse"}
    assert row_columns("h", ref, ref) == {}  # not a token or state tensor of this module


def test_runner_rows_carry_the_columns_against_fp64_only():
    case = Case(layout="varlen-ragged", T=40, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
    rows = []
    run_case(case, [get_backend("torch-emulated"), get_backend("ref-recurrent")], torch.device("cpu"), None,
             lambda name, rs: rows.extend(rs), repeat=False)
    fp64 = {(r["backend"], r["tensor"]): r for r in rows if r["against"] == FP64}
    o = fp64[("torch-emulated", "o")]
    pos, head = decode(o["pos_rel_rmse"]), decode(o["head_rel_rmse"])
    assert len(pos) == N_BINS and len(head) == case.HV and all(0 < v < 0.1 for v in head)
    filled = [v for v in pos if not math.isnan(v)]  # 8 ragged sequences: short ones leave some bins empty
    assert len(filled) >= 8 and all(0 < v < 0.1 for v in filled)
    assert len(decode(fp64[("torch-emulated", "ht")]["head_rel_rmse"])) == case.HV
    assert "pos_rel_rmse" not in fp64[("torch-emulated", "ht")]
    floor = decode(fp64[("fp64-rounded", "o")]["pos_rel_rmse"])
    assert all(0 < v < 1e-2 for v in floor if not math.isnan(v))
    pairwise = [r for r in rows if r["against"] != FP64]
    assert pairwise and all("pos_rel_rmse" not in r and "head_rel_rmse" not in r for r in pairwise)
