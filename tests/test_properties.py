"""Structural properties, on every backend available here (the references on a CPU, FLA's Triton kernels under
the interpreter in fp32; every GPU backend on a GPU box, in bf16):

  varlen equals running each sequence alone; an empty sequence passes its initial state through exactly;
  running [0:t] then [t:T] with the carried state equals the full run; GVA equals repeated q/k heads;
  state_v_first equals the transpose.

"Equals" means within the verdict's tolerance for the inputs' dtype: the two runs of the backend may differ by at
most base_factor x the same-precision baseline's error against fp64 on the same inputs (or the rounding floor's,
when larger). Exact checks (the empty sequence) are exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from cases.case import Case
from cases.inputs import GDNInputs
from parity.backends import BACKENDS, get_backend
from parity.tolerances import tolerance_for
from reference import emulated
from tests.strategies import gdn_tensors, rel_err, varlen_lengths

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
DNAME = "bf16" if CUDA else "fp32"
INTERPRETED = {"fla-triton", "fla-recurrent"}  # on a CPU: slow, so few examples and short sequences
# head dims: K = V = 128 on a GPU (what FlashQLA and our kernels require, and what FLA dispatches to FlashQLA), 32 on
# a CPU (references and the Triton interpreter)
D = 128 if CUDA else 32
# the configuration the properties run (T varies; the supports() checks of GPU backends depend on dtype, K, V, arch)
PROPERTY_CASE = Case(T=64, H=1, HV=2, K=D, V=D, dtype=DNAME, dist="gauss-l2")


def _known_empty_sequence_failures() -> dict[str, str]:
    """backend -> reason, from the tests/known_failures.json entries scoped to the varlen-empty layout."""
    from conftest import load_known_failures

    return {e["backend"]: f"{e['reason']} ({e['link']})" for e in load_known_failures()
            if str(e.get("scope", "")).startswith("varlen-empty")}


def _backends(xfail: dict[str, str] | None = None):
    """pytest params, one per backend; ``xfail`` (backend -> reason) marks strict expected failures on a GPU."""
    out = []
    for name in BACKENDS:
        if name == "ref-recurrent":
            continue
        b = get_backend(name)
        ok, reason = b.available()
        marks = [pytest.mark.gpu] if (b.needs_gpu or (CUDA and name != "torch-emulated")) else []
        if not CUDA and name in INTERPRETED:
            marks.append(pytest.mark.slow)
        if name == "fla-dispatch" and not CUDA:
            ok, reason = False, "no GPU: FLA has nothing to dispatch to"
        if ok and b.needs_gpu:  # e.g. a kernel built for another architecture: unsupported, not failing
            ok, reason = b.supports(PROPERTY_CASE, torch.device(DEVICE))
        if not ok:
            marks.append(pytest.mark.skip(reason=reason))
        elif CUDA and xfail and name in xfail:
            marks.append(pytest.mark.xfail(reason=xfail[name], strict=True))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


BACKEND_PARAMS = _backends()
EMPTY_PARAMS = _backends(_known_empty_sequence_failures())
MAX_T = 64 if not CUDA else 300
MAX_T_INTERPRETED = {"fla-triton": 64, "fla-recurrent": 24}  # the interpreter loops in numpy: keep it short


def _examples(name: str) -> int:
    return 3 if (not CUDA and name in INTERPRETED) else 8


def _max_t(name: str) -> int:
    return MAX_T_INTERPRETED.get(name, MAX_T) if not CUDA else MAX_T


def _inputs(lens, H, HV, K, V, seed, h0=True, B=1) -> GDNInputs:
    T = sum(lens) if lens else 0
    q, k, v, g, beta = gdn_tensors(B, T, H, HV, K, V, seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    N = len(lens) if B == 1 else B
    state = torch.randn(N, HV, K, V, generator=gen) if h0 else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if B == 1 else None
    inp = GDNInputs(q=q.to(DTYPE), k=k.to(DTYPE), v=v.to(DTYPE), g=g, beta=beta, initial_state=state,
                    cu_seqlens=cu, seq_lens=list(lens))
    return inp.to(DEVICE)


def _bound(inp: GDNInputs) -> tuple[float, float]:
    """(o bound, state bound) from the baseline's and the floor's errors on these inputs."""
    kw = inp.kwargs()
    o, s = reference.chunk_gated_delta_rule(**kw)
    oe, se = emulated.chunk_gated_delta_rule(**kw)
    out = []
    for tensor, x, r, floor_dt in (("o", oe, o, DTYPE), ("ht", se, s, torch.float32)):
        tol, _ = tolerance_for("property", tensor, DNAME)
        out.append(max(tol.base_rel_rmse * rel_err(x, r), tol.floor_rel_rmse * rel_err(r.to(floor_dt), r), 1e-12))
    return out[0], out[1]


def _run(name: str, inp: GDNInputs):
    res = get_backend(name).run(inp)
    return res.o, res.final_state


def _slice(inp: GDNInputs, a: int, b: int, h0) -> GDNInputs:
    sl = slice(a, b)
    return dataclasses.replace(inp, q=inp.q[:, sl], k=inp.k[:, sl], v=inp.v[:, sl], g=inp.g[:, sl],
                               beta=inp.beta[:, sl], initial_state=h0, cu_seqlens=None, seq_lens=[b - a])


def _check_each_sequence_alone(name: str, inp: GDNInputs) -> None:
    """Run the varlen ``inp`` once, then each sequence alone with its own initial state: equal within the bounds;
    an empty sequence's final state must be its initial state, exactly."""
    o, s = _run(name, inp)
    bo, bs = _bound(inp)
    cu = inp.cu_seqlens.tolist()
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if a == b:
            assert torch.equal(s[n].float(), inp.initial_state[n].float()), f"sequence {n} is empty"
            continue
        o_n, s_n = _run(name, _slice(inp, a, b, inp.initial_state[n:n + 1]))
        assert rel_err(o[:, a:b], o_n) <= bo, (n, rel_err(o[:, a:b], o_n), bo)
        assert rel_err(s[n], s_n[0]) <= bs, (n, rel_err(s[n], s_n[0]), bs)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_varlen_equals_each_sequence_alone(name):
    @settings(max_examples=_examples(name))
    @given(lens=varlen_lengths(max_seqs=3, max_len=_max_t(name) // 2), seed=st.integers(0, 2**16))
    def check(lens, seed):
        _check_each_sequence_alone(name, _inputs(lens, 1, 2, D, D, seed))

    check()


@pytest.mark.parametrize("name", EMPTY_PARAMS)
def test_empty_sequence_passes_initial_state_through(name):
    """Zero-length sequences among one-token and longer ones: the final state of an empty sequence is its initial
    state, exactly, and the other sequences are unaffected (each within the bound of running it alone)."""
    @settings(max_examples=_examples(name))
    @given(lens=varlen_lengths(max_seqs=3, max_len=_max_t(name) // 2), at=st.integers(0, 3),
           one=st.booleans(), seed=st.integers(0, 2**16))
    def check(lens, at, one, seed):
        lens = list(lens)
        lens.insert(min(at, len(lens)), 0)
        if one:
            lens.append(1)
        _check_each_sequence_alone(name, _inputs(lens, 1, 2, D, D, seed))

    check()


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_split_with_carried_state_equals_full_run(name):
    @settings(max_examples=_examples(name))
    @given(T=st.integers(2, _max_t(name)), frac=st.floats(0.05, 0.95), seed=st.integers(0, 2**16))
    def check(T, frac, seed):
        t = max(1, min(T - 1, int(frac * T)))
        inp = _inputs([T], 1, 2, D, D, seed, h0=False)
        o, s = _run(name, inp)
        o1, s1 = _run(name, _slice(inp, 0, t, None))
        o2, s2 = _run(name, _slice(inp, t, T, s1.float()))
        bo, bs = _bound(inp)
        assert rel_err(torch.cat([o1, o2], 1), o) <= bo
        assert rel_err(s2, s) <= bs

    check()


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_gva_equals_repeated_qk_heads(name):
    @settings(max_examples=_examples(name))
    @given(T=st.integers(1, _max_t(name)), ratio=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
    def check(T, ratio, seed):
        inp = _inputs([T], 1, ratio, D, D, seed)
        o, s = _run(name, inp)
        rep = dataclasses.replace(inp, q=inp.q.repeat_interleave(ratio, 2), k=inp.k.repeat_interleave(ratio, 2))
        o_r, s_r = _run(name, rep)
        bo, bs = _bound(inp)
        assert rel_err(o, o_r) <= bo and rel_err(s, s_r) <= bs

    check()


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_state_v_first_equals_transpose(name):
    @settings(max_examples=_examples(name))
    @given(T=st.integers(1, _max_t(name)), seed=st.integers(0, 2**16))
    def check(T, seed):
        inp = _inputs([T], 1, 2, D, D, seed)
        o, s = _run(name, inp)
        vf = dataclasses.replace(inp, initial_state=inp.initial_state.transpose(-1, -2).contiguous(),
                                 state_v_first=True)
        o_t, s_t = _run(name, vf)
        bo, bs = _bound(inp)
        assert tuple(s_t.shape) == tuple(s.transpose(-1, -2).shape)
        assert rel_err(o_t, o) <= bo and rel_err(s_t.transpose(-1, -2), s) <= bs

    check()
