"""Cases as data: stable ids, validation, deterministic inputs, layouts, distributions and matrices."""

from __future__ import annotations

import pytest
import torch

from cases import DISTRIBUTIONS, LAYOUTS, MATRICES, Case, make_inputs
from cases.case import CONFIG_FIELDS
from cases.layouts import BOUNDARY_LENGTHS
from parity.results import case_fields


def test_id_is_stable_and_readable():
    # A literal on purpose: result files and xfail lists key on this string; changing it is a breaking change.
    c = Case(layout="varlen-ragged", T=20468, H=4, HV=8, dtype="bf16", g_dtype="bf16", beta_dtype="fp32",
             h0_dtype="fp32", dist="qwen-gates", state_v_first=True, grad=True, seed=2)
    assert c.id == ("varlen-ragged_B1_T20468_H4-HV8_K128-V128_bf16_g-bf16_beta-fp32_h0-fp32_qwen-gates_vfirst_grad"
                    "_s2")
    assert c.group_id == c.id[: -len("_s2")]


@pytest.mark.parametrize("matrix", sorted(MATRICES))
def test_every_matrix_case_round_trips_through_its_id(matrix):
    cases = MATRICES[matrix].cases()
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert Case.from_id(c.id) == c


def test_a_row_carries_every_configuration_field_and_rebuilds_the_case():
    case = Case(layout="varlen-ragged", T=300, h0_dtype="fp32", dist="qwen-gates", state_v_first=True, grad=True,
                seed=2)
    fields = case_fields(case)
    assert tuple(fields) == CONFIG_FIELDS and "seed" not in fields and "T" in fields
    assert Case(**fields, seed=case.seed) == case


def test_from_id_without_seed_and_garbage():
    c = Case(T=64)
    assert Case.from_id(c.group_id) == c.replace(seed=0)
    with pytest.raises(ValueError, match="not a case id"):
        Case.from_id("dense_T64")


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(layout="varlen-one", B=2), r"needs B=1, got B=2"),
    (dict(H=3, HV=8), r"HV=8 must be a multiple of Case.H=3"),
    (dict(dist="nope"), r"unknown distribution 'nope'"),
    (dict(layout="nope"), r"unknown layout 'nope'"),
    (dict(dtype="int8"), r"Case.dtype='int8' is not one of"),
    (dict(dist="large-h0"), r"needs h0_dtype"),
    (dict(T=-1), r"non-negative int"),
])
def test_invalid_cases_are_rejected(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Case(**kwargs)


def _small(**kw):
    return Case(T=200, H=2, HV=4, K=16, V=16, **kw)


def test_inputs_are_deterministic_and_seed_dependent():
    a, b = make_inputs(_small()), make_inputs(_small())
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    c = make_inputs(_small(seed=1))
    assert not torch.equal(a.q, c.q)


def test_dtype_twins_share_the_draw():
    f = make_inputs(_small(dtype="fp32"))
    b = make_inputs(_small(dtype="bf16", g_dtype="bf16", beta_dtype="bf16"))
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(getattr(b, name), getattr(f, name).to(torch.bfloat16))
    assert b.q.dtype == torch.bfloat16 and b.g.dtype == torch.bfloat16 and f.g.dtype == torch.float32


def test_initial_state_shapes_and_layouts():
    x = make_inputs(_small(layout="varlen-boundary", h0_dtype="fp32"))
    N = len(x.seq_lens)
    assert x.initial_state.shape == (N, 4, 16, 16) and x.cu_seqlens[-1] == 200
    v = make_inputs(_small(h0_dtype="fp32", state_v_first=True))
    k = make_inputs(_small(h0_dtype="fp32"))
    assert torch.equal(v.initial_state, k.initial_state.transpose(-1, -2))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("T", [3, 64, 637, 4096])
def test_layout_lengths_cover_T(name, T):
    lay = LAYOUTS[name]
    if T < lay.min_T:
        pytest.skip(f"{name} needs T >= {lay.min_T}")
    lens = lay.lengths(T, 1, torch.Generator().manual_seed(0))
    if lay.padded:
        assert sum(lens) < T and all(n >= 0 for n in lens)
    elif lay.varlen:
        assert sum(lens) == T and all(n >= 0 for n in lens)
    elif lay.left_pad:
        assert len(lens) == 1 and 1 <= lens[0] <= T
    else:
        assert lens is None


def test_layout_specifics():
    gen = torch.Generator().manual_seed(0)
    assert LAYOUTS["varlen-boundary"].lengths(sum(BOUNDARY_LENGTHS), 1, gen) == list(BOUNDARY_LENGTHS)
    assert len(LAYOUTS["varlen-short"].lengths(4096, 1, gen)) >= 100
    assert 0 in LAYOUTS["varlen-empty"].lengths(100, 1, gen)
    assert len(LAYOUTS["varlen-ragged"].lengths(32768, 1, gen)) == 8


def test_left_padding_is_exactly_neutral():
    x = make_inputs(_small(layout="left-pad", B=3))
    for b in range(3):
        pad = (x.q[b].abs().sum((-1, -2)) == 0).sum().item()
        assert pad >= 200 - 200 // 4
        assert torch.all(x.g[b, :pad] == 0) and torch.all(x.beta[b, :pad] == 0) and torch.all(x.k[b, :pad] == 0)


def test_distributions_do_what_they_say():
    def draw(dist, **kw):
        return make_inputs(_small(dist=dist, dtype="fp32", **kw))

    x = draw("gauss-l2")
    assert torch.allclose(x.k.norm(dim=-1), torch.ones(()), atol=1e-5)
    assert torch.all(draw("strong-decay").g <= -15) and torch.all(draw("strong-decay").g >= -25)
    s = draw("slow-decay").g
    assert torch.all(s < 0) and torch.all(s >= -1e-2)
    m = draw("mixed-heads").g
    assert torch.all(m[..., 0::2] == 0) and torch.all(m[..., 1::2] <= -15)
    assert (draw("gate-mask").g == 0).float().mean() > 0.2
    b = draw("beta-edges").beta
    assert torch.all((b <= 0.01) | (b >= 0.99))
    r = draw("raw-qk-l2")
    assert r.use_qk_l2norm_in_kernel and r.k.norm(dim=-1).std() > 0.1
    kq = draw("qwen-gates-kernel")
    assert kq.use_gate_in_kernel and kq.use_beta_sigmoid_in_kernel and kq.A_log.shape == (4,)
    assert draw("large-h0", h0_dtype="fp32").initial_state.std() > 20
    q = draw("qwen-gates").g
    assert torch.all(q < 0) and q.min() > -40


def test_every_distribution_has_a_rationale():
    for d in DISTRIBUTIONS.values():
        assert len(d.rationale) > 20, d.name
    for lay in LAYOUTS.values():
        assert len(lay.rationale) > 20, lay.name


def test_matrices_cover_what_the_design_promises():
    std = MATRICES["standard"].cases()
    assert {c.T for c in std} >= {64, 20468, 32768}
    assert {c.dist for c in std} == set(DISTRIBUTIONS)
    assert {c.layout for c in std} == {n for n, lay in LAYOUTS.items() if not lay.padded}
    assert {c.g_dtype for c in std} >= {"fp32", "bf16"} and {c.seed for c in std} == {0, 1, 2}
    grads = [c for c in std if c.grad]  # gradients in the configurations the forward rows cover
    assert {c.dist for c in grads} >= {"strong-decay", "slow-decay"}
    assert any(c.layout.startswith("varlen") and c.h0_dtype and c.state_v_first for c in grads)
    assert {c.g_dtype for c in grads} >= {"fp32", "bf16"} and {c.dtype for c in grads} >= {"bf16", "fp16"}
    assert {c.HV // c.H for c in grads} >= {2, 4}
    assert max(c.T for c in MATRICES["long"].cases()) == 131072
    smoke = MATRICES["smoke"].cases()
    assert max(c.B * c.T for c in smoke) <= 300 and {c.layout for c in smoke} == set(LAYOUTS)
