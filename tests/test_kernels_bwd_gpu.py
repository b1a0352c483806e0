"""GPU correctness of our TileLang GDN backward (marker ``gpu``), through the autograd Function
``kernels.autograd``, against fp64 autograd through ``reference.chunk``.

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

import dataclasses

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
_STAGE_CASES = [c for c in CASES if c.name in ("T65_h0", "varlen_boundaries_h0_vfirst", "gva4_l2norm",
                                                "D64_h0_vfirst")]


def _plans(case):
    """(forward plan keeping the tables, backward plan) the dispatch chooses for ``case`` on the GPU."""
    from kernels.backward.pipeline import plan_for, prepare_backward
    from kernels.forward.pipeline import plan_for as fplan_for
    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    b = prepare_backward(*args, do, dht, **kw)
    return fplan_for(b.x, True), plan_for(b)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel the cases need in parallel processes first (fills TileLang's disk cache)."""
    import os

    from kernels.build import precompile
    cfgs = []
    for c in CASES + _OUTPUT_CASES + _CLUSTER_CASES:
        if not (c.lens or [c.T]) or not any(c.lens or [c.T]):
            continue
        fp, bp = _plans(c)
        for p in (fp, dataclasses.replace(fp, keep_tables=False)):
            cfgs += p.configs()
        for p in (bp, dataclasses.replace(bp, dh_single=False, reads_saved_tables=False)):
            cfgs += p.configs(True) + p.configs(False) + p.recompute_configs()
        if bp.cluster_group_sum:
            cfgs += dataclasses.replace(bp, cluster_group_sum=False).configs(True)
        for bv, occ in _RECOMPUTE_SHAPES.values():
            cfgs += dataclasses.replace(bp, recompute_block_v=bv, recompute_ctas_per_sm=occ).recompute_configs()
    failed = precompile(list(dict.fromkeys(cfgs)), min(10, os.cpu_count() or 1))
    assert not failed, failed


def _ref(args, kw, do, dht):
    from reference.chunk import chunk_gated_delta_rule as ref
    return tt.autograd_grads(ref, args, kw, do, dht, lambda x: x.double())


def _baseline(args, kw, do, dht):
    from reference.emulated import chunk_gated_delta_rule as emu
    return tt.autograd_grads(emu, args, kw, do, dht, lambda x: x)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradients_against_fp64(case):
    _gradients_against_fp64(case)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gradients_against_fp64(case):
    _gradients_against_fp64(case)


def _gradients_against_fp64(case):
    from kernels.autograd import apply as ours_fn

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


@pytest.mark.parametrize("case", _STAGE_CASES, ids=[c.name for c in _STAGE_CASES])
def test_stages_match_emulation(case):
    """Every intermediate of the kernels vs the torch emulation on the same inputs (printed: max |diff| /
    max |emulation|, to localise a failing stage); the final gradients must agree with the emulation within the
    input dtype's rounding floor (they run the same algorithm with the same roundings) and stay within the FLA-like
    baseline."""
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    sk, se = {}, {}
    gk = kern(*args, do, dht, **kw, stages=sk)
    torch.cuda.synchronize()
    ge = emu(*args, do, dht, **kw, stages=se)
    for name in se:
        a, b = sk[name].double(), se[name].double()
        assert a.shape == b.shape, (name, a.shape, b.shape)     # K = V = 64 too: the kernels at DK 64, unpadded
        print(f"  stage {name:<6} max|kernel - emulation| / max|emulation| = {tt.max_rel_diff(a, b):.2e}")
    want = _ref(args, kw, do, dht)
    base = _baseline(args, kw, do, dht)
    for n, a, b, r, bl in zip(NAMES, gk, ge, want, base):
        d, e, floor = tt.rel_rmse(a, b), tt.rel_rmse(b, r), tt.rel_rmse(r.to(case.dtype), r)
        print(f"  {n}: kernel vs emulation {d:.2e}, emulation vs fp64 {e:.2e}, floor {floor:.2e}")
        assert tt.nonfinite(a) == 0
        assert d <= floor, (n, d, floor)
        assert tt.rel_rmse(a, r) <= tt.rel_rmse(bl, r), (n, tt.rel_rmse(a, r), tt.rel_rmse(bl, r))


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
    """The few-heads reverse pass (``dh_segmented``: the dh kernel over segments, three launches and an fp64 scan),
    forced on (its thresholds set to 1), gives the sequential pass's gradients on the GPU
    (``kernel_support.assert_segmented_matches_sequential``).  The segmented pass runs dh with every operand split,
    so the sequential one it is compared with does too (a plan with ``dh_single`` off)."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    dev = torch.device("cuda")
    xs, do, dht, kw = tt.bwd_inputs(**_SEGMENTED[name])
    xs, do, dht = [x.to(dev) for x in xs], do.to(dev), dht.to(dev)
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    split = dataclasses.replace(plan_for(prepare_backward(*xs, do, dht, **kw)), dh_single=False)
    assert split.dh_segments is None
    seq = kern(*xs, do, dht, **kw, plan=split)
    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    seen = []
    real = dh_segmented.end_gradients
    monkeypatch.setattr(dh_segmented, "end_gradients", lambda *a: seen.append(a[0].cu.numel() - 1) or real(*a))
    seg = kern(*xs, do, dht, **kw)         # the plan cache is keyed by the thresholds: no stale plan is reused
    torch.cuda.synchronize()
    assert seen and seen[0] >= 4, seen                   # the segmented form ran, with several segments
    tt.assert_segmented_matches_sequential(seg, seq, xs[0].dtype, NAMES, label=name)


# the recompute's state kernel shapes (BV, CTAs per SM) a plan may ask for besides the dispatched one
_RECOMPUTE_SHAPES = {"bv16_occ2": (16, 2), "bv32_occ2": (32, 2), "bv64": (64, 1)}


@pytest.mark.parametrize("side", [False, True], ids=["serial", "side_stream"])
@pytest.mark.parametrize("shape", list(_RECOMPUTE_SHAPES))
@pytest.mark.parametrize("case", _STAGE_CASES[:2], ids=[c.name for c in _STAGE_CASES[:2]])
def test_recompute_plans_give_the_same_states(case, shape, side):
    """The forward recompute at other state-kernel shapes, serial or beside dh on the side stream, against the
    dispatched plan run serially: the recomputed S and U within 1e-6 of their largest magnitude, the gradients
    within a hundredth of the input dtype's rounding floor (the value columns per CTA change nothing in a
    column's sums; printed whether bitwise)."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    dev = torch.device("cuda")
    args, kw, do, dht = tt.case_bwd_inputs(case, dev)
    plan = plan_for(prepare_backward(*args, do, dht, **kw))
    bv, occ = _RECOMPUTE_SHAPES[shape]
    si, sp = {}, {}
    gi = kern(*args, do, dht, **kw, stages=si, plan=dataclasses.replace(plan, overlap_recompute=False))
    other = dataclasses.replace(plan, overlap_recompute=side, recompute_block_v=bv, recompute_ctas_per_sm=occ)
    gp = kern(*args, do, dht, **kw, stages=sp, plan=other)
    torch.cuda.synchronize()
    for name in ("S", "U"):
        a, b = sp[name].double(), si[name].double()
        d = tt.max_rel_diff(a, b)
        print(f"  {case.name} {shape} {name}: max|diff| / max = {d:.2e} (bitwise {torch.equal(a, b)})")
        assert d <= 1e-6, (name, d)
    want = _ref(args, kw, do, dht)
    for n, a, b, r in zip(NAMES, gp, gi, want):
        if r is None:
            continue
        d, floor = tt.rel_rmse(a, b), tt.rel_rmse(r.to(case.dtype), r)
        assert tt.nonfinite(a) == 0, n
        assert d <= 0.01 * floor, (n, d, floor)


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
def test_cluster_group_sums_match_the_group_sum_kernel(case):
    """dqk summing each GVA group in a thread-block cluster (the dispatch's choice for groups of 2, 4, 8:
    ``dqk.cluster_group_sum``) against fp32 rows per value head summed by ``gdn_bwd_group_sum`` (a plan with
    ``cluster_group_sum`` off): the same fp32 additions in the same order, so every gradient is bitwise the same."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    assert case.HV // case.H in (2, 4, 8)
    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    plan = plan_for(prepare_backward(*args, do, dht, **kw))
    assert plan.cluster_group_sum
    got = kern(*args, do, dht, **kw, plan=plan)
    ref = kern(*args, do, dht, **kw, plan=dataclasses.replace(plan, cluster_group_sum=False))
    torch.cuda.synchronize()
    _check_forms(case, got, ref)


_SAVED_CASES = [c for c in CASES if c.name in ("T65_h0", "T1000_h0_gva2", "B3_T1000_fp16_vfirst_h0",
                                               "varlen_boundaries_h0_vfirst", "varlen_with_empty_h0", "gva4_l2norm",
                                               "g_zero_beta_extreme", "D64_h0_vfirst")]


@pytest.mark.parametrize("case", _SAVED_CASES, ids=[c.name for c in _SAVED_CASES])
def test_saved_forward_tables_give_the_same_gradients(case):
    """The forward's intra kernel also stores Tinv and the Function hands it, with Ag hi + lo, to the backward,
    whose prep skips K K^T and the solve.  Those are the same operations on the same values as prep's own, so every
    gradient is bitwise the same as with plans that keep no tables; the forward's output and final state are
    bitwise unchanged by the extra store."""
    from kernels import autograd
    from kernels.backward.pipeline import SAVED_TABLES
    from kernels.forward.pipeline import chunk_gated_delta_rule as fwd
    from kernels.plan import ForwardPlan

    args, kw, do, dht = tt.case_bwd_inputs(case, torch.device("cuda"))
    kept = {}
    o1, ht1 = fwd(*args, **kw, output_final_state=True, keep_tables=kept)
    o2, ht2 = fwd(*args, **kw, output_final_state=True)
    assert set(kept) == set(SAVED_TABLES) and torch.equal(o1, o2) and torch.equal(ht1, ht2)

    def no_tables(plan):
        if isinstance(plan, ForwardPlan):
            return dataclasses.replace(plan, keep_tables=False)
        return dataclasses.replace(plan, reads_saved_tables=False)

    saved = tt.autograd_grads(autograd.apply, args, kw, do, dht, lambda x: x)
    recomputed = tt.autograd_grads(autograd.apply, args, kw, do, dht, lambda x: x, alter=no_tables)
    torch.cuda.synchronize()
    _check_forms(case, saved, recomputed)
