"""The fp64 references: hand-computed cases, recurrent vs chunked, the structural properties, gradcheck,
per-chunk states and the emulated low-precision path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from reference import emulated
from reference.prepare import l2norm
from tests.strategies import gdn_tensors, head_config, rel_err, seq_length, varlen_lengths

REFS = {"recurrent": reference.fused_recurrent_gated_delta_rule, "chunk": reference.chunk_gated_delta_rule}
D = torch.float64


def _t(x):
    return torch.tensor(x, dtype=D)


def _hand_inputs(T: int):
    """K = V = 2, one head. Token 1: q=[1,0], k=[.6,.8], v=[1,2], g=ln .5, beta=.5. Token 2: q=[0,1], k=[1,0],
    v=[0,1], g=0, beta=1."""
    q = _t([[1.0, 0.0], [0.0, 1.0]])[:T].reshape(1, T, 1, 2)
    k = _t([[0.6, 0.8], [1.0, 0.0]])[:T].reshape(1, T, 1, 2)
    v = _t([[1.0, 2.0], [0.0, 1.0]])[:T].reshape(1, T, 1, 2)
    g = _t([math.log(0.5), 0.0])[:T].reshape(1, T, 1)
    beta = _t([0.5, 1.0])[:T].reshape(1, T, 1)
    return q, k, v, g, beta


@pytest.mark.parametrize("impl", sorted(REFS))
def test_hand_computed_t1_without_state(impl):
    # S' = 0, u = .5 [1, 2] = [.5, 1], S1 = k u^T = [[.3, .6], [.4, .8]], o = S1^T q = [.3, .6]
    o, s = REFS[impl](*_hand_inputs(1), scale=1.0, output_final_state=True)
    torch.testing.assert_close(o.reshape(2), _t([0.3, 0.6]), rtol=0, atol=1e-15)
    torch.testing.assert_close(s.reshape(2, 2), _t([[0.3, 0.6], [0.4, 0.8]]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("impl", sorted(REFS))
def test_hand_computed_t1_with_state(impl):
    # h0 = I: S' = .5 I, S'^T k = [.3, .4], u = .5([1, 2] - [.3, .4]) = [.35, .8],
    # S1 = .5 I + k u^T = [[.71, .48], [.28, 1.14]], o = row 0 = [.71, .48]
    h0 = torch.eye(2, dtype=D).reshape(1, 1, 2, 2)
    o, s = REFS[impl](*_hand_inputs(1), scale=1.0, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o.reshape(2), _t([0.71, 0.48]), rtol=0, atol=1e-15)
    torch.testing.assert_close(s.reshape(2, 2), _t([[0.71, 0.48], [0.28, 1.14]]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("impl", sorted(REFS))
def test_hand_computed_t2(impl):
    # token 2 from S1 = [[.3, .6], [.4, .8]]: S'^T k2 = [.3, .6], u2 = [-.3, .4], S2 = [[0, 1], [.4, .8]],
    # o2 = S2^T q2 = row 1 = [.4, .8]
    o, s = REFS[impl](*_hand_inputs(2), scale=1.0, output_final_state=True)
    torch.testing.assert_close(o.reshape(2, 2), _t([[0.3, 0.6], [0.4, 0.8]]), rtol=0, atol=1e-15)
    torch.testing.assert_close(s.reshape(2, 2), _t([[0.0, 1.0], [0.4, 0.8]]), rtol=0, atol=1e-15)


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, g, beta = gdn_tensors(1, 5, 1, 1, 16, 4, seed=0)
    o1, _ = reference.chunk_gated_delta_rule(q, k, v, g, beta)
    o2, _ = reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=16 ** -0.5)
    assert torch.equal(o1, o2)


@given(T=seq_length(200), heads=head_config(), B=st.integers(1, 2), seed=st.integers(0, 2**16),
       with_h0=st.booleans(), chunk=st.sampled_from([16, 64]), strong=st.booleans())
def test_chunked_matches_recurrent_dense(T, heads, B, seed, with_h0, chunk, strong):
    H, HV, K, V = heads
    q, k, v, g, beta = gdn_tensors(B, T, H, HV, K, V, seed, gate_scale=20.0 if strong else 1.0)
    h0 = torch.randn(B, HV, K, V, dtype=D, generator=torch.Generator().manual_seed(seed)) if with_h0 else None
    o_r, s_r = reference.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = reference.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                chunk_size=chunk)
    assert rel_err(o_c, o_r) < 1e-12
    assert rel_err(s_c, s_r) < 1e-12


@given(lens=varlen_lengths(allow_empty=True), heads=head_config(), seed=st.integers(0, 2**16), with_h0=st.booleans())
def test_chunked_matches_recurrent_varlen(lens, heads, seed, with_h0):
    H, HV, K, V = heads
    T = sum(lens)
    q, k, v, g, beta = gdn_tensors(1, T, H, HV, K, V, seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    h0 = torch.randn(len(lens), HV, K, V, dtype=D) if with_h0 else None
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_r, s_r = reference.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_c, s_c = reference.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert rel_err(o_c, o_r) < 1e-12
    assert rel_err(s_c, s_r) < 1e-12


@pytest.mark.parametrize("impl", sorted(REFS))
@given(lens=varlen_lengths(allow_empty=True), seed=st.integers(0, 2**16))
def test_varlen_equals_each_sequence_alone(impl, lens, seed):
    fn = REFS[impl]
    T = sum(lens)
    q, k, v, g, beta = gdn_tensors(1, T, 1, 2, 8, 4, seed)
    h0 = torch.randn(len(lens), 2, 8, 4, dtype=D)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:  # an empty sequence passes its initial state through exactly
            assert torch.equal(s[n], h0[n])
            continue
        o_n, s_n = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[n:n + 1],
                      output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < 1e-13
        assert rel_err(s[n], s_n[0]) < 1e-13


@pytest.mark.parametrize("impl", sorted(REFS))
@given(T=seq_length(150), ratio=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
def test_gva_equals_repeated_qk_heads(impl, T, ratio, seed):
    fn = REFS[impl]
    H = 2
    q, k, v, g, beta = gdn_tensors(1, T, H, H * ratio, 8, 4, seed)
    o_gva, s_gva = fn(q, k, v, g, beta, output_final_state=True)
    rep = lambda x: x.repeat_interleave(ratio, dim=2)  # noqa: E731 - value head j reads q/k head j // ratio
    o_rep, s_rep = fn(rep(q), rep(k), v, g, beta, output_final_state=True)
    assert rel_err(o_gva, o_rep) < 1e-14
    assert rel_err(s_gva, s_rep) < 1e-14


@pytest.mark.parametrize("impl", sorted(REFS))
@given(T=seq_length(150), seed=st.integers(0, 2**16))
def test_state_v_first_equals_transpose(impl, T, seed):
    fn = REFS[impl]
    q, k, v, g, beta = gdn_tensors(1, T, 1, 2, 8, 4, seed)
    h0 = torch.randn(1, 2, 8, 4, dtype=D)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_t, s_t = fn(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                  state_v_first=True)
    assert rel_err(o_t, o) < 1e-14  # the same math; only the state's memory layout (and summation order) differ
    assert tuple(s_t.shape) == (1, 2, 4, 8)
    assert rel_err(s_t, s.transpose(-1, -2)) < 1e-14


@pytest.mark.parametrize("impl", sorted(REFS))
@given(T=st.integers(2, 200), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_split_run_with_carried_state_equals_full_run(impl, T, frac, seed):
    fn = REFS[impl]
    t = int(frac * T)
    q, k, v, g, beta = gdn_tensors(1, T, 1, 2, 8, 4, seed)
    o, s = fn(q, k, v, g, beta, output_final_state=True)
    o1, s1 = fn(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], output_final_state=True)
    o2, s2 = fn(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-13
    assert rel_err(s2, s) < 1e-13


def test_in_kernel_transforms_match_precomputed():
    q, k, v, g, beta = gdn_tensors(1, 70, 1, 2, 8, 4, 3)
    a = torch.randn(1, 70, 2, dtype=D)
    A_log, dt_bias = torch.tensor([0.5, 2.0], dtype=D), torch.tensor([-3.0, -5.0], dtype=D)
    logits = torch.randn(1, 70, 2, dtype=D)
    g_pre = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    qn, kn = q * 3.0, k * 0.1
    ref_o, ref_s = reference.fused_recurrent_gated_delta_rule(l2norm(qn), l2norm(kn), v, g_pre, logits.sigmoid(),
                                                              output_final_state=True)
    for fn in REFS.values():
        o, s = fn(qn, kn, v, a, logits, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        assert rel_err(o, ref_o) < 1e-13 and rel_err(s, ref_s) < 1e-13


def test_l2norm_is_flas():
    x = torch.tensor([[3.0, 4.0]], dtype=D)
    assert torch.allclose(l2norm(x), x / math.sqrt(25 + 1e-6), rtol=0, atol=1e-16)


@pytest.mark.parametrize("impl", sorted(REFS))
def test_gradcheck(impl):
    fn = REFS[impl]
    q, k, v, g, beta = gdn_tensors(1, 5, 1, 2, 3, 2, seed=7)
    h0 = torch.randn(1, 2, 3, 2, dtype=D)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **(
            {"chunk_size": 2} if impl == "chunk" else {}))
        return o, s

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def test_gradcheck_varlen_chunk():
    q, k, v, g, beta = gdn_tensors(1, 6, 1, 1, 3, 2, seed=8)
    cu = torch.tensor([0, 2, 2, 6])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def f(*xs):
        return reference.chunk_gated_delta_rule(*xs, output_final_state=True, cu_seqlens=cu, chunk_size=2)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


@given(lens=varlen_lengths(max_len=150), seed=st.integers(0, 2**16))
def test_chunk_states_are_prefix_final_states(lens, seed):
    T = sum(lens)
    C = 16
    q, k, v, g, beta = gdn_tensors(1, T, 1, 1, 4, 4, seed)
    h0 = torch.randn(len(lens), 1, 4, 4, dtype=D)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    _, _, hs = reference.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=C,
                                                output_chunk_states=True)
    assert hs.shape[1] == sum(-(-n // C) for n in lens)
    i = 0
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for c in range(-(-(b - a) // C)):
            end = a + c * C
            _, s = reference.fused_recurrent_gated_delta_rule(q[:, a:end], k[:, a:end], v[:, a:end], g[:, a:end],
                                                              beta[:, a:end], initial_state=h0[n:n + 1],
                                                              output_final_state=True)
            assert rel_err(hs[0, i], s[0]) < 1e-13
            i += 1


def test_emulated_fp32_is_close_to_fp64():
    q, k, v, g, beta = gdn_tensors(1, 300, 2, 4, 32, 32, seed=1)
    o, s = reference.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    f = [x.float() for x in (q, k, v, g, beta)]
    o32, s32 = emulated.chunk_gated_delta_rule(*f, output_final_state=True)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert rel_err(o32, o) < 1e-5 and rel_err(s32, s) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_low_precision_sits_just_above_the_rounding_floor(dtype):
    q, k, v, g, beta = gdn_tensors(1, 500, 2, 4, 64, 64, seed=2)
    lo = [x.to(dtype) for x in (q, k, v)] + [g.float(), beta.float()]
    o, s = reference.chunk_gated_delta_rule(*lo, output_final_state=True)  # fp64 on the rounded inputs
    o_e, s_e = emulated.chunk_gated_delta_rule(*lo, output_final_state=True)
    assert o_e.dtype == dtype and s_e.dtype == torch.float32
    floor = rel_err(o.to(dtype), o)
    err = rel_err(o_e, o)
    assert floor < err < 4 * floor, (err, floor)
    assert rel_err(s_e, s) < 8 * floor


def test_references_are_finite_under_strong_decay_and_zero_gates():
    q, k, v, g, beta = gdn_tensors(1, 200, 1, 2, 8, 8, seed=4)
    g = torch.where(torch.arange(200)[None, :, None] % 2 == 0, torch.full_like(g, -25.0), torch.zeros_like(g))
    for fn in REFS.values():
        o, s = fn(q, k, v, g, beta, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_e, s_e = emulated.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(),
                                               output_final_state=True)
    assert torch.isfinite(o_e).all() and torch.isfinite(s_e).all()
