"""GPU correctness of our TileLang GDN backward (marker ``gpu``), through the autograd Function
``kernels.autograd.chunk_gated_delta_rule``, against fp64 autograd through ``reference.chunk``.

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or tilelang is missing.
Cases (``tests.kernel_support.GPU_CASES`` by name): T in 1, 63, 64, 65, 1000, 8192; dense B=1 and B=3;
varlen with boundary lengths and with empty sequences; GVA ratios 2 and 4; h0 (also ~50x) and both state
layouts; bf16 and fp16; fp32, bf16 and fp16 gates; g near -20, g == 0 with extreme beta; in-kernel l2 norm;
K = V = 64.  ``do`` ~ N(0, 1), ``dht`` ~ 0.1 N(0, 1).

Criteria (no absolute tolerances; the CPU emulation of the same kernels meets them with a wide margin,
``tests/test_kernels_bwd_emulation.py``): no NaN/Inf; every gradient's rel_rmse vs fp64 no larger than the
FLA-like baseline's (autograd through ``reference.emulated``, FLA's intermediate roundings); with g near -20
dg within the input dtype's rounding floor; on the ``compare_fla`` cases also no larger than FLA Triton's.
``test_stages_match_emulation`` prints every intermediate's distance to the emulation (to localise a
failing stage) and asserts the final gradients agree with it within the input dtype's rounding floor.
"""

import contextlib

import pytest
import torch

from tests import kernel_support as tt

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

_NAMES = ["T1", "T63", "T64", "T65_h0", "T1000_h0_gva2", "T8192", "B3_T1000_fp16_vfirst_h0",
          "varlen_boundaries_h0_vfirst", "varlen_with_empty_h0", "gva4_l2norm", "bf16_gates", "fp16_fp16_gates_h0",
          "g_near_-20_h0x50", "g_zero_beta_extreme", "D64_h0_vfirst"]
CASES = [c for c in tt.GPU_CASES if c.name in _NAMES]


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel the cases need in parallel processes first (fills TileLang's disk cache)."""
    import os

    from kernels.backward.configs import configs_for_call, dh_config, forward_recompute_configs, precompile
    cfgs = []

    def add(new):
        cfgs.extend(x for x in new if x not in cfgs)

    for c in CASES + _OUTPUT_CASES + [tt.Case("bad", 1, 64, 2, 4)]:
        dt, n, mc = _call_shape(c)
        for tables, fused in (("split", None), ("lean_sd", None), ("split", False)):
            add(configs_for_call(dt, n, c.HV, mc, c.h0 is not None, tables, fused))
        for shape in (f.get("shape") for f in _RECOMPUTE_FORMS.values()):     # the recompute's forced shapes
            with _build_switch("_RECOMPUTE_STATE", shape):
                add(forward_recompute_configs(dt, 1, 1))
    for c in _CF_CASES:                                    # the kernels without the conflict-free tiles
        dt, n, mc = _call_shape(c)
        with _build_switch("_CONFLICT_FREE", False):
            add(configs_for_call(dt, n, c.HV, mc, c.h0 is not None))
    with _build_switch("_DH_SINGLE", False):               # dh with every operand split (both dtypes)
        add([dh_config(dt) for dt in ("bfloat16", "float16")])
    for c in _FORM_CASES:                                  # the candidates' kernels (single 64x64 operands, dUl)
        dt, n, mc = _call_shape(c)
        for switch, on in (("_INTRA_SINGLE", False), ("_DUL_INPUT_DTYPE", True)):
            with _build_switch(switch, on):
                add(configs_for_call(dt, n, c.HV, mc, c.h0 is not None))
    failed = precompile(cfgs, min(10, os.cpu_count() or 1))
    assert not failed, failed


def _call_shape(case):
    """(kernel dtype, sequences, most chunks of a sequence) of ``case``'s call."""
    lens = case.lens or [case.T] * case.B
    dt = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[case.dtype]
    return dt, len(lens), max([-(-x // 64) for x in lens] + [0])


@contextlib.contextmanager
def _build_switch(name, value):
    """``kernels.backward.configs.<name>`` set to ``value`` for the block (restored after, also on an error)."""
    from kernels.backward import build as bb
    saved = getattr(bb, name)
    setattr(bb, name, value)
    try:
        yield
    finally:
        setattr(bb, name, saved)


def _ref(args, kw, do, dht):
    from reference.chunk import chunk_gated_delta_rule as ref
    return tt.autograd_grads(ref, args, kw, do, dht, lambda x: x.double())


def _baseline(args, kw, do, dht):
    from reference.emulated import chunk_gated_delta_rule as emu
    return tt.autograd_grads(emu, args, kw, do, dht, lambda x: x)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradients_against_fp64(case):
    _gradients_against_fp64(case)


_FORM_CASES = [c for c in CASES if c.name in ("T65_h0", "T1000_h0_gva2", "T8192", "B3_T1000_fp16_vfirst_h0",
                                                   "varlen_boundaries_h0_vfirst", "g_near_-20_h0x50",
                                                   "g_zero_beta_extreme", "fp16_fp16_gates_h0")]


@pytest.mark.parametrize("form", ["dh_split", "intra_split", "dul16"])
@pytest.mark.parametrize("case", _FORM_CASES, ids=[c.name for c in _FORM_CASES])
def test_other_forms_gradients_against_fp64(monkeypatch, case, form):
    """The A/B forms under the same bars (within the FLA-like baseline and FLA Triton, dg near g = -20 within the
    rounding floor): dh with every operand split (``build._DH_SINGLE`` off: the column ``ours-dh-split``, the
    API's form until session 13), the split 64x64 intra operands (``build._INTRA_SINGLE`` off: the column
    ``ours-intra-split``, the API's form until session 14) and the candidate dUloc^T in the input dtype
    (``build._DUL_INPUT_DTYPE``: the column ``ours-dul16``)."""
    from kernels.backward import build
    monkeypatch.setattr(build, "_DH_SINGLE", form != "dh_split")
    monkeypatch.setattr(build, "_INTRA_SINGLE", form != "intra_split")
    monkeypatch.setattr(build, "_DUL_INPUT_DTYPE", form == "dul16")
    _gradients_against_fp64(case)


def _gradients_against_fp64(case):
    from kernels.autograd import chunk_gated_delta_rule as ours_fn

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    ours = tt.autograd_grads(ours_fn, args, kw, do, dht, lambda x: x)
    torch.cuda.synchronize()
    want = _ref(args, kw, do, dht)
    base = _baseline(args, kw, do, dht)
    fla = None
    if case.compare_fla:
        f = tt.fla_triton_fn()
        if f is not None:
            fla = tt.autograd_grads(f, args, kw, do, dht, lambda x: x)
    dt = case.dtype
    line = []
    for i, (n, a, r) in enumerate(zip(NAMES, ours, want)):
        x = (list(args) + [kw["initial_state"]])[i]
        assert a.shape == r.shape and a.dtype == (torch.float32 if n == "dh0" else x.dtype), n
        assert tt.nonfinite(a) == 0, n
        e, eb, floor = tt.rel_rmse(a, r), tt.rel_rmse(base[i], r), tt.rel_rmse(r.to(dt), r)
        ef = tt.rel_rmse(fla[i], r) if fla is not None else None
        line.append(f"{n} {e:.2e} (fla-like {eb:.2e}" + (f", FLA {ef:.2e}" if ef is not None else "") + ")")
        if case.gate == "near_-20" and n == "dg":
            assert e <= floor, (n, e, floor)
        else:
            assert e <= eb, (n, e, eb)
        if ef is not None:
            assert e <= ef, (n, e, ef)
    print(f"{case.name}: " + "  ".join(line))


_STAGE_CASES = [c for c in CASES if c.name in ("T65_h0", "varlen_boundaries_h0_vfirst", "gva4_l2norm")]


@pytest.mark.parametrize("tables", ["split", "lean_sd", "split+dh_split", "split+intra_split", "split+dul16"])
@pytest.mark.parametrize("case", _STAGE_CASES, ids=[c.name for c in _STAGE_CASES])
def test_stages_match_emulation(monkeypatch, case, tables):
    """Every intermediate of the kernels vs the torch emulation on the same inputs (printed: max |diff| /
    max |emulation|, to localise a failing stage); the final gradients must agree with the emulation within
    the input dtype's rounding floor (they run the same algorithm with the same roundings).  Both chunk-table
    precisions: the default "split" and the opt-in "lean_sd" (``gdn_bwd/dqk_lean.py``), whose gradients must
    also stay within the FLA-like baseline; the API's dh has single Tinv, dU, F0 dX operands (``build._DH_SINGLE``,
    which the emulation follows) and its intra terms single 64x64 operands (``build._INTRA_SINGLE``),
    "split+dh_split" every dh operand split, "split+intra_split" the intra operands split, "split+dul16" the
    candidate dUloc^T in the input dtype (``build._DUL_INPUT_DTYPE``)."""
    from kernels.backward import build
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu

    tables, _, form = tables.partition("+")
    monkeypatch.setattr(build, "_DH_SINGLE", form != "dh_split")
    monkeypatch.setattr(build, "_INTRA_SINGLE", form != "intra_split")
    monkeypatch.setattr(build, "_DUL_INPUT_DTYPE", form == "dul16")
    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    sk, se = {}, {}
    gk = kern(*args, do, dht, **kw, _stages=sk, _tables=tables)
    torch.cuda.synchronize()
    ge = emu(*args, do, dht, **kw, _stages=se, _tables=tables)
    for name in se:
        a, b = sk[name].double(), se[name].double()
        if a.shape != b.shape:          # K = V = 64: the kernel path works at the padded 128
            a = a[tuple(slice(0, s) for s in b.shape)]
        print(f"  stage {name:<6} max|kernel - emulation| / max|emulation| = {tt.max_rel_diff(a, b):.2e}")
    want = _ref(args, kw, do, dht)
    base = _baseline(args, kw, do, dht)
    for n, a, b, r, bl in zip(NAMES, gk, ge, want, base):
        d, e, floor = tt.rel_rmse(a, b), tt.rel_rmse(b, r), tt.rel_rmse(r.to(case.dtype), r)
        print(f"  {n}: kernel vs emulation {d:.2e}, emulation vs fp64 {e:.2e}, floor {floor:.2e}")
        assert tt.nonfinite(a) == 0
        assert d <= floor, (n, d, floor)
        assert tt.rel_rmse(a, r) <= tt.rel_rmse(bl, r), (n, tt.rel_rmse(a, r), tt.rel_rmse(bl, r))


# intermediates the fused and two-kernel forms both produce (the row-dot tensors summed over their key blocks)
_FUSED_STAGES = ("qz", "kw", "kr", "sd", "yv", "rect", "db2", "dqv", "dkv")


@pytest.mark.parametrize("case", _STAGE_CASES, ids=[c.name for c in _STAGE_CASES])
def test_fused_dqk_matches_the_two_kernels(monkeypatch, case):
    """The fused inter + intra kernel (``dqk_fused.py``, the default) against the two kernels it replaces
    (``api._FUSED_DQK`` off) on the same inputs: the same products on the same operands, summed in another
    order (dq~ / dk~'s intra terms by the wgmma accumulator instead of an atomic add, the row dots over 128
    instead of 2 x 64 key columns), so every intermediate within 1e-5 of its largest magnitude and the final
    gradients within a tenth of the input dtype's rounding floor of each other."""
    from kernels.backward import api

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    sf, su = {}, {}
    gf = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw, _stages=sf)
    monkeypatch.setattr(api, "_FUSED_DQK", False)
    gu = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw, _stages=su)
    torch.cuda.synchronize()
    bad = []
    for name in _FUSED_STAGES:
        a, b = sf[name].double(), su[name].double()
        assert tt.nonfinite(a) == 0, name
        d = tt.max_rel_diff(a, b)
        print(f"  {case.name} stage {name:<4} max|fused - two kernels| / max|two kernels| = {d:.2e}")
        if d > 1e-5:
            bad.append((name, d))
    assert not bad, bad
    want = _ref(args, kw, do, dht)
    for n, a, b, r in zip(NAMES, gf, gu, want):
        d, floor = tt.rel_rmse(a, b), tt.rel_rmse(r.to(case.dtype), r)
        assert d <= 0.1 * floor, (n, d, floor)


# the fused kernel's output forms: groups of 2 and 4 (fp32 per value head, then the group sums: the input dtype, or
# fp32 with the L2 norm), groups of 1 (the final dq, dk; with the L2 norm fp32)
_OUTPUT_CASES = [tt.Case("g2_varlen_h0", 1, 0, 2, 4, lens=[300, 1, 700], h0=1.0),
                 tt.Case("g1_no_l2", 1, 1000, 4, 4), tt.Case("g1_l2_fp16", 2, 333, 2, 2, l2=True, dtype=torch.float16),
                 tt.Case("g4", 1, 1000, 1, 4, l2=True)]


@pytest.mark.parametrize("case", _OUTPUT_CASES, ids=[c.name for c in _OUTPUT_CASES])
def test_fused_outputs_are_deterministic_and_within_the_baseline(case):
    """Each output form of the fused kernel: two calls give bitwise the same gradients, every gradient no farther
    from fp64 than the FLA-like baseline's."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    a = kern(*args, do, dht, **kw)
    b = kern(*args, do, dht, **kw)
    torch.cuda.synchronize()
    want = _ref(args, kw, do, dht)
    base = _baseline(args, kw, do, dht)
    for n, x, y, r, bl in zip(NAMES, a, b, want, base):
        if r is None:
            continue
        assert torch.equal(x, y), n
        assert tt.nonfinite(x) == 0, n
        assert tt.rel_rmse(x, r) <= tt.rel_rmse(bl, r), (n, tt.rel_rmse(x, r), tt.rel_rmse(bl, r))


def test_bad_input_raises_valueerror():
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    case = tt.Case("bad", 1, 64, 2, 4)
    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    with pytest.raises(ValueError, match="do must be"):
        kern(*args, do[:, :10], dht, **kw)
    with pytest.raises(ValueError, match="dht must be"):
        kern(*args, do, dht[:, :1], **kw)


_SEGMENTED = {     # slow decay ("small" / "zero" gates): the state gradient crosses every segment boundary
    "dense_B2_T2048_gva_small_gates": dict(B=2, T=2048, H=2, HV=4, gate="small"),
    "varlen_empty_h0_vfirst_D64_g0": dict(B=1, T=0, H=1, HV=2, D=64, lens=[0, 1500, 1, 0, 700, 64], h0=1.0,
                                          vf=True, gate="zero"),
}


@pytest.mark.parametrize("name", list(_SEGMENTED))
def test_segmented_reverse_pass_matches_the_sequential_one(monkeypatch, name):
    """The few-heads reverse pass (``dh_cp``: the dh kernel over segments, three launches and an fp64 scan), forced
    on (its thresholds set to 1), gives the sequential pass's gradients on the GPU
    (``testing.assert_segmented_matches_sequential``: the CPU plumbing test's check in
    ``test_kernels_bwd_emulation.py``, with the kernels).  The segmented pass runs dh with every operand split, so
    the sequential one it is compared with does too (``build._DH_SINGLE`` off)."""
    from kernels.backward import build, dh_cp
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    monkeypatch.setattr(build, "_DH_SINGLE", False)
    dev = torch.device("cuda")
    xs, do, dht, kw = tt.bwd_inputs(**_SEGMENTED[name])
    xs, do, dht = [x.to(dev) for x in xs], do.to(dev), dht.to(dev)
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    seq = kern(*xs, do, dht, **kw)
    monkeypatch.setattr(dh_cp, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 1)
    seen = []
    real = dh_cp.end_gradients
    monkeypatch.setattr(dh_cp, "end_gradients", lambda *a: seen.append(a[0].cu.numel() - 1) or real(*a))
    seg = kern(*xs, do, dht, **kw)         # the plan cache is keyed by the thresholds: no stale plan is reused
    torch.cuda.synchronize()
    assert seen and seen[0] >= 4, seen                   # the segmented form ran, with several segments
    tt.assert_segmented_matches_sequential(seg, seq, xs[0].dtype, NAMES, label=name)


# the recompute's forms: its own intra2 kernel (serial) against prep's Ag (serial), and prep's Ag beside dh on the
# side stream with the state kernel's default shape (``build.recompute_state_shape``) and three forced ones
_RECOMPUTE_FORMS = {"prep_ag": dict(), "side_auto": dict(side=True), "side_bv16_occ2": dict(side=True, shape=(16, 2)),
                    "side_bv32_occ2": dict(side=True, shape=(32, 2)), "side_bv64": dict(side=True, shape=(64, 1))}


@pytest.mark.parametrize("form", list(_RECOMPUTE_FORMS))
@pytest.mark.parametrize("case", _STAGE_CASES[:2], ids=[c.name for c in _STAGE_CASES[:2]])
def test_recompute_forms_match_the_intra2_recompute(monkeypatch, case, form):
    """The forward recompute from prep's ``Ag`` and gate rows (``api._RECOMPUTE_FROM_PREP``, the default) against
    the recompute's own intra2 kernel (the same operations on the same values), serial and beside dh on the side
    stream (``_OVERLAP_MIN_CHUNK_HEADS`` forced to 1) with each state-kernel shape: the recomputed S and U within
    1e-6 of their largest magnitude, the gradients within a hundredth of the input dtype's rounding floor (the
    value columns per CTA change nothing in a column's sums; printed whether bitwise)."""
    from kernels.backward import api
    from kernels.backward import build as bb

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    monkeypatch.setattr(api, "_RECOMPUTE_FROM_PREP", False)
    monkeypatch.setattr(api, "_OVERLAP_RECOMPUTE", False)
    si, sp = {}, {}
    gi = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw, _stages=si)
    opts = _RECOMPUTE_FORMS[form]
    monkeypatch.setattr(api, "_RECOMPUTE_FROM_PREP", True)
    if opts.get("side"):
        monkeypatch.setattr(api, "_OVERLAP_RECOMPUTE", True)
        monkeypatch.setattr(api, "_OVERLAP_MIN_CHUNK_HEADS", 1)
    monkeypatch.setattr(bb, "_RECOMPUTE_STATE", opts.get("shape"))
    gp = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw, _stages=sp)
    torch.cuda.synchronize()
    for name in ("S", "U"):
        a, b = sp[name].double(), si[name].double()
        d = tt.max_rel_diff(a, b)
        print(f"  {case.name} {form} {name}: max|diff| / max = {d:.2e} (bitwise {torch.equal(a, b)})")
        assert d <= 1e-6, (name, d)
    want = _ref(args, kw, do, dht)
    for n, a, b, r in zip(NAMES, gp, gi, want):
        if r is None:
            continue
        d, floor = tt.rel_rmse(a, b), tt.rel_rmse(r.to(case.dtype), r)
        assert tt.nonfinite(a) == 0, n
        assert d <= 0.01 * floor, (n, d, floor)


def _switch_forms(monkeypatch, case, switch, module="api"):
    """The backward of ``case`` with ``<module>.<switch>`` (a module of ``kernels.backward``) False, then True:
    (gradients with it on, with it off)."""
    import importlib

    from kernels.backward import api

    m = importlib.import_module(f"kernels.backward.{module}")
    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    monkeypatch.setattr(m, switch, False)
    ref = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw)
    monkeypatch.setattr(m, switch, True)
    got = api.chunk_gated_delta_rule_bwd(*args, do, dht, **kw)
    torch.cuda.synchronize()
    return got, ref


def _check_forms(case, got, ref, close=()):
    """Every gradient finite, of the same shape and dtype, and bitwise the same, except those named in ``close``:
    within 1e-5 of the largest magnitude (printed)."""
    for n, a, b in zip(NAMES, got, ref):
        if b is None:
            assert a is None, n
            continue
        assert tt.nonfinite(a) == 0, n
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape)
        if n in close:
            d = tt.max_rel_diff(a.double(), b.double())
            print(f"  {case.name} {n}: max|on - off| / max|off| = {d:.2e}")
            assert d <= 1e-5, (n, d)
        else:
            assert torch.equal(a, b), (n, case.name, tt.max_rel_diff(a.double(), b.double()))


_CLUSTER_CASES = [c for c in tt.GPU_CASES if c.name in ("T1000_h0_gva2", "varlen_boundaries_h0_vfirst",
                                                         "gva4_l2norm", "fp16_fp16_gates_h0")]
_CLUSTER_CASES.append(tt.Case("gva8_h0", 1, 1000, 1, 8, h0=1.0))


@pytest.mark.parametrize("case", _CLUSTER_CASES, ids=[c.name for c in _CLUSTER_CASES])
def test_cluster_group_sums_match_the_group_sum_kernel(monkeypatch, case):
    """The fused dqk kernel summing each GVA group in a thread-block cluster (``api._CLUSTER_GROUP_SUM``, the
    default for groups of 2, 4, 8: ``dqk_fused.cluster_group_sum``) against fp32 rows per value head summed by
    ``gdn_bwd_group_sum``: the same fp32 additions in the same order, so every gradient is bitwise the same (the
    input-dtype outputs without the L2 norm, the fp32 sums before the host's L2-norm chain rule with it)."""
    assert case.HV // case.H in (2, 4, 8)
    _check_forms(case, *_switch_forms(monkeypatch, case, "_CLUSTER_GROUP_SUM"))


_DGDB_CASES = [c for c in CASES if c.name in ("T65_h0", "varlen_boundaries_h0_vfirst", "varlen_with_empty_h0",
                                               "gva4_l2norm", "g_near_-20_h0x50", "D64_h0_vfirst")]


@pytest.mark.parametrize("case", _DGDB_CASES, ids=[c.name for c in _DGDB_CASES])
def test_dg_dbeta_kernel_matches_the_torch_finish(monkeypatch, case):
    """dg and dbeta by ``gdn_bwd_dg_dbeta`` (``api._DG_DBETA_KERNEL``, the default) against the torch form of the
    same terms in ``common.finish``: only the fp32 summation order differs, so within 1e-5 of the largest magnitude
    (printed), and every other gradient bitwise the same."""
    _check_forms(case, *_switch_forms(monkeypatch, case, "_DG_DBETA_KERNEL"), close=("dg", "dbeta"))


_CF_CASES = [c for c in CASES if c.name in ("T65_h0", "varlen_boundaries_h0_vfirst", "gva4_l2norm",
                                            "fp16_fp16_gates_h0", "D64_h0_vfirst")]
_CF_CASES += [c for c in _CLUSTER_CASES if c.name in ("T1000_h0_gva2", "gva8_h0")]


@pytest.mark.parametrize("case", _CF_CASES, ids=[c.name for c in _CF_CASES])
def test_conflict_free_tiles_give_the_same_gradients(monkeypatch, case):
    """``build._CONFLICT_FREE`` (session 12; the API's form since session 13): the recompute's S lo tile swizzled
    and the fused dqk kernel's v, m_s, stage and inbox tiles swizzled or padded change where values sit in shared
    memory, not what is computed, so every gradient is bitwise the same as without them (with and without
    clusters)."""
    _check_forms(case, *_switch_forms(monkeypatch, case, "_CONFLICT_FREE", module="build"))


_SAVED_CASES = [c for c in CASES if c.name in ("T65_h0", "T1000_h0_gva2", "B3_T1000_fp16_vfirst_h0",
                                               "varlen_boundaries_h0_vfirst", "varlen_with_empty_h0", "gva4_l2norm",
                                               "g_zero_beta_extreme", "D64_h0_vfirst")]


@pytest.mark.parametrize("case", _SAVED_CASES, ids=[c.name for c in _SAVED_CASES])
def test_saved_forward_tables_give_the_same_gradients(monkeypatch, case):
    """``autograd._SAVE_TABLES`` (the default since session 14): the forward's intra kernel also stores Tinv and the
    Function hands it, with Ag hi + lo, to the backward, whose prep skips K K^T and the solve.  Those are the same
    operations on the same values as prep's own, so every gradient is bitwise the same as with the tables
    recomputed; the forward's output and final state are bitwise unchanged by the extra store."""
    from kernels.backward import autograd
    from kernels.backward.pipeline import SAVED_TABLES
    from kernels.forward.pipeline import chunk_gated_delta_rule as fwd

    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    kept = {}
    o1, ht1 = fwd(*args, **kw, output_final_state=True, _keep_tables=kept)
    o2, ht2 = fwd(*args, **kw, output_final_state=True)
    assert set(kept) == set(SAVED_TABLES) and torch.equal(o1, o2) and torch.equal(ht1, ht2)
    grads = {}
    for save in (False, True):
        monkeypatch.setattr(autograd, "_SAVE_TABLES", save)
        grads[save] = tt.autograd_grads(autograd.chunk_gated_delta_rule, args, kw, do, dht, lambda x: x)
    torch.cuda.synchronize()
    _check_forms(case, grads[True], grads[False])
