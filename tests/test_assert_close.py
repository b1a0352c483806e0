"""parity.assert_close against a tolerances document: passes, failures in the one message pattern, lookups."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parity
from cases import Case
from parity import recommend

ROOT = Path(__file__).resolve().parent.parent
CASE = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="gauss-l2")
O_GROUP = "bf16/fp32/<=2k/gauss-l2/qwen-style/o"


def _entry(tensor, rel, maxd, **key):
    e = {"dtype": "bf16", "g_dtype": "fp32", "T_range": "<=2k", "family": "gauss-l2/qwen-style", "tensor": tensor,
         "rel_rmse": rel, "max_diff": maxd, "excluded": []}
    e.update(key)
    return e


DOC = {"format": recommend.FORMAT, "version": recommend.VERSION, "entries": [
    _entry("o", 6e-3, 3e-2), _entry("ht", 5e-3, 1e-2),
    _entry("o", None, None, family="gate-extremes", excluded=["flash-qla"])]}


def _pair(shape=(1, 64, 2, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=gen, dtype=torch.float64)
    return ref.to(torch.bfloat16), ref


def test_within_the_recommended_tolerance_passes_and_returns_the_metrics():
    out, ref = _pair()
    m = parity.assert_close(out, ref, CASE, tolerances=DOC)
    assert 0 < m.rel_rmse < 6e-3 and m.max_diff < 3e-2 and m.finite


def test_rel_rmse_over_the_bound_fails_in_the_failure_pattern():
    out, ref = _pair()
    bad = (ref * 1.05).to(torch.bfloat16)
    with pytest.raises(AssertionError) as exc:
        parity.assert_close(bad, ref, CASE, tolerances=DOC, backend="my-kernel")
    msg = str(exc.value)
    pattern = (rf"^o rel_rmse [45]\.\d{{3}}e-02 > 6\.000e-03 \(recommended for {re.escape(O_GROUP)} by the given "
               rf"tolerances\) \| case {re.escape(CASE.id)} \| backend my-kernel \(assert_close\) \| "
               rf"worst at sequence 0, "
               rf"token \d+, head \d, channel \d \| rerun: python -m parity run --case {re.escape(CASE.id)} "
               rf"--backends my-kernel --workers 0")
    assert re.match(pattern, msg), msg


def test_max_diff_alone_can_fail_and_is_located():
    out, ref = _pair(shape=(1, 64, 2, 64))
    out = ref.clone().to(torch.float32)
    out[0, 17, 1, 3] += 0.1  # rel_rmse ~ 0.1 / sqrt(8192) ~ 1e-3 < 6e-3, max_diff 0.1 > 3e-2
    with pytest.raises(AssertionError, match=r"^o max_diff 1\.000e-01 > 3\.000e-02 .*worst at sequence 0, token 17, "
                                             r"head 1, channel 3 \|"):
        parity.assert_close(out, ref, CASE, tolerances=DOC)


def test_nan_fails_first_even_when_the_rest_is_far_off():
    out, ref = _pair()
    bad = (ref * 2).to(torch.float32)
    bad[0, 3, 1, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"^o nan/inf 1 NaN and 0 Inf > 0 \| .*worst at sequence 0, token 3, "
                                             r"head 1, channel 2"):
        parity.assert_close(bad, ref, CASE, tolerances=DOC)


def test_keywords_instead_of_a_case(tmp_path):
    out, ref = _pair()
    path = recommend.write_tolerances(DOC, tmp_path / "tolerances.json")
    # dtype from o's dtype (bf16), T from its shape (64): the <=2k group
    parity.assert_close(out, ref, tolerances=str(path), gate_dtype="fp32", dist="qwen-gates")
    with pytest.raises(AssertionError, match=r"\| case - \| backend - .* \| rerun: the calling test"):
        parity.assert_close((ref * 1.1).to(torch.bfloat16), ref, tolerances=path, gate_dtype="fp32",
                            dist="gauss-l2/qwen-style")
    with pytest.raises(ValueError, match="pass case= or gate_dtype=, dist="):
        parity.assert_close(out, ref, tolerances=path)
    ht_ref = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="pass case= or dtype=, T="):  # a state tells neither
        parity.assert_close(ht_ref.float(), ht_ref, tensor="ht", tolerances=path, gate_dtype="fp32", dist="gauss-l2")
    parity.assert_close(ht_ref.float(), ht_ref, CASE, tensor="ht", tolerances=path)
    with pytest.raises(AssertionError, match=r"^ht rel_rmse .* > 5\.000e-03 .*worst at sequence 0, final, head"):
        parity.assert_close(ht_ref.float() * 1.01, ht_ref, CASE.id, tensor="ht", tolerances=path)


def test_uncovered_groups_and_groups_without_a_passing_backend_never_pass(monkeypatch):
    out, ref = _pair()
    with pytest.raises(KeyError, match=r"no recommended tolerance for bf16/bf16/<=2k/gauss-l2/qwen-style/o"):
        parity.assert_close(out, ref, CASE.replace(g_dtype="bf16", beta_dtype="bf16"), tolerances=DOC)
    with pytest.raises(ValueError, match=r"no backend passed on group bf16/fp32/<=2k/gate-extremes/o, .*flash-qla"):
        parity.assert_close(out, ref, CASE.replace(dist="strong-decay"), tolerances=DOC)
    monkeypatch.delenv("GDN_PARITY_TOLERANCES", raising=False)
    with pytest.raises(ValueError, match=r"assert_close needs tolerances="):
        parity.assert_close(out, ref, CASE)


def test_default_path_from_the_environment(tmp_path, monkeypatch):
    path = recommend.write_tolerances(DOC, tmp_path / "t.json")
    monkeypatch.setenv("GDN_PARITY_TOLERANCES", str(path))
    out, ref = _pair()
    assert parity.assert_close(out, ref, CASE).finite


@pytest.mark.slow  # two fresh interpreters importing torch
def test_lazy_export_imports_nothing_heavy_and_works_in_either_import_order():
    code = """
import sys
import parity
heavy = [m for m in ("parity.assert_close", "pandas", "matplotlib", "fla", "flash_qla", "tilelang", "triton")
         if m in sys.modules]
assert not heavy, heavy
assert callable(parity.assert_close) and parity.assert_close.__name__ == "assert_close"
"""
    other_order = """
import parity.assert_close
import parity
import torch
from parity import assert_close
ref = torch.ones(1, 4, 1, 2, dtype=torch.float64)
doc = {"format": "gdn-parity-tolerances", "version": 1, "entries": [{"dtype": "fp32", "g_dtype": "fp32",
       "T_range": "<=2k", "family": "gauss-l2/qwen-style", "tensor": "o", "rel_rmse": 1e-6, "max_diff": 1e-6}]}
parity.assert_close(ref.float(), ref, tolerances=doc, gate_dtype="fp32", dist="gauss-l2")
assert_close(ref.float(), ref, tolerances=doc, gate_dtype="fp32", dist="gauss-l2")
"""
    for src in (code, other_order):
        res = subprocess.run([sys.executable, "-c", src], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("make, words", [
    (lambda out, ref: (out[:, :0], ref[:, :0]), "out (o) is empty"),
    (lambda out, ref: (out, ref[:, :0]), "ref (o) is empty"),
    (lambda out, ref: (torch.zeros_like(out), torch.zeros_like(ref)), "ref (o) is all zeros"),
    (lambda out, ref: (out, torch.zeros_like(ref)), "ref (o) is all zeros"),
    (lambda out, ref: (out, ref.index_fill(1, torch.tensor([3]), float("nan"))), "ref (o) holds 16 NaN/Inf"),
    (lambda out, ref: (out[:, :32], ref), "out (o) has shape (1, 32, 2, 8), ref (1, 64, 2, 8)"),
    (lambda out, ref: (out.tolist(), ref), "out (o) must be a torch.Tensor, got list"),
], ids=["empty-out", "empty-ref", "zeros-both", "zeros-ref", "nan-ref", "shape", "not-a-tensor"])
def test_nothing_to_compare_is_an_error_naming_it_never_a_pass(make, words):
    out, ref = make(*_pair())
    with pytest.raises(ValueError, match=re.escape(words)):
        parity.assert_close(out, ref, CASE, tolerances=DOC)
