"""CPU tests of the TileLang GDN backward's torch emulation (``kernels/backward/emulation.py``: the same
chunking, layouts and roundings as the kernels) against fp64 autograd through ``reference.chunk``.

Rows are ``cases.Case`` (inputs ``cases.inputs``, do and dht ``parity.refs.grad_outputs``, the fp64 gradients
``parity.refs.compute``, the baseline ``parity.backends.BASELINE``, metrics ``parity.metrics``).  Criteria (no
absolute tolerances): every gradient (dq, dk, dv, dg, dbeta, dh0) has a rel_rmse vs fp64 no larger than that of
the FLA-like baseline (autograd through ``reference.emulated``, FLA's intermediate roundings) on the same inputs;
with strong decay (g in [-25, -15]), where the baseline's dg is meaningless, dg is within the input dtype's
rounding floor ``rel_rmse(ref.to(dtype), ref)``; no NaN/Inf; output dtypes.  Rows: dense GVA with h0, varlen
with lengths 1, 63, 64, 65 (fp16, h0, value-first state) and with empty sequences, strong decay, no decay on half
the heads, slow decay with gates in bf16, the in-kernel L2 norm, K = V = 64; and the autograd.Function plumbing.
"""

import contextlib

import pytest
import torch

from cases.case import Case
from kernels.autograd import apply as fn
from kernels.backward.emulation import ONE_TERM_FP16, chunk_gated_delta_rule_bwd
from kernels.plan import WS_HEAD_DIMS
from parity.metrics import compare
from tests import kernel_support as tt

NAMES = tt.GRAD_NAMES


def _check(case, xs, do, dht, kw, dh_single=False, s_single=False, merge="fp32", lo8_tables=True,
           operands="split", **form):
    """The emulation's gradients of ``case`` (inputs ``tt.bwd_args``) against fp64 and the FLA-like baseline; by
    default with the dispatched plan's forms (``form``: the emulation's other arguments).  Returns them."""
    want = tt.fp64_grads(case)
    base = tt.baseline_grads(case)
    ours = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=dh_single, s_single=s_single,
                                      merge=merge, lo8_tables=lo8_tables, operands=operands, **form)
    near_m20 = case.dist == "strong-decay"
    rows = []
    for n, a, b_, r, x in zip(NAMES, ours, base, want, list(xs) + [kw["initial_state"]]):
        if r is None:
            assert a is None, n
            continue
        assert a.shape == r.shape, n
        assert a.dtype == (torch.float32 if n == "dh0" else x.dtype), (n, a.dtype)
        m = compare(a, r)
        assert m.finite, n
        e, eb, floor = m.rel_rmse, compare(b_, r).rel_rmse, compare(r.to(xs[0].dtype), r).rel_rmse
        rows.append((n, e, eb, floor))
        if near_m20 and n == "dg":
            assert e <= floor, (case.id, n, e, floor)
        else:
            assert e <= eb, (case.id, n, e, eb)
    print(f"\n{case.id}: " + "  ".join(f"{n} {e:.2e} (fla-like {eb:.2e}, floor {f:.2e})" for n, e, eb, f in rows))
    return ours


CASES = [
    Case(T=200, H=2, HV=4, h0_dtype="fp32", dist="raw-qk-l2", grad=True),
    Case(layout="varlen-boundary", T=193, H=1, HV=2, dtype="fp16", h0_dtype="fp32", state_v_first=True, grad=True),
    Case(layout="varlen-empty", T=130, H=1, HV=2, h0_dtype="fp32", state_v_first=True, grad=True),
    Case(T=192, H=1, HV=2, dist="strong-decay", grad=True),
    Case(B=2, T=130, H=1, HV=2, dist="mixed-heads", grad=True),
    Case(T=160, H=1, HV=1, g_dtype="bf16", beta_dtype="bf16", h0_dtype="fp32", dist="slow-decay", grad=True),
    Case(T=100, H=1, HV=2, K=64, V=64, h0_dtype="fp32", dist="raw-qk-l2", grad=True),
]
# rows of the GPU tests (tests/test_kernels_gpu.py) on the CPU, and a small varlen row with h0 and the value-first
# state like the backward benchmark's second check case
GPU_ROWS = [
    Case(layout="varlen-ragged", T=63, H=2, HV=4, h0_dtype="fp32", state_v_first=True, grad=True),
    Case(T=65, H=4, HV=8, h0_dtype="fp32", grad=True),
    Case(T=1000, H=4, HV=8, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", h0_dtype="fp32", grad=True),
    Case(T=1000, H=2, HV=4, h0_dtype="fp32", dist="strong-decay", grad=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bwd_emulation_vs_fp64(case):
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw)


@pytest.mark.parametrize("case", CASES + GPU_ROWS, ids=[c.id for c in CASES + GPU_ROWS])
def test_both_reverse_pass_forms_meet_the_same_bar(case):
    """dh with single Tinv, dU, F0 dX operands (the sequential pass) and with every operand split (the segmented
    pass) keep every gradient within the FLA-like baseline, and dg of strong decay within the rounding floor; the
    two forms differ in dv (dh's dY)."""
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw, dh_single=False)
    _check(case, xs, do, dht, kw, dh_single=True)
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False)
    single = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=True)
    assert not torch.equal(split[2], single[2]), "dv: the operand form changed nothing"


# without an initial state: strong decay, mixed heads, slow and qwen gates, fp16
_NO_H0 = [c for c in CASES if c.h0_dtype is None] + [
    Case(T=300, H=1, HV=2, dist="slow-decay", grad=True), Case(T=300, H=1, HV=2, dist="qwen-gates", grad=True),
    Case(T=200, H=1, HV=2, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", grad=True)]


@pytest.mark.parametrize("case", _NO_H0, ids=[c.id for c in _NO_H0])
def test_recomputed_state_hi_alone_meets_the_same_bar_without_h0(case):
    """Without an initial state, the recompute storing S's hi term alone (``BackwardPlan.s_single``: no S lo
    table, 512 MiB less at the peak of B1 T32768 H16 HV32) keeps every gradient within the FLA-like baseline, and dg
    of strong decay within the rounding floor; it changes dg (S o dS' and the dq, dk state terms lose their lo
    products)."""
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw, dh_single=False, s_single=True)
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False, s_single=False)
    single = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False, s_single=True)
    assert not torch.equal(split[3], single[3]), "dg: S's lo term changed nothing"


# bf16 rows without h0 (one fp16 term is the input dtype's one term for fp16 inputs: no plan for them)
_ONE_TERM = [c for c in _NO_H0 if c.dtype == "bf16"] + [Case(T=300, H=1, HV=2, dist="strong-decay", grad=True)]


@pytest.mark.parametrize("case", _ONE_TERM, ids=[c.id for c in _ONE_TERM])
def test_one_term_fp16_tables_meet_the_same_bar_for_bf16_inputs(case):
    """``BackwardPlan.one_term`` on the fp16 kernels for bf16 inputs (dh and dqk with every table and operand one
    fp16 term, S and U read hi alone, v and dO under powers of two per GVA group, dh's F1 dO and F0 dX per chunk)
    keeps every gradient within the FLA-like baseline, and dg of strong decay within the rounding floor; its dS' and
    dY tables are single fp16 terms.  (One bf16 term instead misses the baseline in 5 of these 6 rows: dg under mixed,
    qwen and strong decay, dk and dq under strong decay.)"""
    xs, kw, do, dht = tt.bwd_args(case)
    form = ONE_TERM_FP16
    _check(case, xs, do, dht, kw, **form)
    st: dict = {}
    chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **form, stages=st)
    for n in ("dSn", "dY"):
        assert torch.equal(st[n], st[n].to(torch.float16).to(st[n].dtype)), f"{n} tables: more than one fp16 term"
        assert not torch.equal(st[n], st[n].to(torch.bfloat16).to(st[n].dtype)), f"{n} tables: bf16 values"
    with pytest.raises(ValueError, match="one_term"):
        chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, one_term=True)


@pytest.mark.parametrize("case", CASES[:4], ids=[c.id for c in CASES[:4]])
def test_one_term_merges_meet_the_same_bar(case):
    """Tinv and Ag from one-term block merges (``merge="bf16"``, what a forward at merge "bf16" keeps for the
    backward: the A/B alternative) keep every gradient within the FLA-like baseline, and dg of strong decay within
    the rounding floor."""
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw, dh_single=False, merge="bf16")


_LO8_CASES = _NO_H0 + [CASES[0], CASES[2]]


@pytest.mark.parametrize("case", _LO8_CASES, ids=[c.id for c in _LO8_CASES])
def test_lo_tables_in_the_input_dtype_meet_the_same_bar(case):
    """The S and dS' lo tables that dqk reads in the input dtype (``lo8_tables=False``: ``BackwardPlan.lo8`` off, the
    A/B alternative of the dispatched fp8 tables, which the other ``_check`` tests cover) keep every gradient within
    the FLA-like baseline and dg of strong decay within the rounding floor, with an initial state or without."""
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw, lo8_tables=False)


# bf16 inputs: with fp16 inputs one fp16 term is one input-dtype term (operands "bf16")
_HALF_CASES = [c for c in dict.fromkeys(_NO_H0 + CASES + GPU_ROWS) if c.dtype == "bf16"]


@pytest.mark.parametrize("case", _HALF_CASES, ids=[c.id for c in _HALF_CASES])
def test_fp16_operands_meet_the_same_bar(case):
    """Every wgmma operand and table of the backward one fp16 term under a power of two per matrix
    (``operands="fp16"``: the precision study of a one-term backward, ``benchmarks/precision_bwd.py``) keeps every
    gradient within the FLA-like baseline and dg of strong decay within the rounding floor, with an initial state or
    without, and differs from the kernels' forms (bf16 inputs)."""
    xs, kw, do, dht = tt.bwd_args(case)
    _check(case, xs, do, dht, kw, operands="fp16")
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw)
    half = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands="fp16")
    assert not torch.equal(split[3], half[3]), "dg: the operand form changed nothing"


@pytest.mark.parametrize("e", [-20, 14])
def test_fp16_operands_hold_at_any_output_gradient_scale(e):
    """The backward is linear in (do, dht): scaled by 2^e both, every gradient of the fp16 form is the unscaled
    one's times 2^e to the last bit (``half_term``'s per-matrix powers of two), where plain fp16 rounding would
    flush (2^-20) or overflow (2^14)."""
    case = Case(T=300, H=1, HV=2, h0_dtype="fp32", dist="qwen-gates", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    one = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands="fp16")
    c = 2.0 ** e
    got = chunk_gated_delta_rule_bwd(*xs, do * c, dht * c, **kw, operands="fp16")
    for n, a, b in zip(NAMES, got, one):
        assert torch.equal(a, b * c), n


@pytest.mark.parametrize("dist", ["strong-decay", "slow-decay"])
def test_dq_dk_stored_in_fp16_before_their_group_sums_meet_the_bar(dist):
    """dq~ and dk~ per value head rounded to fp16 under the GVA group's powers of two before their group sums
    (``dqk_store``: the fused kernel's ``fused_dq16`` stores) keep every gradient of the fused plan's form
    within the FLA-like baseline and dg of strong decay within its floor; they change dq and dk alone, and fp32
    storage changes nothing."""
    case = Case(T=512, H=2, HV=4, h0_dtype="fp32", dist=dist, grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    form = dict(ONE_TERM_FP16, p_single=True)
    f16 = _check(case, xs, do, dht, kw, **form, dqk_store=torch.float16)
    ref = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **form)
    f32 = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **form, dqk_store=torch.float32)
    for n, a, b, c in zip(NAMES, ref, f32, f16):
        assert torch.equal(a, b), n
        assert torch.equal(a, c) == (n not in ("dq", "dk")), n


def test_the_emulated_function_runs_the_dispatched_fused_arithmetic(monkeypatch):
    """Where the fused plan is dispatched, the emulated autograd Function's gradients are bitwise the emulation's
    ``FUSED_FP16`` form (dq~ and dk~ stored in fp16, as the dispatched kernel stores them), which differs from the
    fp32 stores in dq and dk."""
    from kernels import plan as kp
    from kernels.backward.emulation import FUSED_FP16

    case = Case(B=2, T=96, H=1, HV=2, h0_dtype="fp32", dist="strong-decay", grad=True)
    monkeypatch.setattr(kp, "FUSED_MIN_CTAS", case.B * case.HV)
    xs, kw, do, dht = tt.bwd_args(case)
    leaves = [x.clone().requires_grad_() for x in xs]
    h0 = kw["initial_state"].clone().requires_grad_()
    o, ht = fn(*leaves, **dict(kw, initial_state=h0), output_final_state=True, impl="emulation")
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()
    got = [x.grad for x in leaves] + [h0.grad]
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **FUSED_FP16)
    f32 = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **dict(FUSED_FP16, dqk_store=None))
    for n, a, b, c in zip(NAMES, got, want, f32):
        assert torch.equal(a, b), (n, case.id)
        assert torch.equal(a, c) == (n not in ("dq", "dk")), (n, case.id)


def test_bf16_one_term_operands_lose_the_bar_under_strong_decay():
    """One input-dtype term for every operand (``operands="bf16"``, FLA's precision with our gates) puts dk and dv
    past the FLA-like baseline and dg past its rounding floor under strong decay, where fp16 terms keep all three
    (the test above): why the study's one-term form is fp16."""
    case = Case(T=1024, H=2, HV=4, dist="strong-decay", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    want, base = tt.fp64_grads(case), tt.baseline_grads(case)
    got = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands="bf16")
    e = {n: compare(a, r).rel_rmse for n, a, r in zip(NAMES, got, want) if r is not None}
    eb = {n: compare(b, r).rel_rmse for n, b, r in zip(NAMES, base, want) if r is not None}
    floor = compare(want[3].to(xs[0].dtype), want[3]).rel_rmse
    print(f"\nbf16 one term: dk {e['dk']:.2e} (fla-like {eb['dk']:.2e}), dv {e['dv']:.2e} (fla-like {eb['dv']:.2e}), "
          f"dg {e['dg']:.2e} (floor {floor:.2e})")
    assert e["dk"] > eb["dk"] and e["dv"] > eb["dv"] and e["dg"] > floor, (e, eb, floor)


def test_half_term_keeps_fp16_precision_at_any_magnitude():
    """``half_term`` scales each matrix by a power of two: matrices far below fp16's normal range or above its
    largest value keep fp16's relative precision (2^-11), zeros stay zero; plain fp16 rounding loses them."""
    from kernels.backward.emulation import half_term
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 16, generator=g, dtype=torch.float64) * torch.tensor([2.0 ** -40, 1.0, 2.0 ** 30],
                                                                               dtype=torch.float64)[:, None, None]
    x[1, 0] = 0
    y = half_term(x)
    rel = ((y - x).abs() / x.abs().clamp_min(1e-300)).where(x != 0, torch.zeros((), dtype=torch.float64))
    assert rel.max() <= 2.0 ** -11 and bool((y[1, 0] == 0).all()), rel.max()
    plain = x.to(torch.float16).to(torch.float64)
    assert bool((plain[0] == 0).all()) and bool(plain[2].isinf().all())


def test_unknown_operand_form_is_refused():
    case = CASES[0]
    xs, kw, do, dht = tt.bwd_args(case)
    with pytest.raises(ValueError, match="operands must be one of"):
        chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands="tf32")


def test_fp8_lo_tables_keep_dg_where_s_hi_alone_loses_it():
    """On the row where S's hi term alone took dg past the FLA-like baseline on the H200 (raw-qk-l2, T 1000, H 1,
    HV 4), fp8 lo terms keep dg 10x under the baseline and under S hi alone.  With S split in the recompute's K S,
    S hi alone stays under the baseline here (1.6e-3 against 2.5e-3) and the fp8 codes' resolution is what remains
    of dg's error (3.9e-5 against 4.4e-6 with lo terms in the input dtype; printed)."""
    case = Case(T=1000, H=1, HV=4, dist="raw-qk-l2", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    want, base = tt.fp64_grads(case)[3], tt.baseline_grads(case)[3]
    e = {name: compare(chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **form)[3], want).rel_rmse
         for name, form in (("split", dict(lo8_tables=False)), ("lo8", {}), ("hi", dict(s_single=True)))}
    eb = compare(base, want).rel_rmse
    print(f"dg: split {e['split']:.2e}, fp8 lo {e['lo8']:.2e}, S hi alone {e['hi']:.2e}, fla-like {eb:.2e}")
    assert e["split"] <= e["lo8"] and 10 * e["lo8"] <= min(eb, e["hi"]), (e, eb)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lo8_keeps_hi_plus_lo_within_2_to_minus_shift_minus_5_of_hi(dt):
    """``lo8`` on the split of fp32 values over 2^-60 .. 2^60 (fp16: 2^-14 .. 2^15, its normal range), either sign:
    every code is in [-1, 1] and ``hi + lo8`` is within ``2^(E - shift - 5)`` of the value (half an e4m3 ulp at the
    code's scale; ``E`` hi's exponent: 13 bits for bf16, 16 for fp16); the encode / decode pair is ``lo8``; hi zero
    drops lo."""
    from kernels.backward.emulation import lo8, lo8_decode, lo8_encode, lo8_shift
    gen = torch.Generator().manual_seed(0)
    lo_e, hi_e = (-60, 60) if dt == torch.bfloat16 else (-14, 15)
    sign = torch.randint(0, 2, (4096,), generator=gen).float() * 2 - 1
    mag = 1 + torch.rand(4096, generator=gen) * 0.999
    x = sign * mag * torch.exp2(torch.randint(lo_e, hi_e, (4096,), generator=gen).float())
    hi = x.to(dt)
    lo = x.double() - hi.double()
    code = lo8_encode(hi, lo, dt)
    assert code.float().abs().max() <= 1.0
    e = torch.floor(torch.log2(hi.double().abs()))
    err = (hi.double() + lo8(hi, lo, dt) - x.double()).abs()
    assert (err <= torch.exp2(e - lo8_shift(dt) - 5)).all()
    assert torch.equal(lo8_decode(hi, code, dt), lo8(hi, lo, dt))
    z = torch.zeros(3, dtype=dt)
    assert torch.equal(lo8(z, torch.full((3,), 1e-40, dtype=torch.float64), dt), torch.zeros(3, dtype=torch.float64))


def test_recomputed_state_hi_alone_fails_the_bar_with_h0():
    """With an initial state the carried-in state makes rd(S) dominate dg: S's hi term alone puts dg past the
    FLA-like baseline's error where the split S stays well within it, so ``s_single`` is no plan for such calls."""
    case = CASES[2]                                 # varlen-empty, h0, value-first state
    assert case.h0_dtype is not None
    xs, kw, do, dht = tt.bwd_args(case)
    want, base = tt.fp64_grads(case)[3], tt.baseline_grads(case)[3]
    e_split, e_single = (compare(chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False, s_single=s)[3],
                                 want).rel_rmse for s in (False, True))
    eb = compare(base, want).rel_rmse
    print(f"dg: split S {e_split:.2e}, S hi alone {e_single:.2e}, fla-like {eb:.2e}")
    assert e_split <= eb < e_single


def test_max_rel():
    """``kernel_support.max_rel`` (the GPU tests' stage distances): max |x - ref| / max |ref|, in fp64, over
    max |x - ref| alone for an all-zero reference; zero only for equal tensors."""
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert tt.max_rel(ref.clone(), ref) == 0.0
    assert tt.max_rel(ref + torch.tensor([0.0, 0.5, -1.0]), ref) == 0.25
    assert tt.max_rel(torch.tensor([0.0, 3.0]), torch.zeros(2)) == 3.0
    assert tt.max_rel(ref.bfloat16(), ref.double()) == 0.0


def test_autograd_function_plumbing():
    """The Function returns gradients in the inputs' dtypes (dh0 fp32), None for an absent initial state, and
    works without output_final_state (no dht) and with only the final state used (no do); its dh reads Tinv's hi
    term alone, as the tilelang Function's does on the forward's tables."""
    from functools import partial

    xs, kw, do, dht = tt.bwd_args(Case(T=70, H=1, HV=2, g_dtype="bf16", beta_dtype="bf16", h0_dtype="fp32",
                                       dist="raw-qk-l2"))
    bwd = partial(chunk_gated_delta_rule_bwd, tinv_hi_only=True)
    leaves = [x.clone().requires_grad_() for x in xs]
    h0 = kw["initial_state"].clone().requires_grad_()
    o, ht = fn(*leaves, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, impl="emulation")
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()
    grads = [x.grad for x in leaves] + [h0.grad]
    ref = bwd(*xs, do, dht, initial_state=kw["initial_state"], use_qk_l2norm_in_kernel=True)
    for n, a, b_, x in zip(NAMES, grads, ref, leaves + [h0]):
        assert a.dtype == x.dtype and a.shape == x.shape, n
        assert torch.equal(a, b_), n
    leaves = [x.clone().requires_grad_() for x in xs]
    o, ht = fn(*leaves, use_qk_l2norm_in_kernel=True, impl="emulation")
    assert ht is None
    (o.float() * do.float()).sum().backward()
    ref = bwd(*xs, do, None, use_qk_l2norm_in_kernel=True)
    assert ref[5] is None
    for n, a, b_ in zip(NAMES, [x.grad for x in leaves], ref):
        assert torch.equal(a, b_), n
    leaves = [x.clone().requires_grad_() for x in xs]
    o, ht = fn(*leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, impl="emulation")
    ht.sum().backward()
    ref = bwd(*xs, torch.zeros_like(do), torch.ones_like(ht), use_qk_l2norm_in_kernel=True)
    for n, a, b_ in zip(NAMES, [x.grad for x in leaves], ref):
        assert torch.equal(a, b_), n


def test_recompute_splits_s_in_k_s_for_dg_and_dbeta(monkeypatch):
    """Precision "recompute" splits S in K S: under slow decay the emulation's dg and dbeta stay within a tenth of
    their rounding floor; with S's hi term alone there (``BackwardPlan.ks_single``, the former preset) the
    recomputed states drift by up to about 2^-9 and dg, dbeta are several times farther from fp64 (both asserted,
    so the bound can fail)."""
    import kernels.backward.emulation as E
    from kernels.plan import recompute_precision

    case = Case(T=2048, H=1, HV=2, dist="slow-decay", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    want = tt.fp64_grads(case)
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw)
    monkeypatch.setattr(E, "fwd_precision", lambda s_single=False, merge="fp32", one=():
                        recompute_precision(s_single, merge, ks_single=True))
    one = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw)
    for i in (3, 4):                            # dg, dbeta
        floor = compare(want[i].to(xs[0].dtype), want[i]).rel_rmse
        es, eo = compare(split[i], want[i]).rel_rmse, compare(one[i], want[i]).rel_rmse
        print(f"{NAMES[i]}: K S split {es:.2e}, one term {eo:.2e}, floor {floor:.2e}")
        assert es <= 0.1 * floor < eo and 4 * es < eo, (NAMES[i], es, eo, floor)


def test_dg_has_no_cancellation_near_minus_20():
    """g in [-25, -15]: the true dg is ~e^-20 times the other gradients; a scheme that forms dG_t per row and
    reverse-cumsums it (rowsum - colsum of the intra terms, the last row's e^(GL-G) terms against d/dGL)
    loses it to fp32 rounding of O(1) terms.  Ours stays within the dtype's rounding floor while the
    FLA-like baseline (which does exactly that) is off by orders of magnitude."""
    case = Case(T=128, H=1, HV=1, dist="strong-decay", seed=3, grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    dg = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw)[3]
    want, base = tt.fp64_grads(case)[3], tt.baseline_grads(case)[3]
    e, eb, floor = (compare(x, want).rel_rmse for x in (dg, base, want.to(xs[0].dtype)))
    print(f"dg: ours {e:.2e}, fla-like {eb:.2e}, floor {floor:.2e}")
    assert e <= floor < eb


# ---------------------------------------------------------------------------------------------------------
# The kernel path's host code on the CPU: every kernel replaced by a torch stand-in with the kernel's own
# argument list and tensor layouts (value-first / key-first as declared in the prim_funcs), computed by the
# emulation's stage functions from the tensors the API hands over.  Checks the API's plumbing (argument
# order, layouts, padding of K = V = 64, dht / dh0 layouts, empty sequences, the host reductions).
# ---------------------------------------------------------------------------------------------------------

def _assert_within_a_quarter_of_rounding(name, a, b, in_dtype):
    """``a`` finite and bitwise ``b`` or within a quarter of ``b``'s rounding to the input dtype (rel_rmse)."""
    m = compare(a, b)
    assert m.finite, name
    assert torch.equal(a, b) or m.rel_rmse <= compare(b.to(in_dtype), b).rel_rmse / 4, (name, m.rel_rmse)


def _assert_gradients_within_a_quarter_of_rounding(got, want, in_dtype):
    """Gradient by gradient (``NAMES``): None where ``want`` has none, else of its shape and dtype and within a
    quarter of its rounding (``_assert_within_a_quarter_of_rounding``)."""
    for n, a, b in zip(NAMES, got, want):
        assert (a is None) == (b is None), n
        if b is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape, a.dtype, b.dtype)
            _assert_within_a_quarter_of_rounding(n, a, b, in_dtype)


def _fake_kernels(monkeypatch, asked=None):
    """Every kernel (``kernels.build.get_kernel``) replaced by its stand-in; the configurations asked for are
    appended to ``asked``."""
    import kernels.backward.configs as bbuild
    import kernels.backward.emulation as E
    import kernels.build as build
    import kernels.forward.configs as fbuild
    import kernels.forward.pipeline as fpipe
    import kernels.interface as interface
    from kernels.forward import emulation as FE

    f64 = torch.float64
    orig_check = interface.check_inputs

    def check_cpu(q, k, v, g, beta, h0, cu, vf):
        try:
            return orig_check(q, k, v, g, beta, h0, cu, vf)
        except ValueError as e:
            if "CUDA device" not in str(e):
                raise
            B, T, H, K = q.shape
            return B, T, H, v.shape[2], K, v.shape[3], (B if cu is None else cu.numel() - 1)

    def put(dst, src):
        dst.copy_(src.to(dst.dtype))

    def cu_list(cu):
        return [int(x) for x in cu.tolist()]

    def check_order(order, cu):
        """A kernel's ``seq_order``: a permutation of its sequences (or segments) ``cu`` [N + 1]."""
        assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(cu.numel() - 1)), order

    def ordered_group_sum(x, G):
        """``x [Ttot, HV, D]`` summed over each of the G groups of HV / G value heads, head by head in order (the
        fp32 additions of gdn_bwd_group_sum and of the cluster sums): [Ttot, G, D]."""
        xs = x.reshape(x.shape[0], G, -1, x.shape[2])
        acc = xs[:, :, 0].clone()
        for j in range(1, xs.shape[2]):
            acc = acc + xs[:, :, j]
        return acc

    def fwd_kernel(cfg):
        if isinstance(cfg, fbuild.IntraConfig):
            def intra2(q, k, g, b, cu, ci, Ah, Al, F, Th, Ph, Pl, qo, ko, scale, use_l2):
                dt = q.dtype
                prec = E.fwd_precision(merge=cfg.merge)
                ah, al, f = FE.intra_chunk(q, k, g, b, cu_list(cu), scale, bool(use_l2), dt, prec)
                put(Ah, ah), put(Al, al), put(F, f)
                if cfg.pt:          # P as the fused kernel's P warpgroup forms it, hi + lo
                    from dataclasses import replace
                    ph, pl = FE.gated_scores(q, k, f, cu_list(cu), dt, replace(prec, p="split"))
                    put(Ph, ph), put(Pl, pl)
                if cfg.th:          # Tinv, rounded once: prep's Th (the same solve)
                    z = torch.zeros(q.shape[0], g.shape[1], q.shape[2], dtype=dt)
                    put(Th, E.prep(q, k, z, g, b, cu_list(cu), scale, bool(use_l2), dt, cfg.merge)[0])
            return intra2
        if isinstance(cfg, fbuild.OutputConfig):        # the forward's output kernel (the autograd tests)
            assert not cfg.vt

            def output(q, k, F, Sch, Scl, Uh, Ul, cu, ci, o2):
                # a lo table the precision does not split is the hi table passed again, which the kernel does not
                # read: zero in the emulation's sum
                def lo(t, hi):
                    return t.to(f64) if t.data_ptr() != hi.data_ptr() else torch.zeros_like(t, dtype=f64)
                put(o2, FE.output(q, k, F.to(f64), Sch.to(f64), lo(Scl, Sch), Uh.to(f64), lo(Ul, Uh), cu_list(cu),
                                     q.dtype, cfg.prec))
            return output
        if isinstance(cfg, fbuild.StateConfig) and cfg.form == "ws" and not cfg.tables:  # the fused state-output
            def state_output(q, k, v, Ah, Al, F, Ph, Pl, cu, co, order, h0, o2, ht, use_h0, store_ht, vf):
                assert not cfg.prec.half, "the stand-in runs the split precision"
                check_order(order, cu)
                dt, f = q.dtype, F.to(f64)
                h = (h0.transpose(-1, -2) if vf else h0) if use_h0 else None
                sh, sl, uh, ul, end = FE.chunk_states(k, v, Ah.to(f64), Al.to(f64), f, cu_list(cu), cu_list(co), h,
                                                      dt, cfg.prec)
                # the chunk tables as the smem state kernel rounds them for the output kernel (a lo term only
                # where the precision splits it), kept on chip

                def rd(t, split=True):
                    return t.to(dt).to(f64) if split else torch.zeros_like(t, dtype=f64)
                # with P tables, P as the intra kernel stored it (lo read where the precision splits P)
                P = (Ph.to(f64), rd(Pl, cfg.prec.p == "split")) if cfg.pt else None
                put(o2, FE.output(q, k, f, rd(sh), rd(sl, cfg.prec.s == "split"), rd(uh),
                                  rd(ul, cfg.prec.u == "split"), cu_list(cu), dt, cfg.prec, P=P))
                if store_ht:
                    put(ht, end.transpose(-1, -2) if vf else end)
            return state_output
        if isinstance(cfg, fbuild.StateConfig) and cfg.scan:     # CP phase 1: [Z^T ; M^T] of every segment
            def scan(k, v, Ah, Al, F, cu, co, h0, Sch, Scl, Uh, Ul, ZM, use_h0, store_ht, vf):
                assert not use_h0
                end = FE.chunk_states(k, v, Ah.to(f64), Al.to(f64), F.to(f64), cu_list(cu), cu_list(co), None,
                                      k.dtype, cfg.prec, store_chunks=False, aug=True)[4]
                put(ZM[:end.shape[0]], end.transpose(-1, -2))
            return scan
        if isinstance(cfg, fbuild.FixupConfig):                  # CP phase 2: the segment start states
            def fixup(ZM, h0, seg_of, co, F, out, use_h0, h0_vf):
                h = (h0.transpose(-1, -2) if h0_vf else h0) if use_h0 else None
                put(out, FE.cp_fixup(ZM.transpose(-1, -2).to(f64), h, cu_list(seg_of), out.shape[-1])
                    .transpose(-1, -2))
            return fixup
        # the smem state kernel, or the ws form storing its tables (the same arguments and tables)
        assert isinstance(cfg, fbuild.StateConfig) and (cfg.form == "smem" or cfg.tables) and not cfg.scan
        if cfg.warm:                # the ws tables form per dh segment from warm-up chunks (its bounds: Lb)
            assert cfg.tables and cfg.lo8

            def state_warm(k, v, Ah, Al, F, cu, co, h0, Sch, Scl, Uh, Ul, Lb, order, ht, use_h0, store_ht, vf):
                check_order(order, cu)
                h = (h0.transpose(-1, -2) if vf else h0) if use_h0 else None
                sh, sl, uh, ul = E.recompute_warm_states(k, v, Ah.to(f64), Al.to(f64), F.to(f64), cu_list(cu),
                                                         cu_list(co), Lb, h, k.dtype, cfg.prec)
                put(Sch, sh), Scl.copy_(E.lo8_encode(sh, sl, k.dtype)), put(Uh, uh), put(Ul, ul)
            return state_warm

        def state(k, v, Ah, Al, F, cu, co, h0, Sch, Scl, Uh, Ul, *tail):
            if cfg.form == "ws":        # the ws form's Lb (unread here) and seq_order
                check_order(tail[1], cu)
            ht, use_h0, store_ht, vf = tail[2:] if cfg.form == "ws" else tail
            h = None
            if use_h0:
                h = h0.transpose(-1, -2) if vf else h0
            sh, sl, uh, ul, end = FE.chunk_states(k, v, Ah.to(f64), Al.to(f64), F.to(f64), cu_list(cu), cu_list(co), h,
                                              k.dtype, cfg.prec)
            put(Sch, sh), put(Uh, uh)
            # the lo tables only where the precision splits them (else the pipeline passes the hi table again, which
            # the kernel does not write); S's as fp8 codes under its hi term with lo8
            if cfg.lo8:
                Scl.copy_(E.lo8_encode(sh, sl, k.dtype))
            elif Scl.data_ptr() != Sch.data_ptr():
                put(Scl, sl)
            if Ul.data_ptr() != Uh.data_ptr():
                put(Ul, ul)
            if store_ht:
                put(ht, end.transpose(-1, -2) if vf else end)
            return sh, sl

        return state

    def bwd_kernel(cfg):
        if cfg.kind == "prep":
            def prep(q, k, do, g, b, cu, ci, Th, Tl, Agh, Agl, Fb, dUl, Lb, scale, use_l2):
                th, tl, fb, dul = E.prep(q, k, do, g, b, cu_list(cu), scale, bool(use_l2), q.dtype, cfg.merge)
                put(Fb, fb), put(dUl, dul.transpose(-1, -2))
                if cfg.saved:       # the forward's Tinv and Ag are given: the kernel writes none of them
                    if cfg.bounds:
                        put(Lb, E.chunk_bounds(q, k, g, b, cu_list(cu), bool(use_l2)))
                    return
                put(Th, th), put(Lb, E.chunk_bounds(q, k, g, b, cu_list(cu), bool(use_l2)))
                if not cfg.tinv_hi:     # (else Tl is Th again, not written)
                    put(Tl, tl)
                # Ag: the kernel's operations are intra2's (ag "split"), so its emulation stands in
                ah, al, _ = FE.intra_chunk(q, k, g, b, cu_list(cu), scale, bool(use_l2), q.dtype,
                                           E.fwd_precision(merge=cfg.merge))
                put(Agh, ah), put(Agl, al)
            return prep
        if cfg.kind == "dh" and cfg.warm:
            def dh_warm(q, k, do, Th, Tl, Fb, dUl, cu, co, dht, dSh, dSl, dYh, dYl, dv, dh0, Lb, use_dht, store_dh0,
                        vf):
                d = (dht.transpose(-1, -2) if vf else dht) if use_dht else None
                tl = torch.zeros_like(Tl, dtype=f64) if cfg.tinv_hi else Tl.to(f64)      # Tl not read
                a, b_, c, e, dvv, h0g = E.dh_warm(q, k, do, Th.to(f64), tl, Fb.to(f64),
                                                  dUl.to(f64).transpose(-1, -2), cu_list(cu), cu_list(co), Lb, d,
                                                  q.dtype)
                put(dSh, a.transpose(-1, -2)), put(dSl, E.lo8_encode(a, b_, q.dtype).transpose(-1, -2))
                put(dYh, c.transpose(-1, -2)), put(dYl, e.transpose(-1, -2)), put(dv, dvv)
                if store_dh0:
                    put(dh0, h0g.transpose(-1, -2) if vf else h0g)
            return dh_warm
        if cfg.kind == "dh":
            def dh(q, k, do, Th, Tl, Fb, dUl, cu, co, dht, dSh, dSl, dYh, dYl, dv, dh0, Lb, use_dht, store_dh0, vf,
                   factors=None):
                assert (factors is not None) == bool(cfg.ws_bv) and not cfg.one, "dh_ws alone takes factors"
                d = None
                if use_dht:
                    d = dht.transpose(-1, -2) if vf else dht
                tl = torch.zeros_like(Tl) if cfg.tinv_hi else Tl           # Tl not read
                a, b_, c, e, dvv, h0g = E.dh(q, k, do, Th.to(f64), tl.to(f64), Fb.to(f64),
                                             dUl.to(f64).transpose(-1, -2), cu_list(cu), d, q.dtype, cfg.single)
                put(dSh, a.transpose(-1, -2))
                put(dSl, E.lo8_encode(a, b_, q.dtype).transpose(-1, -2) if cfg.lo8 else b_.transpose(-1, -2))
                put(dYh, c.transpose(-1, -2)), put(dYl, e.transpose(-1, -2)), put(dv, dvv)
                if store_dh0:
                    put(dh0, h0g.transpose(-1, -2) if vf else h0g)
            return dh
        if cfg.kind == "inter":             # the dqk stand-in's state products
            def inter(q, k, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, cu, ci, dqv, dkv, qz, kw, kr, sd, yv,
                      scale):
                cl = cu_list(cu)
                T_ = lambda x: x.to(f64).transpose(-1, -2)   # noqa: E731
                dqt, dkt, a, b_, c, d, e = E.dqk_inter(q, k, v, do, Sch.to(f64), Scl.to(f64), Uh.to(f64), Ul.to(f64),
                                                       T_(dSh), T_(dSl), T_(dYh), T_(dYl), Fb.to(f64), cl, scale)
                tok, valid = E.token_index(cl, q.device)
                dqv[tok[valid]] = dqt.permute(1, 2, 0, 3)[valid].float()
                dkv[tok[valid]] = dkt.permute(1, 2, 0, 3)[valid].float()
                for dst, src in ((qz, a), (kw, b_), (kr, c), (sd, d)):
                    dst.zero_()
                    dst[:1] = src.float()
                put(yv, e)
            return inter
        if cfg.kind == "dgdb":
            # the torch form of the same terms (common.finish) stands in; the GPU test compares the two
            def dgdb(Fb, qz, kw, kr, yv, db2, sd, rect, cu, ci, dg, db):
                from kernels.backward.finish import finish, valid_rows
                tok, valid = E.token_index(cu_list(cu), Fb.device)
                z = torch.zeros(dg.shape[0], 1, 1)
                _, _, g_, b_ = finish(Fb=Fb, qz=qz, kw=kw, kr=kr, sd=sd, yv=yv[0] + yv[1], rect=rect,
                                      db2=db2[0] + db2[1], dqv=z, dkv=z, q=z, k=z, H=1, use_l2=False, tok=tok,
                                      valid=valid, rows=valid_rows(tok, valid))
                put(dg, g_), put(db, b_)
            return dgdb
        if cfg.kind in ("gsum", "gsum32"):
            def gsum(x, y):     # fp32 sums in the kernel's order, one rounding to y's dtype
                put(y, ordered_group_sum(x, y.shape[1]))
            return gsum
        if cfg.kind == "dqk" or cfg.kind.startswith("dqk_g"):
            # the fused kernel: the two stand-ins, then its two output forms; "dqk_gN" (clusters of a group of N
            # value heads) stores the group sums, summed in the order of gdn_bwd_group_sum
            group = 1 if cfg.kind == "dqk" else int(cfg.kind[5:])

            def dqk(q, k, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, cu, ci, dq32, dk32, dqo, dko, qz, kw, kr,
                    sd, yv, rect, db2, scale, out32, factors):
                assert factors.shape == (2, v.shape[1]) and not cfg.one      # read by the one form alone
                Ttot, HV, D = v.shape
                H = q.shape[1]
                assert group == 1 or HV == group * H, (group, HV, H)
                assert dqo.shape == dq32.shape == (Ttot, HV // group, D) and dqo.dtype == q.dtype
                assert out32 or HV == group * H         # the input dtype only for whole groups
                dqv = torch.zeros(Ttot, HV, D, dtype=torch.float32)
                dkv = torch.zeros_like(dqv)
                # the row dots' halves (qz, kw, kr, yv, db2 [2, HV, NC, 64]): the whole sums in half 0, zeros in half 1
                assert qz.shape[0] == kw.shape[0] == kr.shape[0] == yv.shape[0] == db2.shape[0] == 2
                assert yv.dim() == db2.dim() == 4
                # S's hi term alone (s_single): Scl is the hi table passed again, which the kernel does not read
                sl = torch.zeros_like(Sch) if cfg.s_single else Scl
                if cfg.lo8:                 # fp8 codes: their values under the hi terms
                    sl, dSl = E.lo8_decode(Sch, Scl, q.dtype), E.lo8_decode(dSh, dSl, q.dtype)
                bwd_kernel(bbuild.BwdConfig("inter", cfg.dtype))(q, k, v, do, Sch, sl, Uh, Ul, dSh, dSl, dYh, dYl,
                                                                 Fb, cu, ci, dqv, dkv, qz, kw, kr, sd, yv[0], scale)
                yv[1].zero_()
                bwd_kernel(bbuild.BwdConfig("intra", cfg.dtype))(q, k, do, Uh, Ul, dYh, dYl, Fb, cu, ci, dqv, dkv,
                                                                 rect, db2[0], scale)
                db2[1].zero_()
                for x, o32, o in ((dqv, dq32, dqo), (dkv, dk32, dko)):
                    acc = ordered_group_sum(x, HV // group)
                    put(o32, acc) if out32 else put(o, acc)
            return dqk
        assert cfg.kind == "intra"          # the dqk stand-in's 64x64 terms

        def intra(q, k, do, Uh, Ul, dYh, dYl, Fb, cu, ci, dqv, dkv, rect, db2, scale):
            cl = cu_list(cu)
            T_ = lambda x: x.to(f64).transpose(-1, -2)   # noqa: E731
            dqt, dkt, r, b_ = E.dqk_intra(q, k, do, Uh.to(f64), Ul.to(f64), T_(dYh), T_(dYl), Fb.to(f64), cl, scale,
                                          q.dtype)
            tok, valid = E.token_index(cl, q.device)
            dqv[tok[valid]] = (dqv[tok[valid]].double() + dqt.permute(1, 2, 0, 3)[valid]).float()
            dkv[tok[valid]] = (dkv[tok[valid]].double() + dkt.permute(1, 2, 0, 3)[valid]).float()
            put(rect, r), put(db2, b_)
        return intra

    def any_kernel(cfg):
        if asked is not None:
            asked.append(cfg)
        return bwd_kernel(cfg) if isinstance(cfg, bbuild.BwdConfig) else fwd_kernel(cfg)

    monkeypatch.setattr(fpipe, "check_inputs", check_cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(build, "get_kernel", any_kernel)


ALL_EMPTY = "varlen-all-empty_h0_vfirst"      # two sequences of no token: the API's early return
_PLUMBING = [
    Case(layout="varlen-empty", T=130, H=1, HV=2, K=64, V=64, h0_dtype="fp32", state_v_first=True, dist="raw-qk-l2"),
    Case(B=2, T=70, H=1, HV=2, dist="raw-qk-l2"),
    ALL_EMPTY,
    # groups of 1 without the L2 norm: the fused kernel writes the final dq, dk (input dtype); a group of 4: fp32 per
    # value head (groups of 2: the cases above)
    Case(T=130, H=2, HV=2),
    Case(T=70, H=1, HV=4),
    # a group of 3: no cluster form, fp32 rows per value head and gdn_bwd_group_sum in the default path
    Case(T=70, H=2, HV=6, h0_dtype="fp32", dist="raw-qk-l2"),
]
_PLUMBING_IDS = [str(c) for c in _PLUMBING]


def _plumbing_args(item):
    """``tt.bwd_args`` of a Case; for ALL_EMPTY those of a varlen row cut to no token with cu_seqlens [0, 0, 0]."""
    if item != ALL_EMPTY:
        return tt.bwd_args(item)
    xs, kw, do, dht = tt.bwd_args(Case(layout="varlen-empty", T=3, H=1, HV=2, h0_dtype="fp32", state_v_first=True,
                                       dist="raw-qk-l2"))
    kw.update(initial_state=kw["initial_state"][:2].contiguous(), cu_seqlens=torch.zeros(3, dtype=torch.int64))
    return [x[:, :0].contiguous() for x in xs], kw, do[:, :0].contiguous(), dht[:2].contiguous()


@pytest.mark.parametrize("form", ["dispatched", "no_cluster", "serial_recompute", "recompute_bv16_occ2", "s_single",
                                  "merge_bf16", "merge_split", "lo_tables_in_input_dtype", "recompute_smem", "dh_ws32"])
@pytest.mark.parametrize("item", _PLUMBING, ids=_PLUMBING_IDS)
def test_kernel_path_plumbing_on_cpu(monkeypatch, item, form):
    """kernels.backward.pipeline with stand-in kernels == the emulation, gradient by gradient (the stand-ins use the
    emulation's stage functions, so any difference is the pipeline's tensor plumbing): with the dispatched plan
    (groups of 2, 4, 8 summed by dqk's clusters, others by ``gdn_bwd_group_sum``), and with plan values a benchmark
    may pass: no cluster sums (every group of two or more by ``gdn_bwd_group_sum``), the recompute on the main
    stream, the recompute's state kernel at BV 16, two CTAs per SM, or in its smem form (``recompute_ws`` off: the
    same tables as the dispatched warp-specialised form), S's hi term alone, prep's one-term and split merges, the S
    and dS' lo tables in the input dtype instead of fp8, dh's warp-specialised form (its stand-in checks that it
    gets the ``factors`` argument) (against the emulation's ``s_single``, ``merge``, ``lo8_tables``).  The pipeline
    asks for the plan's kernels and only for them: the recompute state kernel (S split in K S; S lo stored in fp8,
    in the input dtype, or not at all; the ws form where the plan's ``recompute_ws``), prep's form, dh's split form,
    the dqk kind of the group (``s_single`` and ``lo8`` as the plan)."""
    import dataclasses

    import kernels.backward.configs as bbuild
    import kernels.forward.configs as fbuild
    from kernels.backward import pipeline

    asked = []
    _fake_kernels(monkeypatch, asked)
    xs, kw, do, dht = _plumbing_args(item)
    b = pipeline.prepare_backward(*xs, do, dht, **kw)
    change = {"dispatched": {}, "no_cluster": dict(cluster_group_sum=False),
              "serial_recompute": dict(overlap_recompute=False),
              "recompute_bv16_occ2": dict(recompute_block_v=16, recompute_ctas_per_sm=2, recompute_ws=False),
              "s_single": dict(s_single=True, lo8=False),
              "merge_bf16": dict(merge="bf16"), "merge_split": dict(merge="split"),
              "lo_tables_in_input_dtype": dict(lo8=False), "recompute_smem": dict(recompute_ws=False),
              "dh_ws32": dict(dh_ws_bv=32)}[form]
    plan = pipeline.plan_for(b) if b.x.NC else None
    plan = dataclasses.replace(plan, **change) if plan is not None else None
    single, merge, lo8 = (plan.s_single, plan.merge, plan.lo8) if plan else (False, "fp32", True)
    got = pipeline.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=plan)
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, s_single=single, merge=merge, lo8_tables=lo8)
    # the stand-ins round the fp64 stage results into the kernels' storage dtypes; nothing else differs
    _assert_gradients_within_a_quarter_of_rounding(got, want, xs[0].dtype)
    if item == ALL_EMPTY:                   # (no token: no kernel)
        assert not asked
        return
    H, HV = xs[0].shape[2], xs[2].shape[2]
    state = [c for c in asked if isinstance(c, fbuild.StateConfig)]
    assert state and all(c.sl_swizzle == (not single and not lo8 and c.prec.ks != "split") and c.lo8 == lo8
                         and (c.prec.s == "split") != single and c.prec.ks == "split" for c in state), asked
    if form == "recompute_bv16_occ2":
        assert all((c.BV, c.ctas_per_sm) == (16, 2) for c in state), asked
    assert all((c.form == "ws" and c.tables) == plan.recompute_ws for c in state if not c.scan), asked
    dh = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind == "dh"]
    assert dh and all(not c.single and not c.tinv_hi and c.lo8 == lo8 for c in dh), asked  # Tinv hi + lo
    dqk = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind.startswith("dqk")]
    cluster = HV // H in bbuild.CLUSTER_GROUPS and form != "no_cluster"
    assert [c.kind for c in dqk] == [f"dqk_g{HV // H}" if cluster else "dqk"], asked
    assert all(c.s_single == single and c.lo8 == lo8 for c in dqk), asked
    prep = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind == "prep"]
    assert prep and all(c.merge == merge for c in prep), asked
    gsum = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind.startswith("gsum")]
    assert bool(gsum) == (HV // H > 1 and not cluster), asked


@pytest.mark.parametrize("save", [True, False], ids=["saved_tables", "no_saved_tables"])
@pytest.mark.parametrize("case", [_PLUMBING[i] for i in (1, 0, 5)], ids=[_PLUMBING_IDS[i] for i in (1, 0, 5)])
def test_autograd_hands_the_forward_tables_to_the_backward_on_cpu(monkeypatch, case, save):
    """The autograd Function on the kernel path (stand-in kernels on the CPU) == the emulation, gradient by gradient
    (dh reading Tinv's hi term alone where the tables are the forward's).  Where the backward reads them, the
    forward's intra kernel is asked to store Tinv (``th``) and the backward's prep runs on the forward's tables
    (``saved``: its stand-in then writes no Tinv, so a backward that read its own empty tables would be wrong); with
    plans that keep no tables (``alter``), neither."""
    import dataclasses

    import kernels.backward.configs as bbuild
    import kernels.forward.configs as fbuild
    from kernels import autograd
    from kernels.plan import ForwardPlan

    asked = []
    _fake_kernels(monkeypatch, asked)

    def no_tables(plan):
        if isinstance(plan, ForwardPlan):
            return dataclasses.replace(plan, keep_tables=False)
        return dataclasses.replace(plan, reads_saved_tables=False)

    got = tt.function_grads(autograd.apply, case, **({} if save else {"alter": no_tables}))
    xs, kw, do, dht = tt.bwd_args(case)
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, tinv_hi_only=save)    # dh on the saved Tinv: hi alone
    _assert_gradients_within_a_quarter_of_rounding(got, want, got[0].dtype)
    intra = [c for c in asked if isinstance(c, fbuild.IntraConfig)]
    prep = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind == "prep"]
    assert intra and prep and all(c.th == save for c in intra) and all(c.saved == save for c in prep), asked


@pytest.mark.parametrize("case", [_PLUMBING[i] for i in (1, 5)], ids=[_PLUMBING_IDS[i] for i in (1, 5)])
def test_autograd_hands_one_term_merge_tables_to_the_backward_on_cpu(monkeypatch, case):
    """The backward benchmark's ``ours-m1`` on the kernel path (stand-in kernels on the CPU): the forward's intra
    kernel at merge "bf16" stores Tinv, the backward's prep runs on the forward's tables, and the gradients are the
    emulation's with ``merge="bf16"`` (dh on the saved Tinv: hi alone)."""
    import kernels.backward.configs as bbuild
    import kernels.forward.configs as fbuild
    from benchmarks.bench_kernels_bwd import alter

    asked = _kernel_path_is_the_emulation(monkeypatch, case, alter("ours-m1"), tinv_hi_only=True,
                                          merge="bf16")
    intra = [c for c in asked if isinstance(c, fbuild.IntraConfig)]
    prep = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind == "prep"]
    assert intra and all(c.th and c.merge == "bf16" for c in intra), asked
    assert prep and all(c.saved and c.merge == "bf16" for c in prep), asked


@pytest.mark.parametrize("column", ["ours-again", "ours-rc-smem", "ours-dqk-plain"])
@pytest.mark.parametrize("case", [_PLUMBING[i] for i in (1, 5)], ids=[_PLUMBING_IDS[i] for i in (1, 5)])
def test_autograd_runs_the_backward_ab_kernels_on_cpu(monkeypatch, case, column):
    """The backward benchmark's ``ours-again`` (the dispatched plan), ``ours-rc-smem`` (the recompute's smem form,
    not the dispatched ws form) and ``ours-dqk-plain`` (dqk's gates formed at each use, its lo tiles widened by a
    shift) through the autograd Function on the kernel path (stand-in kernels on the CPU, the forward's tables
    saved): the gradients are the emulation's (dh on the saved Tinv: hi alone), and the kernels asked for are those
    forms."""
    import kernels.backward.configs as bbuild
    import kernels.forward.configs as fbuild
    from benchmarks.bench_kernels_bwd import alter

    asked = _kernel_path_is_the_emulation(monkeypatch, case, alter(column), tinv_hi_only=True)
    dh_prep = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind in ("dh", "prep")]
    state = [c for c in asked if isinstance(c, fbuild.StateConfig) and c.tables]
    assert dh_prep and all(c.ws_bv for c in dh_prep if c.kind == "dh"), asked
    assert all(c.saved for c in dh_prep if c.kind == "prep"), asked
    assert bool(state) == (column != "ours-rc-smem"), asked
    dqk = [c for c in asked if isinstance(c, bbuild.BwdConfig) and c.kind.startswith("dqk")]
    assert dqk, asked
    plain = column == "ours-dqk-plain" or dqk[0].DK != 128
    assert all(c.e_once != plain and c.exp_mask != plain for c in dqk), asked


def test_alter_validates_each_direction_once_and_sees_the_dispatched_plans(monkeypatch):
    """``apply(..., alter=f)`` hands ``f`` to the pipelines as their ``plan``: each direction prepares (validates) its
    inputs once, as without ``alter``, and ``f`` receives the dispatched forward and backward plans."""
    import kernels.backward.pipeline as bpipe
    import kernels.forward.pipeline as fpipe
    from kernels import autograd
    from kernels.plan import BackwardPlan, ForwardPlan

    _fake_kernels(monkeypatch)
    case = Case(T=200, H=1, HV=2, dist="raw-qk-l2")
    calls = []
    for mod, name in ((fpipe, "prepare"), (bpipe, "prepare_backward")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    seen = []

    def f(plan):
        seen.append(plan)
        return plan
    for alter in (None, f):
        calls.clear()
        tt.function_grads(autograd.apply, case, **({} if alter is None else {"alter": alter}))
        assert calls.count("prepare") == 1 and calls.count("prepare_backward") == 1, (alter, calls)
    assert [type(p) for p in seen] == [ForwardPlan, BackwardPlan]


def _kernel_path_is_the_emulation(monkeypatch, case, alter, **emu) -> list:
    """The autograd Function on the kernel path (stand-in kernels, plans through ``alter`` or as dispatched) against
    the emulation's backward called with ``emu``, gradient by gradient; the configurations the call asked for."""
    from kernels import autograd

    asked = []
    _fake_kernels(monkeypatch, asked)
    got = tt.function_grads(autograd.apply, case, **({} if alter is None else {"alter": alter}))
    xs, kw, do, dht = tt.bwd_args(case)
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **emu)
    _assert_gradients_within_a_quarter_of_rounding(got, want, got[0].dtype)
    return asked


@pytest.mark.parametrize("case", [Case(T=200, H=1, HV=2, dist="raw-qk-l2"),
                                  Case(layout="varlen-ragged", T=300, H=2, HV=4, h0_dtype="fp32", state_v_first=True),
                                  Case(B=2, T=70, H=1, HV=2, K=64, V=64, h0_dtype="fp32")], ids=lambda c: c.id)
def test_fused_state_output_form_plumbing_on_cpu(monkeypatch, case):
    """The forward pipeline's "ws" form (``gdn_state_output_ws``) with stand-in kernels: the same o and final state
    as the smem state and output kernels' stand-ins (its arguments, h0 and ht layouts, padded rows), asking for the
    intra kernel and the fused kernel alone; with the plan's P tables (``p_table``) the fused kernel's stand-in
    takes P from the intra kernel's, and both configurations say so."""
    import dataclasses

    from kernels.forward.pipeline import chunk_gated_delta_rule as impl
    from kernels.forward.pipeline import plan_for, prepare
    from kernels.forward.precision import preset

    asked = []
    _fake_kernels(monkeypatch, asked)
    args, kw = tt.call_args(case)
    base = dataclasses.replace(plan_for(prepare(*args, **kw, output_final_state=True)), precision=preset())
    got = {}
    for form, pt in (("smem", False), ("ws", False), ("ws", True)):
        asked.clear()
        plan = dataclasses.replace(base, state_form=form, block_v=32, ctas_per_sm=1, cp=1, p_table=pt, warm=False)
        got[form, pt] = impl(*args, **kw, output_final_state=True, plan=plan)
        if form == "ws":
            assert [type(c).__name__ for c in asked] == ["IntraConfig", "StateConfig"] and asked[1].form == "ws", asked
            assert asked[0].pt == asked[1].pt == pt, asked
    for pt in (False, True):
        for a, b in zip(got["ws", pt], got["smem", False]):
            assert torch.equal(a, b)


def test_saved_tables_of_another_call_raise_valueerror(monkeypatch):
    """``saved_tables`` that are not this call's (a missing key, another shape or dtype) raise a ValueError naming
    the table, before any launch."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as api_bwd

    _fake_kernels(monkeypatch)
    xs, kw, do, dht = tt.bwd_args(Case(T=70, H=1, HV=2, dist="raw-qk-l2"))
    good = torch.zeros(2, 2, 64, 64, dtype=xs[0].dtype)     # HV = 2 value heads, NC = 2 chunks
    for saved, match in (({"Th": good, "Ah": good}, "'Al'"),
                         ({"Th": good, "Ah": good[:, :1].contiguous(), "Al": good}, "'Ah'"),
                         ({"Th": good.float(), "Ah": good, "Al": good}, "'Th'")):
        with pytest.raises(ValueError, match=match):
            api_bwd(*xs, do, dht, **kw, saved_tables=saved)


@pytest.mark.parametrize("cu", [[0, 200], [0, 1, 64, 65, 130, 400], [0, 0, 70, 70, 140]], ids=str)
def test_finish_scatters_by_integer_rows_the_same_as_by_mask(cu):
    """``finish`` scatters by the rows of ``valid_rows`` (computed on the host) rather than by a boolean mask on
    the device (a sync): every token is one valid chunk row, selecting by the rows equals selecting by the mask, and
    ``finish`` gives the same with given rows as with its own."""
    from kernels.backward.finish import finish, token_index, valid_rows
    tok, valid = token_index(cu, "cpu")
    tv, sel = valid_rows(tok, valid)
    assert sorted(tv.tolist()) == list(range(cu[-1]))
    assert torch.equal(tok.reshape(-1)[sel], tok[valid]) and torch.equal(sel.sort().values, sel)
    x = torch.randn(3, *valid.shape)
    assert torch.equal(x.permute(1, 2, 0).reshape(-1, 3)[sel], x.permute(1, 2, 0)[valid])
    g = torch.Generator().manual_seed(len(cu))
    NC, HV, H, D, Ttot = tok.shape[0], 4, 2, 128, cu[-1]

    def r(*s):
        return torch.randn(*s, generator=g)

    Fb = torch.rand(HV, NC, 8, 64, generator=g)
    Fb[:, :, 4] = -Fb[:, :, 4]
    kw = dict(Fb=Fb, qz=r(2, HV, NC, 64), kw=r(2, HV, NC, 64), kr=r(2, HV, NC, 64), sd=r(2, HV, NC, D),
              yv=r(HV, NC, 64), rect=r(HV, NC, 64), db2=r(HV, NC, 64), dqv=r(Ttot, HV, D), dkv=r(Ttot, HV, D),
              q=r(Ttot, H, D), k=r(Ttot, H, D), H=H, use_l2=True, tok=tok, valid=valid)
    by_mask = finish(**kw)
    by_rows = finish(**kw, rows=(tv, sel))
    for a, b in zip(by_mask, by_rows):
        assert torch.equal(a, b)
    dg = by_rows[2]
    assert torch.isfinite(dg).all() and (dg != 0).all()          # every token's row was written


_SEGMENTED = [     # slow decay / no decay: the state gradient crosses every segment boundary
    Case(B=2, T=300, H=1, HV=2, dist="slow-decay", grad=True),
    Case(layout="varlen-empty", T=622, H=1, HV=2, K=64, V=64, h0_dtype="fp32", state_v_first=True, dist="mixed-heads",
         grad=True),
]


@pytest.mark.parametrize("ws", [0, 32], ids=["dh", "dh_ws32"])
@pytest.mark.parametrize("case", _SEGMENTED, ids=[c.id for c in _SEGMENTED])
def test_segment_parallel_reverse_pass_plumbing_on_cpu(monkeypatch, case, ws):
    """The few-heads form of the reverse pass in three passes (``dh_segmented``: the dh kernel over segments, three
    passes and an fp64 scan; ``dh_warm`` off), forced on small inputs with the emulation's stage functions standing
    in for the kernels, gives the emulation's gradients (the sequential reverse pass), dh0 included, with dh's
    register or warp-specialised kernel (``ws``: its extra ``factors`` argument in every pass). The segmented pass
    runs dh with every operand split, so the sequential one it is compared with does too (``dh_single=False``); its
    transfer maps from pass B and the recompute in one pass, as the emulation's (``shared_scan`` off,
    ``recompute_cp`` 1)."""
    import dataclasses

    from kernels.backward import dh_segmented as dh_cp
    from kernels.backward import pipeline as bapi
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as api_bwd

    asked = []
    _fake_kernels(monkeypatch, asked)
    monkeypatch.setattr(dh_cp, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 1)
    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 256)
    seen = []
    real = dh_cp.end_gradients
    monkeypatch.setattr(dh_cp, "end_gradients", lambda *a: seen.append(a[0].cu.numel() - 1) or real(*a))
    xs, kw, do, dht = tt.bwd_args(case)
    plan = bapi.plan_for(bapi.prepare_backward(*xs, do, dht, **kw))
    got = api_bwd(*xs, do, dht, **kw, plan=dataclasses.replace(plan, shared_scan=False, recompute_cp=1, dh_ws_bv=ws,
                                                               dh_warm=False))
    assert seen and seen[0] >= 4, seen                   # the segmented form ran, with several segments
    assert all(not c.single for c in asked if getattr(c, "kind", None) == "dh"), asked
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False)
    tt.assert_segmented_matches_sequential(got, want, xs[0].dtype, NAMES)


def _segmented_stand_ins(monkeypatch, asked: list, kinds: bool = False) -> list:
    """The stand-in kernels (``_fake_kernels``, their configurations appended to ``asked``) with the segmented
    reverse pass forced on; returns the list that every launch appends its configuration to (its kind, or its
    class name, with ``kinds``)."""
    import kernels.build as build
    from kernels.backward import dh_segmented as dh_cp

    _fake_kernels(monkeypatch, asked)
    launches = []
    fake = build.get_kernel

    def counting(cfg):
        k = fake(cfg)
        tag = getattr(cfg, "kind", type(cfg).__name__) if kinds else cfg
        return lambda *a: launches.append(tag) or k(*a)
    monkeypatch.setattr(build, "get_kernel", counting)
    monkeypatch.setattr(dh_cp, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 1)
    return launches


@pytest.mark.parametrize("case", _SEGMENTED, ids=[c.id for c in _SEGMENTED])
def test_shared_scan_plumbing_on_cpu(monkeypatch, case):
    """``BackwardPlan.shared_scan`` with the segmented reverse pass in three passes (``dh_warm`` off; forced on small
    inputs, stand-in kernels; dispatched at K = 64 beside the warm dh): the forward CP scan over dh's segments gives
    dh's transfer maps -- within 1e-5 of pass B's on every segment the end-gradient scan reads, pass A's start
    gradients bitwise -- so dh runs twice (passes A and C) instead of three times, the scan once; and the recompute
    runs per dh segment from the fix-up of the same maps: every gradient no farther from fp64 than the sequential
    emulation's plus a tenth of the input dtype's rounding floor."""
    import dataclasses

    import kernels.forward.configs as fbuild
    from kernels.backward import dh_segmented as dh_cp
    from kernels.backward import pipeline as bapi

    asked = []
    launches = _segmented_stand_ins(monkeypatch, asked, kinds=True)
    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 256)
    seen = []
    real = dh_cp.end_gradients
    monkeypatch.setattr(dh_cp, "end_gradients", lambda *a: seen.append(a) or real(*a))
    xs, kw, do, dht = tt.bwd_args(case)
    plan = bapi.plan_for(bapi.prepare_backward(*xs, do, dht, **kw))
    assert plan.dh_segments is not None and plan.recompute_block_v == 64
    # the three passes, whose pass B the maps replace (dispatched at K = 64, with the warm dh)
    plan = dataclasses.replace(plan, dh_warm=False, recompute_warm=False, shared_scan=True)
    got = bapi.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=plan)
    shared, launches[:] = list(launches), []
    bapi.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=dataclasses.replace(plan, shared_scan=False))
    assert (shared.count("dh"), launches.count("dh")) == (2, 3), (shared, launches)
    # the scan and the recompute; the fix-up of the recompute's start states and the end walk of dh's
    assert shared.count("StateConfig") == 2 and shared.count("FixupConfig") == 2, shared
    assert launches.count("FixupConfig") == 1, launches                 # the end walk alone
    (t, a1, P1, _, _), (_, a2, P2, _, _) = seen
    assert torch.equal(a1, a2)
    need = [j for f, l in zip(t.first.tolist(), t.last.tolist()) for j in range(f + 1, l)]
    assert need, (t.first, t.last)
    d = (P1[need] - P2[need]).abs().max() / P2[need].abs().max()
    assert d <= 1e-5, d
    want, emu = tt.fp64_grads(case), chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False)
    for n, a, b, r in zip(NAMES, got, emu, want):
        assert (a is None) == (r is None), n
        if r is not None:
            ea, eb, floor = (compare(x, r).rel_rmse for x in (a, b, r.to(xs[0].dtype)))
            assert torch.isfinite(a).all() and ea <= eb + 0.1 * floor, (n, ea, eb, floor)
    assert any(isinstance(c, fbuild.FixupConfig) for c in asked)


_WARM_SEGMENTED = _SEGMENTED + [Case(T=700, H=1, HV=2, dist="strong-decay", grad=True)]


@pytest.mark.parametrize("rc", ["rc-seq", "rc-warm"])
@pytest.mark.parametrize("case", _WARM_SEGMENTED, ids=[c.id for c in _WARM_SEGMENTED])
def test_warm_segmented_reverse_pass_plumbing_on_cpu(monkeypatch, case, rc):
    """The few-heads reverse pass in its warm form (``dh_warm``: one launch of ``gdn_bwd_dh_warm``, each segment
    from its warm-up chunks after its end or from its sequence's end), forced on small inputs with the emulation's
    stage functions standing in for the kernels: one dh launch and no end walk; every gradient as the sequential
    emulation's (``assert_segmented_matches_sequential``), dh0 included.  Slow decay and the no-decay heads run on
    to their sequences' ends (the sequential pass's own arithmetic); strong decay warms up within a chunk.  The
    recompute in one pass, as the emulation's (``rc-seq``), or per dh segment from its own warm-up chunks before the
    segment (``rc-warm``: ``recompute_warm``, no scan and no fix-up at all)."""
    import dataclasses

    from kernels.backward import pipeline as bapi
    from kernels.forward.cp_warm import warm_back_host, warm_or_start_host

    launches = _segmented_stand_ins(monkeypatch, [])
    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 256)
    warm, fwd = [], []
    back, ahead = warm_back_host, warm_or_start_host
    monkeypatch.setattr("kernels.forward.cp_warm.warm_back_host", lambda *a: warm.append(back(*a)) or warm[-1])
    monkeypatch.setattr("kernels.forward.cp_warm.warm_or_start_host", lambda *a: fwd.append(ahead(*a)) or fwd[-1])
    xs, kw, do, dht = tt.bwd_args(case)
    plan = dataclasses.replace(bapi.plan_for(bapi.prepare_backward(*xs, do, dht, **kw)), dh_warm=True,
                               shared_scan=False, recompute_warm=False)
    if rc == "rc-warm" and not plan.recompute_ws:
        pytest.skip(f"the recompute's warm form is its ws tables form's, built at K = 128 alone (K = {case.K})")
    plan = (dataclasses.replace(plan, recompute_cp=1) if rc == "rc-seq"
            else dataclasses.replace(plan, recompute_warm=True))
    assert plan.segmented_warm and plan.dh_segments.cu.numel() - 1 >= 4
    got = bapi.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=plan)
    dh = [c for c in launches if getattr(c, "kind", None) == "dh"]
    assert len(dh) == 1 and dh[0].warm and dh[0].lo8, dh
    states = [c for c in launches if type(c).__name__ == "StateConfig"]
    assert len(states) == 1 and states[0].warm == (rc == "rc-warm"), states    # no scan
    assert not any(type(c).__name__ == "FixupConfig" for c in launches), launches
    w = torch.stack(warm)                    # [NS, HV]
    co = plan.dh_segments.warm_co.tolist()
    NS = w.shape[0]
    to_end = torch.tensor([co[co[2 * NS + 1 + j] + 1] - co[j + 1] for j in range(NS)])   # chunks to the sequence end
    to_start = torch.tensor([co[j] - co[co[co[NS + 1 + j]]] for j in range(NS)])        # back to its start
    assert (to_end > 1).any() and len(fwd) == (NS if rc == "rc-warm" else 0), (to_end, len(fwd))
    f = torch.stack(fwd) if fwd else None
    if case.dist == "strong-decay":
        assert set(w.flatten().tolist()) == {0, 1}, w                     # warm-ups of one chunk
        assert f is None or set(f.flatten().tolist()) == {0, 1}, f
    elif case.dist == "slow-decay":
        assert torch.equal(w, to_end[:, None].expand_as(w)), (w, to_end)  # every segment to its sequence's end
        assert f is None or torch.equal(f, to_start[:, None].expand_as(f)), (f, to_start)     # and start
    else:                                                                 # even heads g = 0, odd ones strong
        assert torch.equal(w[:, 0], to_end) and set(w[:, 1].tolist()) <= {0, 1}, (w, to_end)
        assert f is None or (torch.equal(f[:, 0], to_start) and set(f[:, 1].tolist()) <= {0, 1}), (f, to_start)
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False)
    tt.assert_segmented_matches_sequential(got, want, xs[0].dtype, NAMES)


def test_segment_plan_covers_every_chunk_once_at_chunk_boundaries(monkeypatch):
    from kernels.backward import dh_segmented as dh_cp
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 16)
    cu = [0, 0, 64 * 40 + 5, 64 * 40 + 6, 64 * 100]
    p = dh_cp.plan(cu, HV=2, n_value_blocks=2, n_sms=132)
    assert p is not None and p.n_segments > len(cu) - 1
    nch = [-(-(cu[n + 1] - cu[n]) // 64) for n in range(len(cu) - 1)]
    assert p.cu[0] == 0 and p.cu[-1] == cu[-1] and list(p.cu) == sorted(p.cu)
    for n in range(len(cu) - 1):
        segs = range(p.first[n], p.last[n] + 1)
        assert all(p.seq[j] == n for j in segs)
        assert p.cu[p.first[n]] == cu[n] and p.cu[p.last[n] + 1] == cu[n + 1]
        assert all((p.cu[j + 1] - cu[n]) % 64 == 0 for j in segs if j != p.last[n])
        assert p.chunk_offsets[p.last[n] + 1] - p.chunk_offsets[p.first[n]] == nch[n]
        assert all(p.chunk_offsets[j + 1] - p.chunk_offsets[j] >= dh_cp.MIN_CHUNKS for j in segs if len(segs) > 1)
    assert dh_cp.plan(cu, HV=64, n_value_blocks=2, n_sms=132) is None       # enough CTAs already


def test_segment_plan_only_for_long_sequences():
    """The measured boundary: sequential at B1 T8192 H4 HV8 (128 chunks, where the segmented form lost on
    an H200), segmented at B1 T65536 H2 HV4 (1024 chunks, where it won)."""
    from kernels.backward import dh_segmented as dh_cp
    assert dh_cp.plan([0, 8192], HV=8, n_value_blocks=2, n_sms=132) is None
    p = dh_cp.plan([0, 65536], HV=4, n_value_blocks=2, n_sms=132)
    assert p is not None and p.n_segments >= 4
    assert dh_cp.plan([0, 64 * (dh_cp.MIN_SEQ_CHUNKS - 1)], HV=4, n_value_blocks=2, n_sms=132) is None
    assert dh_cp.plan([0, 64 * dh_cp.MIN_SEQ_CHUNKS], HV=4, n_value_blocks=2, n_sms=132) is not None


def test_backward_dispatch():
    """``backward_plan``: the recompute on a side stream from 4096 (chunk, value head) pairs (off at B1 T8192 H4
    HV8, on at B1 T32768 H16 HV32 and B1 T65536 H2 HV4); its state kernel at the forward's ``block_v``, one CTA
    per SM; cluster sums for groups of 2, 4, 8 only; the sequential and the warm segmented reverse pass, both with
    split operands, read the saved tables (Tinv's hi term); dh warp-specialised where its 32-column CTAs fit one
    wave; a plan the kernels cannot run raises."""
    import dataclasses

    from kernels.backward.configs import BwdConfig, prim_func

    from kernels.plan import WS_CP_BV, backward_plan, block_v
    assert not backward_plan("bfloat16", 4, 8, 8192 // 64, 1).overlap_recompute
    assert backward_plan("bfloat16", 16, 32, 32768 // 64, 1).overlap_recompute
    assert backward_plan("bfloat16", 2, 4, 65536 // 64, 1).overlap_recompute
    for n_seq, HV in ((1, 32), (1, 4), (8, 32), (1, 8), (3, 5)):
        p = backward_plan("bfloat16", 1, HV, 64 * n_seq, n_seq)
        bv = WS_CP_BV if p.recompute_cp > 1 else block_v(n_seq, HV)
        assert (p.recompute_block_v, p.recompute_ctas_per_sm) == (bv, 1)
        assert p.recompute_configs()[1].BV == bv
    assert [backward_plan("float16", 1, r, 64, 1).cluster_group_sum for r in (1, 2, 3, 4, 6, 8)] == \
        [False, True, False, True, False, True]
    seq, seg = backward_plan("bfloat16", 1, 2, 64, 1), backward_plan("bfloat16", 1, 2, 64, 1, dh_segments=object())
    assert not seq.dh_single and seq.takes_saved_tables and not seg.dh_single and seg.takes_saved_tables
    assert seq.dh_config(True).tinv_hi and not seq.dh_config(False).tinv_hi and not seg.dh_config(False).tinv_hi
    # the warm segmented pass on the forward's tables: Tinv's hi term, the chunks' bounds from prep; the three passes
    # compute the tables themselves (Tinv's lo term)
    assert seg.dh_config(True).tinv_hi and seg.dh_config(True).warm and seg.prep_config(True).bounds
    assert not seq.prep_config(True).bounds and not dataclasses.replace(seg, dh_warm=False).takes_saved_tables
    single = dataclasses.replace(seq, dh_single=True, lo8=False)
    assert single.dh_config(True).single and not single.dh_config(True).tinv_hi
    with pytest.raises(ValueError, match="cluster group sums"):
        dataclasses.replace(backward_plan("bfloat16", 1, 3, 64, 1), cluster_group_sum=True)
    with pytest.raises(ValueError, match="every operand split"):
        dataclasses.replace(seg, dh_single=True, lo8=False)
    # dh warp-specialised at 32 value columns where those CTAs (N x HV x K / 32) fit one wave, at K = 128, on the
    # sequential pass; the register kernel elsewhere (fp16 inputs: bf16 ones at N x HV = 256 run the fused plan)
    ws = {(n, HV, D, s is None): backward_plan("float16", 1, HV, 64, n, dh_segments=s, DK=D).dh_ws_bv
          for n, HV in ((1, 32), (1, 33), (4, 8), (8, 32), (1, 4)) for D in (128, 64) for s in (None, object())}
    assert {k for k, v in ws.items() if v} == {(1, 32, 128, True), (4, 8, 128, True), (1, 4, 128, True)}, ws
    assert set(ws.values()) == {0, 32}
    assert seq.dh_config(True).ws_bv == 32 and seg.dh_config(False).ws_bv == 0
    with pytest.raises(ValueError, match="dh_ws_bv"):
        dataclasses.replace(seq, dh_ws_bv=64)
    with pytest.raises(ValueError, match="a form of dh"):
        prim_func(BwdConfig("dqk", "bfloat16", ws_bv=32))


def test_recompute_dispatch_per_segment():
    """``backward_plan``'s recompute per CP segment where one pass of 16-column blocks leaves SMs idle and the
    longest sequence has 32 chunks or more (``ws_cp_segments``, at ``WS_CP_BV`` columns): 16 segments at B1 T65536
    H2 HV4, 8 at B1 T8192 H4 HV8, none on the many-head shapes or short sequences; the longest sequence counts
    (``max_chunks``), not the mean; the scan and fix-up join its configurations; a count out of range raises."""
    import dataclasses

    from kernels.forward.configs import FixupConfig, StateConfig
    from kernels.plan import WS_CP_BV, backward_plan

    def cp(H, HV, chunks, n_seq=1, **kw):
        return backward_plan("bfloat16", H, HV, chunks * n_seq, n_seq, **kw).recompute_cp
    assert cp(2, 4, 1024) == 16 and cp(4, 8, 128) == 8
    assert cp(16, 32, 512) == cp(16, 32, 64, 8) == cp(16, 32, 512, DK=64) == 1
    assert cp(2, 4, 31) == 1 and cp(2, 4, 32) == 2
    assert cp(1, 2, 20, 4) == 1 and backward_plan("bfloat16", 1, 2, 80, 4, max_chunks=64).recompute_cp == 4
    p = backward_plan("bfloat16", 2, 4, 1024, 1)
    assert p.recompute_block_v == WS_CP_BV
    scan, fixup = p.recompute_configs()[2:]
    assert isinstance(scan, StateConfig) and scan.scan and not scan.warm and isinstance(fixup, FixupConfig)
    assert scan in p.configs(False) and fixup in p.configs(True)
    assert scan in p.recompute_cp_plan().configs() and p.recompute_cp_plan().cp == 16
    assert len(dataclasses.replace(p, recompute_cp=1).recompute_configs()) == 2
    for bad in (0, 17):
        with pytest.raises(ValueError, match="recompute_cp"):
            dataclasses.replace(p, recompute_cp=bad)
    # with the segmented reverse pass: the recompute at WS_CP_BV columns from warm-up chunks (no scan) at K = 128,
    # from the shared scan's start states at K = 64 (the scan's configurations)
    seg = backward_plan("bfloat16", 2, 4, 1024, 1, dh_segments=object())
    assert seg.recompute_warm and not seg.shared_scan and seg.recompute_block_v == WS_CP_BV and not p.shared_scan
    assert len(seg.recompute_configs()) == 2 and seg.recompute_configs()[1].warm
    seg64 = backward_plan("bfloat16", 2, 4, 1024, 1, dh_segments=object(), DK=64)
    assert seg64.shared_scan and not seg64.recompute_warm and seg64.dh_warm
    assert len(dataclasses.replace(seg64, recompute_cp=1).recompute_configs()) == 4
    with pytest.raises(ValueError, match="needs dh_segments"):
        dataclasses.replace(p, shared_scan=True)


def test_recompute_ws_plan_and_configuration():
    """``BackwardPlan.recompute_ws`` (dispatched at the head dims of ``WS_HEAD_DIMS``): the recompute's state
    configuration is the ws form storing the smem form's tables (``StateConfig.tables``) at the plan's BV, S lo in
    fp8 with ``lo8``,
    one that ``kernels.build`` compiles; the plan refuses it at two CTAs per SM, at 128 value columns and at the
    head dims the ws form is not built for, and a ``tables`` configuration outside the ws form is refused."""
    import dataclasses

    from kernels.build import all_configs
    from kernels.forward.configs import StateConfig, prim_func as fwd_prim_func
    from kernels.plan import backward_plan
    p = backward_plan("bfloat16", 16, 32, 512, 1)
    assert p.recompute_ws and not backward_plan("bfloat16", 16, 32, 512, 1, DK=64).recompute_ws
    smem = dataclasses.replace(p, recompute_ws=False).recompute_configs()[1]
    ws = p.recompute_configs()[1]
    assert (smem.form, smem.tables) == ("smem", False) and (ws.form, ws.tables, ws.lo8) == ("ws", True, True)
    assert (ws.BV, ws.prec, ws.ctas_per_sm) == (smem.BV, smem.prec, 1) and ws in all_configs()
    assert ws.name.endswith(",lo8,tables,bfloat16]"), ws.name
    for bad in (dict(recompute_ctas_per_sm=2, recompute_block_v=32), dict(recompute_block_v=128)):
        with pytest.raises(ValueError, match="recompute_ws"):
            dataclasses.replace(p, recompute_ws=True, **bad)
    with pytest.raises(ValueError, match="recompute_ws"):
        dataclasses.replace(backward_plan("bfloat16", 16, 32, 512, 1, DK=64), recompute_ws=True)
    for form in ("smem", "rv"):
        with pytest.raises(ValueError, match="tables"):
            fwd_prim_func(StateConfig("bfloat16", 32, ws.prec, form=form, tables=True))
    with pytest.raises(ValueError, match="lo8"):
        fwd_prim_func(StateConfig("bfloat16", 32, ws.prec, form="ws", lo8=True))


def test_dqk_gates_once_and_masked_widening_plan_and_configurations():
    """``dqk_e_once`` and ``dqk_exp_mask``, dispatched at ``DQK_E_ONCE_HEAD_DIM``: the dqk configuration carries both
    (the masked widening only where the lo tables are fp8), every dispatched kind is in the compile list, the plan
    refuses them at another head dim, and the configurations refuse them where they are no form."""
    import dataclasses

    from kernels.backward.configs import CLUSTER_GROUPS, DQK_E_ONCE_HEAD_DIM, BwdConfig, prim_func
    from kernels.build import all_configs
    from kernels.plan import backward_plan
    for H, HV in [(16, 16)] + [(16, 16 * g) for g in CLUSTER_GROUPS]:     # (fp16: bf16 at HV 128 is fused)
        cfg = backward_plan("float16", H, HV, 512, 1).dqk_config()
        assert cfg.e_once and cfg.exp_mask and cfg.lo8 and cfg in set(all_configs()), cfg
    base = backward_plan("bfloat16", 16, 32, 512, 1)
    assert not dataclasses.replace(base, lo8=False).dqk_config().exp_mask
    at64 = backward_plan("bfloat16", 16, 32, 512, 1, DK=64)
    assert DQK_E_ONCE_HEAD_DIM == 128 and not (at64.dqk_e_once or at64.dqk_exp_mask)
    for on in ("dqk_e_once", "dqk_exp_mask"):
        with pytest.raises(ValueError, match=on):
            dataclasses.replace(at64, **{on: True})
    for bad in (BwdConfig("dh", "bfloat16", e_once=True), BwdConfig("dh", "bfloat16", exp_mask=True, lo8=True),
                BwdConfig("dqk", "bfloat16", exp_mask=True)):
        with pytest.raises(ValueError, match="e_once|exp_mask"):
            prim_func(bad)


# the recompute per CP segment: 3 segments of a dense sequence with h0 (value-first); a ragged batch at K = 64
_RECOMPUTE_CP = [Case(T=64 * 48, H=1, HV=2, h0_dtype="fp32", state_v_first=True, dist="raw-qk-l2"),
                 Case(layout="varlen-ragged", T=64 * 90, H=1, HV=2, K=64, V=64, h0_dtype="fp32")]


@pytest.mark.parametrize("case", _RECOMPUTE_CP, ids=[c.id for c in _RECOMPUTE_CP])
def test_recompute_per_segment_plumbing_on_cpu(monkeypatch, case):
    """The dispatched recompute per CP segment (the forward's scan and fix-up on prep's tables, then the state
    kernel per segment from its start state), with the emulation's stage functions standing in for the kernels,
    gives the emulation's gradients (one sequential recompute) as the segmented reverse pass does
    (``assert_segmented_matches_sequential``: a segment's start state comes through the fp64 fix-up of fp32
    results, so single roundings may flip); the one-pass plan within a quarter of the input dtype's rounding and
    asking for no scan."""
    import dataclasses

    import kernels.forward.configs as fbuild
    from kernels.backward import pipeline as bapi

    asked = []
    _fake_kernels(monkeypatch, asked)
    xs, kw, do, dht = tt.bwd_args(case)
    plan = bapi.plan_for(bapi.prepare_backward(*xs, do, dht, **kw))
    assert plan.recompute_cp >= 2, plan
    want = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, tinv_hi_only=False)
    for p in (plan, dataclasses.replace(plan, recompute_cp=1, recompute_block_v=16)):
        asked.clear()
        got = bapi.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=p)
        if p.recompute_cp > 1:
            tt.assert_segmented_matches_sequential(got, want, xs[0].dtype, NAMES)
        else:
            _assert_gradients_within_a_quarter_of_rounding(got, want, xs[0].dtype)
        scans = [c for c in asked if isinstance(c, (fbuild.FixupConfig, fbuild.StateConfig)) and
                 (isinstance(c, fbuild.FixupConfig) or c.scan)]
        assert len(scans) == (2 if p.recompute_cp > 1 else 0), asked


def test_segment_scan_composes_the_affine_maps_of_a_sequence(monkeypatch):
    """end_gradients against the plain backward composition of random affine maps dS_start = P dS_end + a."""
    from kernels.backward import dh_segmented as dh_cp
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 16)
    cu = [0, 64 * 40, 64 * 40 + 3, 64 * 90]
    p = dh_cp.plan(cu, HV=1, n_value_blocks=1, n_sms=132)
    assert p is not None
    t = dh_cp.plan_tensors(p, "cpu")
    g = torch.Generator().manual_seed(3)
    NS, HV, K, V = p.n_segments, 2, 4, 3
    P = torch.randn(NS, HV, K, K, generator=g) * 0.5
    a0 = torch.randn(NS, HV, K, V, generator=g)            # start gradient from a zero end gradient
    dht = torch.randn(len(cu) - 1, HV, K, V, generator=g)
    a = a0.clone()
    for n in range(len(cu) - 1):                              # pass A: the last segment starts from dht
        a[p.last[n]] = a0[p.last[n]] + P[p.last[n]] @ dht[n]
    E = dh_cp.end_gradients(t, a, P, dht)
    for n in range(len(cu) - 1):
        x = dht[n].double()
        for j in range(p.last[n], p.first[n] - 1, -1):
            assert torch.allclose(E[j].double(), x, atol=1e-5), (n, j)
            x = P[j].double() @ x + a0[j].double()


def test_segmented_pass_runs_no_torch_operator_per_segment(monkeypatch):
    """The segmented reverse pass's host work does not grow with its segment count: one backward (stand-in
    kernels) at 4 and at 9 segments a sequence runs the same torch operators that launch device work (views and
    allocations aside) and the same kernels; its end-gradient scan is one launch, not steps per segment.  None of
    them makes a tensor from host data."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import kernels.build as build
    import kernels.interface as interface
    from kernels.backward import dh_segmented as dh_cp
    from kernels.backward import pipeline as bapi

    free = ("view", "empty", "detach", "slice", "transpose", "select", "expand", "alias", "as_strided", "t.default")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not launches_running and not any(f in str(func) for f in free):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _fake_kernels(monkeypatch, [])
    launches, launches_running = [], []
    fake = build.get_kernel

    def launching(cfg):                  # the stand-in's own torch work is the kernel's, not the host's
        k = fake(cfg)

        def launch(*a):
            launches.append(getattr(cfg, "kind", type(cfg).__name__))
            launches_running.append(1)
            try:
                return k(*a)
            finally:
                launches_running.pop()
        return launch
    monkeypatch.setattr(build, "get_kernel", launching)
    monkeypatch.setattr(dh_cp, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 1)
    case = Case(T=640, H=1, HV=2, grad=True)             # one sequence of 10 chunks, 2 value heads
    xs, kw, do, dht = tt.bwd_args(case)
    seen = {}
    for segs in (4, 9):
        # the cached index orders start empty at each count (an earlier test may have made one of them)
        monkeypatch.setattr(interface, "_INDEX_ORDER", {})
        monkeypatch.setattr(bapi, "_sm_count", lambda dev, s=segs: 2 * bapi.dh_value_blocks(case.K) * s)
        plan = bapi.plan_for(bapi.prepare_backward(*xs, do, dht, **kw))
        assert plan.dh_segments is not None and plan.dh_segments.cu.numel() - 1 == segs, plan.dh_segments
        launches.clear()
        with Ops() as m:
            bapi.chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, plan=plan)
        seen[segs] = (sorted(m.ops), sorted(launches))
    assert seen[4] == seen[9], seen
    # no tensor made from host data (on a GPU, a copy that makes the host wait for the stream)
    assert not [op for op in seen[4][0] if "lift_fresh" in op], seen[4][0]


@pytest.mark.parametrize("dht_form", ["key-first", "value-first view", "none"])
def test_end_walk_is_the_segment_scan(monkeypatch, dht_form):
    """``end_gradients`` by the forward's fp64 walk (``walk_ends``: the fix-up kernel, here its CPU stand-in, over
    each sequence's segments in reverse order) against its torch steps, on random maps of sequences of several
    segments and of one (whose end gradient is dht alone); each sequence's last transfer matrix NaN, as the forward
    scan leaves it, and never read."""
    import kernels.build as build
    from kernels.backward import dh_segmented as dh_cp
    from kernels.forward.configs import FixupConfig

    _fake_kernels(monkeypatch, [])
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 16)
    cu = [0, 64 * 40, 64 * 40 + 3, 64 * 90]
    p = dh_cp.plan(cu, HV=1, n_value_blocks=1, n_sms=132)
    assert p is not None and 1 in [l - f + 1 for f, l in zip(p.first, p.last)], p
    t = dh_cp.plan_tensors(p, "cpu")
    g = torch.Generator().manual_seed(5)
    NS, HV, D = p.n_segments, 2, 8
    P = torch.randn(NS, HV, D, D, generator=g) * 0.4
    P[list(p.last)] = float("nan")
    a = torch.randn(NS, HV, D, D, generator=g)
    dht = None if dht_form == "none" else torch.randn(len(cu) - 1, HV, D, D, generator=g)
    if dht_form == "value-first view":        # the key-first view of a value-first dht, as dh passes it
        dht = dht.transpose(-1, -2)
    want = dh_cp.end_gradients(t, a, P, dht)
    got = dh_cp.end_gradients(t, a, P, dht, build.get_kernel(FixupConfig(D)))
    assert torch.isfinite(got).all() and got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_saved_tables_are_kept_where_the_backward_reads_them(monkeypatch):
    """``reads_saved_tables`` (the autograd Function asks it before its forward): the forward's intra tables are
    kept where the reverse pass is the sequential one and where it is the warm segmented one (few heads over long
    sequences), not where the forward refuses the inputs."""
    from kernels.backward import dh_segmented as dh_cp
    from kernels.backward import pipeline as bapi

    xs, kw, do, dht = tt.bwd_args(_SEGMENTED[0])
    q = xs[0]
    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 256)
    assert bapi.reads_saved_tables(q)                # too few chunks for segments: sequential
    monkeypatch.setattr(dh_cp, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 1)
    assert bapi.reads_saved_tables(q)                # segmented (warm)
    assert not bapi.reads_saved_tables(q.float())    # no kernel dtype: nothing to keep


def test_one_term_plans_store_no_unread_lo_tables():
    """The one-term plans' kernels read U's and Tinv's hi terms alone, so their recompute stores no U lo table
    (precision u "bf16": the same hi values) and their prep no Tinv lo (``tinv_hi``); the other plans keep both lo
    tables. Every such form is in the compile list."""
    import dataclasses

    from kernels import plan as kp
    from kernels.build import all_configs

    n = kp.FUSED_MIN_CTAS
    every = all_configs()
    fused = kp.backward_plan("bfloat16", 16, 32, 64 * n // 32, n // 32)
    split = fused.split
    assert fused.fused and fused.one_term and not split.one_term
    for p in (fused, dataclasses.replace(fused, fused=False), dataclasses.replace(fused, fused_warm=True)):
        state, prep = p.recompute_configs()[1], p.prep_config(False)
        assert state.prec.u == "bf16" and state.prec.s == "bf16", (p, state)
        assert prep.tinv_hi and prep.no_du == p.fused, (p, prep)
        assert state in every and prep in every, (state.name, prep.name)
    assert split.recompute_configs()[1].prec.u == "split" and not split.prep_config(False).tinv_hi


def test_the_fused_plan_is_dispatched_where_its_one_pass_fills_the_gpu(monkeypatch):
    """``backward_plan`` gives the fused one-term plan for bf16 inputs at K = 128 from ``FUSED_MIN_CTAS`` (value head,
    sequence) pairs, with prep converting the inputs, and the split plan below that, for fp16 inputs and at K = 64;
    where it does, the forward keeps no tables (``reads_saved_tables`` of q, v and cu_seqlens, and the library op's
    dense table count)."""
    import dataclasses

    from kernels import plan as kp
    from kernels.backward import pipeline as bapi
    from kernels.library import dense_kept_chunks

    n = kp.FUSED_MIN_CTAS
    fused = kp.backward_plan("bfloat16", 16, 32, 64 * n // 32, n // 32)
    assert fused.fused and fused.one_term and fused.dtype == "float16" and fused.io_dtype == "bfloat16"
    assert not fused.takes_saved_tables and fused.fused_config().name.startswith("bwd_fused")
    # prep converts the inputs (no conversion pass), in the fused plan alone
    assert fused.converts_in_prep and fused.convert_config() is None and fused.amax_config() is not None
    kinds = {getattr(c, "kind", "") for c in fused.configs(False)}
    assert fused.prep_config(False).io == "bfloat16" and "cvt" not in kinds, kinds
    assert not dataclasses.replace(fused, fused=False).converts_in_prep
    for args, kw in [(("bfloat16", 16, 32, 64, n // 32 - 1), {}), (("float16", 16, 32, 64, n // 32), {}),
                     (("bfloat16", 16, 32, 64, n // 32), {"DK": 64})]:
        p = kp.backward_plan(*args, **kw)
        assert not (p.fused or p.one_term) and p.takes_saved_tables, (args, kw, p)
    # the forward's side: dense B x HV, and varlen by cu_seqlens' length alone
    B, HV = n // 32, 32
    q = torch.zeros(B, 64, 16, 128, dtype=torch.bfloat16)
    v = torch.zeros(B, 64, HV, 128, dtype=torch.bfloat16)
    assert bapi.runs_fused(q, v) and not bapi.reads_saved_tables(q, v) and bapi.reads_saved_tables(q)
    assert not bapi.runs_fused(q[:-1], v[:-1]) and bapi.reads_saved_tables(q[:-1], v[:-1])
    assert not bapi.runs_fused(q.half(), v.half()) and bapi.reads_saved_tables(q.half(), v.half())
    cu = torch.arange(0, 64 * (B + 1), 64, dtype=torch.int32)
    assert bapi.runs_fused(q.reshape(1, -1, 16, 128), v.reshape(1, -1, HV, 128), cu)
    assert not bapi.runs_fused(q.reshape(1, -1, 16, 128), v.reshape(1, -1, HV, 128), cu[:-1])
    # the op's table count (its fake implementation's), with CPU tensors standing in for CUDA ones
    from kernels import library
    monkeypatch.setattr(library, "_KEEPS_TABLES", ("cuda", "cpu"))
    assert dense_kept_chunks(q, v, True) == 0 and dense_kept_chunks(q[:-1], v[:-1], True) == B - 1


def test_autograd_takes_cu_seqlens_made_under_inference_mode():
    """Engines make cu_seqlens under torch.inference_mode(): the Function's gradients with such a tensor equal those
    with an ordinary one, and the forward runs under inference_mode and no_grad."""
    from kernels.autograd import apply

    torch.manual_seed(0)
    T, H, HV, D = 130, 1, 2, 64
    q = torch.randn(1, T, H, D).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, D).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV))
    beta = torch.rand(1, T, HV)
    with torch.inference_mode():
        cu_inf = torch.tensor([0, 50, 130])
    grads = []
    for cu in (torch.tensor([0, 50, 130]), cu_inf):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        o, ht = apply(*xs, output_final_state=True, cu_seqlens=cu, impl="emulation")
        (o.float().square().sum() + ht.square().sum()).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            o2, _ = apply(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_inf, impl="emulation")
        assert torch.equal(o2, o.detach())


def test_a_call_that_no_gradient_can_reach_skips_the_function(monkeypatch):
    """Grad mode off, or no input requiring a gradient: ``apply`` runs the forward alone (no autograd Function, no
    tables kept), with o and the final state of the Function's call; an input that requires one goes through it."""
    from kernels import autograd

    xs, kw = tt.call_args(Case(T=130, H=1, HV=2, h0_dtype="fp32"))
    calls = []
    real = autograd.ChunkGatedDeltaRuleFunction.apply
    monkeypatch.setattr(autograd.ChunkGatedDeltaRuleFunction, "apply", lambda *a: calls.append(1) or real(*a))
    want = autograd.apply(*[x.clone().requires_grad_() for x in xs], **kw, output_final_state=True, impl="emulation")
    assert calls == [1] and want[0].requires_grad
    for ctx, ins in ((torch.no_grad, xs), (torch.inference_mode, xs), (contextlib.nullcontext, xs),
                     (torch.no_grad, [x.clone().requires_grad_() for x in xs])):
        with ctx():
            got = autograd.apply(*ins, **kw, output_final_state=True, impl="emulation")
        assert calls == [1], ctx
        assert not got[0].requires_grad and all(torch.equal(a, b.detach()) for a, b in zip(got, want))


# the row where the single dh's dbeta is farthest from fp64: strong decay, so a sequence's last token carries the
# final-state gradient's share of dbeta through dU, which the single form rounds to one input-dtype term
_DBETA_ROW = Case(T=128, H=1, HV=1, dist="strong-decay", seed=3, grad=True)


def test_split_dh_on_tinv_hi_makes_dbeta_the_most_accurate():
    """dh with dU and F0 dX split (two input-dtype terms) on Tinv hi alone (what the default plan runs on the
    forward's saved tables) puts dbeta at least 10x closer to fp64 than the same-precision baseline,
    where the single form is farther than the baseline; every other gradient no farther than the single form's."""
    xs, kw, do, dht = tt.bwd_args(_DBETA_ROW)
    want, base = tt.fp64_grads(_DBETA_ROW), tt.baseline_grads(_DBETA_ROW)
    single = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=True)
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_single=False, tinv_hi_only=True)
    err = {n: (compare(s, r).rel_rmse, compare(p, r).rel_rmse, compare(b_, r).rel_rmse)
           for n, s, p, b_, r in zip(NAMES, single, split, base, want) if r is not None}
    print("\n" + "  ".join(f"{n}: single {s:.2e} split {p:.2e} baseline {b_:.2e}" for n, (s, p, b_) in err.items()))
    s, p, b_ = err["dbeta"]
    assert p <= b_ / 10 and s > b_, f"dbeta rel_rmse: split {p:.2e}, single {s:.2e}, baseline {b_:.2e}"
    for n, (s, p, _) in err.items():
        assert p <= s * 1.001, f"{n}: split {p:.2e} > single {s:.2e}"


def test_default_plan_on_saved_tables_runs_split_dh_on_tinv_hi(monkeypatch):
    """The kernel path (stand-in kernels) with the dispatched plans gives the emulation's ``tinv_hi_only``
    gradients: prep on the forward's saved tables, dh with every operand split reading Tinv's hi term alone."""
    import kernels.backward.configs as bbuild

    asked = _kernel_path_is_the_emulation(monkeypatch, _DBETA_ROW, None, dh_single=False, tinv_hi_only=True)
    bw = [c for c in asked if isinstance(c, bbuild.BwdConfig)]
    assert any(c.kind == "prep" and c.saved for c in bw), asked
    dhs = [c for c in bw if c.kind == "dh"]
    assert dhs and all(c.tinv_hi and not c.single for c in dhs), asked


def test_unwritten_arguments_view_held_memory_or_get_their_own():
    """dqk's fp32 pair that it leaves unwritten views a table the call holds (its bytes from the start), and gets an
    allocation of its own where that table is too small (K = 64 without GVA)."""
    from kernels.backward.pipeline import _view_over

    held = torch.empty(4, 8, dtype=torch.bfloat16)                  # 64 bytes
    v = _view_over(held, (2, 8), torch.float32)
    assert v.shape == (2, 8) and v.dtype == torch.float32 and v.is_contiguous()
    assert v.data_ptr() == held.data_ptr() and v.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    own = _view_over(held, (3, 8), torch.float32)                   # 96 bytes > 64
    assert own.shape == (3, 8) and own.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()


def test_one_term_plan_builds_its_kernels_and_refuses_other_forms():
    """``BackwardPlan.one_term`` with ``io_dtype`` (the ``ours-one16`` column): the fp16 one-term dh_ws and dqk storing
    bf16 gradients and the conversion kernel; a one-term plan without its companions, an ``io_dtype`` without one
    term and a one-term configuration of another kernel are refused, naming the field."""
    import dataclasses

    from kernels.backward.configs import BwdConfig, prim_func
    from kernels.plan import backward_plan
    bp = backward_plan("bfloat16", 16, 32, 512, 1)
    one = dict(dtype="float16", io_dtype="bfloat16", one_term=True, dh_single=True, s_single=True, lo8=False,
               reads_saved_tables=False, dh_ws_bv=32)
    p = dataclasses.replace(bp, **one)
    names = {c.name for c in p.configs(False) + p.recompute_configs()}
    assert "bwd_dh[DK=DV=128,single,one,ws32,io=bfloat16,float16]" in names, sorted(names)
    assert "bwd_dqk_g2[DK=DV=128,s_single,e_once,one,io=bfloat16,float16]" in names, sorted(names)
    assert "bwd_cvt[DK=DV=128,io=bfloat16,float16]" in names and not any(",lo8" in n for n in names), sorted(names)
    assert "bwd_amax[DK=DV=128,bfloat16]" in names, sorted(names)
    assert bp.convert_config() is None and bp.amax_config() is None
    for bad in (dict(one_term=True), dict(one, dh_single=False), dict(one, lo8=True), dict(io_dtype="float16")):
        with pytest.raises(ValueError, match="one_term|io_dtype"):
            dataclasses.replace(bp, **bad)
    for cfg in (BwdConfig("dh", "float16", 128, one=True), BwdConfig("prep", "float16", 128, one=True),
                BwdConfig("dqk", "float16", 128, one=True), BwdConfig("cvt", "float16", 128),
                BwdConfig("dqk", "bfloat16", 128, s_single=True, one=True, io="bfloat16")):
        with pytest.raises(ValueError, match="one|io"):
            prim_func(cfg)


_GROUP_SCALE_CASES = [Case(T=200, H=2, HV=4, h0_dtype="fp32", dist="raw-qk-l2", grad=True),
                      Case(layout="varlen-boundary", T=193, H=1, HV=2, h0_dtype="fp32", state_v_first=True, grad=True)]


@pytest.mark.parametrize("case", _GROUP_SCALE_CASES, ids=[c.id for c in _GROUP_SCALE_CASES])
def test_group_scales_make_the_one_term_backward_exactly_homogeneous(case):
    """The one-term fp16 backward with ``group_scales`` (GVA groups, varlen, a value-first h0): dO and dht times 2^-20
    scale every gradient but none of the forward's by exactly 2^-20, v and h0 times 2^7 scale dq, dk, dg, dbeta by
    exactly 2^7 and leave dv, dh0 unchanged, bit for bit."""
    xs, kw, do, dht = tt.bwd_args(case)
    form = dict(dh_single=True, s_single=True, lo8_tables=False, one_term=True, kernel_dtype=torch.float16,
                group_scales=True)
    base = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **form)
    s = 2.0 ** -20
    small = chunk_gated_delta_rule_bwd(*xs, do * s, None if dht is None else dht * s, **kw, **form)
    for n, a, b in zip(NAMES, base, small):
        if a is not None:
            assert torch.equal(a.float() * s, b.float()), n
    t = 2.0 ** 7
    q, k, v, g, beta = xs
    kw_v = dict(kw, initial_state=kw["initial_state"] * t)
    big = chunk_gated_delta_rule_bwd(q, k, v * t, g, beta, do, dht, **kw_v, **form)
    for n, a, b in zip(NAMES, base, big):
        if a is not None:
            assert torch.equal(a.float() * (1 if n in ("dv", "dh0") else t), b.float()), n


def test_recompute_one_is_the_emulations_study_form_and_compiled():
    """``BackwardPlan.recompute_one`` (read with ``one_term``, dispatched with the fused plan): the recompute's
    precision takes K S's S, X and F2 U to one term, the fields the emulation's ``RECOMPUTE_ONE`` names
    (``precision_bwd.py``'s rc16, ``FUSED_FP16``), Ag stays split; both forms' state kernels are in the compile list;
    a plan without one term keeps its kernels."""
    import dataclasses

    from kernels import plan as kp
    from kernels.backward.emulation import FUSED_FP16, RECOMPUTE_ONE
    from kernels.build import forward_configs

    n = kp.FUSED_MIN_CTAS
    one = kp.backward_plan("bfloat16", 16, 32, 64 * n // 32, n // 32)
    fused = dataclasses.replace(one, recompute_one=False)
    assert one.fused and one.recompute_one and FUSED_FP16["recompute_one"] == RECOMPUTE_ONE
    assert fused.recompute_configs()[1] in forward_configs()
    a, b = fused.recompute_configs()[1].prec, one.recompute_configs()[1].prec
    changed = {f for f in ("ag", "ks", "x", "upd", "s", "u", "p", "merge") if getattr(a, f) != getattr(b, f)}
    assert changed == set(RECOMPUTE_ONE) and all(getattr(b, f) == "bf16" for f in RECOMPUTE_ONE) and b.ag == "split"
    assert one.recompute_configs()[1] in forward_configs()
    split = fused.split
    assert dataclasses.replace(split, recompute_one=True).recompute_configs() == split.recompute_configs()
