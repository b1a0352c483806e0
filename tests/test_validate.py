"""Bad input gets a ValueError that names the problem, from the references (and so from the harness)."""

from __future__ import annotations

import pytest
import torch

import reference
from reference import emulated
from tests.strategies import gdn_tensors

FNS = [reference.fused_recurrent_gated_delta_rule, reference.chunk_gated_delta_rule, emulated.chunk_gated_delta_rule]


def _ok(B=1, T=10, H=2, HV=4, K=8, V=4):
    q, k, v, g, beta = gdn_tensors(B, T, H, HV, K, V, seed=0, dtype=torch.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


CASES = {
    "q with 3 dims": (lambda kw: kw.update(q=kw["q"][0]), r"q must have shape \[B, T, H, K\]"),
    "k shape": (lambda kw: kw.update(k=kw["k"][:, :, :1]), r"k must have the shape of q"),
    "v batch": (lambda kw: kw.update(v=kw["v"][:, :5]), r"v must be \[B=1, T=10, HV, V\]"),
    "HV not a multiple of H": (lambda kw: kw.update(v=torch.randn(1, 10, 3, 4), g=torch.randn(1, 10, 3),
                                                    beta=torch.rand(1, 10, 3)), r"HV=3 .* multiple of H=2"),
    "g shape": (lambda kw: kw.update(g=kw["g"][:, :, :2]), r"g must be \[B, T, HV\]"),
    "beta shape": (lambda kw: kw.update(beta=kw["beta"][:, :9]), r"beta must be \[B, T, HV\]"),
    "integer q": (lambda kw: kw.update(q=torch.ones(1, 10, 2, 8, dtype=torch.int32)), r"q must be a floating"),
    "NaN in v": (lambda kw: kw["v"].__setitem__((0, 3, 1, 2), float("nan")), r"v contains 1 NaN and 0 Inf"),
    "Inf in g": (lambda kw: kw["g"].__setitem__((0, 0, 0), float("-inf")), r"g contains 0 NaN and 1 Inf"),
    "cu_seqlens not at 0": (lambda kw: kw.update(cu_seqlens=torch.tensor([1, 10])), r"cu_seqlens must start at 0"),
    "cu_seqlens decreasing": (lambda kw: kw.update(cu_seqlens=torch.tensor([0, 6, 4, 10])),
                              r"non-decreasing.*cu_seqlens\[2\]=4"),
    "cu_seqlens past T": (lambda kw: kw.update(cu_seqlens=torch.tensor([0, 4, 11])),
                          r"must end at most at T=10 .*got 11"),
    "cu_seqlens float": (lambda kw: kw.update(cu_seqlens=torch.tensor([0.0, 10.0])), r"cu_seqlens must be int32"),
    "h0 wrong shape": (lambda kw: kw.update(initial_state=torch.zeros(1, 4, 4, 8)), r"initial_state must be"),
    "h0 count vs cu_seqlens": (lambda kw: kw.update(initial_state=torch.zeros(1, 4, 8, 4),
                                                    cu_seqlens=torch.tensor([0, 5, 10])), r"\(2, 4, 8, 4\)"),
    "NaN in h0": (lambda kw: kw.update(initial_state=torch.full((1, 4, 8, 4), float("nan"))),
                  r"initial_state contains 128 NaN"),
}


@pytest.mark.parametrize("fn", FNS, ids=["recurrent", "chunk", "emulated"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_the_problem(fn, name):
    kw = _ok()
    mutate, pattern = CASES[name]
    mutate(kw)
    with pytest.raises(ValueError, match=pattern):
        fn(**kw)


@pytest.mark.parametrize("fn", FNS, ids=["recurrent", "chunk", "emulated"])
def test_batch_with_cu_seqlens_is_rejected(fn):
    kw = _ok(B=2)
    with pytest.raises(ValueError, match=r"B must be 1 when cu_seqlens is given.*B=2"):
        fn(**kw, cu_seqlens=torch.tensor([0, 10]))


def test_state_v_first_shape_is_checked():
    kw = _ok()
    with pytest.raises(ValueError, match=r"\[N, HV, V, K\] \(state_v_first\)"):
        reference.chunk_gated_delta_rule(**kw, initial_state=torch.zeros(1, 4, 8, 4), state_v_first=True)


def test_valid_input_passes():
    o, s = reference.chunk_gated_delta_rule(**_ok(), output_final_state=True)
    assert o.shape == (1, 10, 4, 4) and s.shape == (1, 4, 8, 4)
