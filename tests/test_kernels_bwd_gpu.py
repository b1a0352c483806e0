"""GPU checks of our TileLang GDN backward that the verdict rows (``test_kernels_verdicts_gpu.py``) cannot express
(marker ``gpu``): the kernels' intermediates against the torch emulation of the same kernels, two calls bitwise
equal, the segment-parallel reverse pass against the sequential one, the recompute at other state-kernel shapes, in
the ws form (also forming the S o dS' dots) and per CP segment, dh forming dUloc itself, dqk's gates formed once,
dqk's cluster group sums against the group-sum kernel, the forward's saved tables against none (also with
one-term block merges), and the recompute storing S's hi term alone against its emulation.  Inputs from
``cases.inputs`` (``tests.kernel_support.bwd_args``: do, dht from ``parity.refs.grad_outputs``), fp64 gradients
from ``parity.refs.compute``, metrics from ``parity.metrics``.

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or tilelang is missing.
"""

import dataclasses

import pytest
import torch

from cases.case import Case
from kernels.backward.configs import DH_WS_BLOCKS, DQK_E_ONCE_HEAD_DIM
from kernels.plan import ONE_TERM_FIELDS, WS_HEAD_DIMS
from parity.metrics import compare
from tests import kernel_support as tt

NAMES = tt.GRAD_NAMES
CUDA = torch.device("cuda")


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

# one row each: the chunk edge with h0, the varlen boundaries with the value-first state, GVA 4 with the in-kernel
# L2 norm, GVA 2 with h0, fp16 with fp16 gates
_STAGE_CASES = [Case(T=65, H=4, HV=8, h0_dtype="fp32", grad=True),
                Case(layout="varlen-boundary", T=577, H=2, HV=4, h0_dtype="fp32", state_v_first=True, grad=True),
                Case(T=2048, H=2, HV=8, dist="raw-qk-l2", grad=True),
                Case(B=2, T=500, H=2, HV=4, K=64, V=64, h0_dtype="fp32", state_v_first=True, grad=True)]
_GVA2_H0 = Case(T=1000, H=4, HV=8, h0_dtype="fp32", grad=True)
_FP16_GATES = Case(T=1000, H=4, HV=8, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", h0_dtype="fp32", grad=True)
_OUTPUT_CASES = [Case(layout="varlen-ragged", T=1001, H=2, HV=4, h0_dtype="fp32", grad=True),
                 Case(T=1000, H=4, HV=4, grad=True), Case(B=2, T=333, H=2, HV=2, dtype="fp16", dist="raw-qk-l2",
                                                          grad=True),
                 Case(T=1000, H=1, HV=4, dist="raw-qk-l2", grad=True)]
_CLUSTER_CASES = [_GVA2_H0, _STAGE_CASES[1], _STAGE_CASES[2], _FP16_GATES,
                  Case(T=1000, H=1, HV=8, h0_dtype="fp32", grad=True)]
_SAVED_CASES = [_STAGE_CASES[0], _GVA2_H0,
                Case(B=3, T=1000, H=2, HV=4, dtype="fp16", h0_dtype="fp32", state_v_first=True, grad=True),
                _STAGE_CASES[1], Case(layout="varlen-empty", T=165, H=2, HV=4, h0_dtype="fp32", grad=True),
                _STAGE_CASES[2], Case(T=4096, H=2, HV=4, dist="beta-edges", grad=True),
                Case(B=2, T=500, H=2, HV=4, K=64, V=64, h0_dtype="fp32", state_v_first=True, grad=True)]
_SEGMENTED = [     # slow decay / no decay: the state gradient crosses every segment boundary
    Case(B=2, T=2048, H=2, HV=4, dist="slow-decay", grad=True),
    Case(layout="varlen-empty", T=2265, H=1, HV=2, K=64, V=64, h0_dtype="fp32", state_v_first=True,
         dist="mixed-heads", grad=True),
]
# the recompute's state kernel shapes (BV, CTAs per SM) a plan may ask for besides the dispatched one
_RECOMPUTE_SHAPES = {"bv16_occ2": (16, 2), "bv32_occ2": (32, 2), "bv64": (64, 1)}
# the recompute per CP segment as dispatched: qwen gates (slow heads) with h0, value-first; a ragged batch under
# strong decay; K = 64 with slow decay
_RECOMPUTE_CP_CASES = [Case(T=4096, H=2, HV=4, dist="qwen-gates", h0_dtype="fp32", state_v_first=True, grad=True),
                       Case(layout="varlen-ragged", T=16384, H=1, HV=1, dist="strong-decay", grad=True),
                       Case(T=4096, H=1, HV=2, K=64, V=64, dist="slow-decay", h0_dtype="fp32", grad=True)]


def _plans(case):
    """(forward plan keeping the tables, backward plan) the dispatch chooses for ``case`` on the GPU."""
    from kernels.backward.pipeline import plan_for, prepare_backward
    from kernels.forward.pipeline import plan_for as fplan_for
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    b = prepare_backward(*args, do, dht, **kw)
    return fplan_for(b.x, True), plan_for(b)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel the cases need in parallel processes first (fills TileLang's disk cache)."""
    import os

    from kernels.build import precompile
    cfgs = []
    for c in dict.fromkeys(_STAGE_CASES + _OUTPUT_CASES + _CLUSTER_CASES + _SAVED_CASES + _RECOMPUTE_CP_CASES):
        fp, bp = _plans(c)
        for p in (fp, dataclasses.replace(fp, keep_tables=False)):
            cfgs += p.configs()
        for p in (bp, dataclasses.replace(bp, dh_single=False, reads_saved_tables=False)):
            cfgs += p.configs(True) + p.configs(False) + p.recompute_configs()
            cfgs += [dataclasses.replace(p, dh_ws_bv=bv).dh_config(s) for bv in DH_WS_BLOCKS for s in (True, False)]
        if bp.cluster_group_sum:
            cfgs += dataclasses.replace(bp, cluster_group_sum=False).configs(True)
        for bv, occ in list(_RECOMPUTE_SHAPES.values()) + [(16, 1)]:
            cfgs += dataclasses.replace(bp, recompute_block_v=bv, recompute_ctas_per_sm=occ,
                                        recompute_ws=False).recompute_configs()
        if bp.DK in WS_HEAD_DIMS:
            cfgs += [c for bv in (bp.recompute_block_v, 32) for ws in (True, False) for c in
                     dataclasses.replace(bp, recompute_ws=ws, recompute_block_v=bv).recompute_configs()]
        if bp.DK == DQK_E_ONCE_HEAD_DIM:
            cfgs += [dataclasses.replace(bp, **{off: False}).dqk_config() for off in ("dqk_e_once", "dqk_exp_mask")]
    for c in _ONE_TERM_CASES:
        p = dataclasses.replace(_plans(c)[1], **ONE16)
        cfgs += p.configs(False) + p.recompute_configs()
    failed = precompile(list(dict.fromkeys(cfgs)), min(10, os.cpu_count() or 1))
    assert not failed, failed


def _within_baseline(case, got):
    """Every gradient finite and no farther from fp64 (rel_rmse) than the same-precision baseline's."""
    want, base = tt.fp64_grads(case, CUDA), tt.baseline_grads(case, CUDA)
    for n, a, r, bl in zip(NAMES, got, want, base):
        if r is None:
            continue
        m = compare(a, r)
        assert m.finite, n
        eb = compare(bl, r).rel_rmse
        assert m.rel_rmse <= eb, (n, m.rel_rmse, eb)


@pytest.mark.parametrize("case", _STAGE_CASES, ids=[c.id for c in _STAGE_CASES])
def test_stages_match_emulation(case):
    """Every intermediate of the kernels vs the torch emulation on the same inputs (printed: max |diff| /
    max |emulation|, to localise a failing stage); the final gradients must agree with the emulation within the
    input dtype's rounding floor (they run the same algorithm with the same roundings) and stay within the FLA-like
    baseline."""
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    sk, se = {}, {}
    gk = kern(*args, do, dht, **kw, stages=sk)
    torch.cuda.synchronize()
    ge = emu(*args, do, dht, **kw, stages=se)
    for name in se:
        a, b = sk[name].double(), se[name].double()
        assert a.shape == b.shape, (name, a.shape, b.shape)     # K = V = 64 too: the kernels at DK 64, unpadded
        print(f"  stage {name:<6} max|kernel - emulation| / max|emulation| = {tt.max_rel(a, b):.2e}")
    want = tt.fp64_grads(case, CUDA)
    for n, a, b, r in zip(NAMES, gk, ge, want):
        if r is None:
            continue
        d, e, floor = compare(a, b).rel_rmse, compare(b, r).rel_rmse, compare(r.to(args[0].dtype), r).rel_rmse
        print(f"  {n}: kernel vs emulation {d:.2e}, emulation vs fp64 {e:.2e}, floor {floor:.2e}")
        assert d <= floor, (n, d, floor)
    _within_baseline(case, gk)


@pytest.mark.parametrize("case", _OUTPUT_CASES, ids=[c.id for c in _OUTPUT_CASES])
def test_fused_outputs_are_deterministic_and_within_the_baseline(case):
    """Each output form of the fused kernel: two calls give bitwise the same gradients, every gradient no farther
    from fp64 than the FLA-like baseline's."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    a = kern(*args, do, dht, **kw)
    b = kern(*args, do, dht, **kw)
    torch.cuda.synchronize()
    for n, x, y in zip(NAMES, a, b):
        assert (x is None and y is None) or torch.equal(x, y), n
    _within_baseline(case, a)


def test_bad_input_raises_valueerror():
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    args, kw, do, dht = tt.bwd_args(Case(T=64, H=2, HV=4), CUDA)
    with pytest.raises(ValueError, match="do must be"):
        kern(*args, do[:, :10], dht, **kw)
    with pytest.raises(ValueError, match="dht must be"):
        kern(*args, do, dht[:, :1], **kw)


_WARM_SEGMENTED = _SEGMENTED + [Case(T=4096, H=2, HV=4, dist="strong-decay", grad=True),
                                Case(T=8192, H=1, HV=2, dist="qwen-gates", h0_dtype="fp32", grad=True)]
# the warm forms on every case (also on the forward's saved tables; the warm recompute at K = 128, where the
# recompute is the ws form), the three passes on the slow-decay and no-decay ones
_SEGMENTED_FORMS = [(c, form) for c in _WARM_SEGMENTED for form in ("warm", "warm-saved", "warm-rc", "dh", "dh_ws32")
                    if form in ("warm", "warm-saved") or (c.K == 128 if form == "warm-rc" else c in _SEGMENTED)]


@pytest.mark.parametrize("case,form", _SEGMENTED_FORMS, ids=[f"{c.id}-{f}" for c, f in _SEGMENTED_FORMS])
def test_segmented_reverse_pass_matches_the_sequential_one(monkeypatch, case, form):
    """The few-heads reverse pass, forced on (its thresholds set to 1), gives the sequential pass's gradients on the
    GPU (``kernel_support.assert_segmented_matches_sequential``): as dispatched (``warm``: one launch of
    ``gdn_bwd_dh_warm``, each segment from its warm-up chunks or its sequence's end; ``warm-saved``: the same on the
    forward's saved tables, Tinv's hi term and the chunks' bounds from prep, against the sequential pass on the same
    tables; ``warm-rc``: with the recompute per segment from its warm-up chunks too, ``recompute_warm``), and in
    three passes and an fp64 scan (``dh_segmented``) with either dh kernel (``dh_ws32``: the warp-specialised one at
    32 value columns a CTA).  The segmented pass runs dh with every operand split, so the sequential one it is
    compared with does too (a plan with ``dh_single`` off); it keeps its own pass B and (but ``warm-rc``) the
    sequential plan's recompute (``shared_scan`` off)."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    ws = 32 if form == "dh_ws32" else 0
    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    split = dataclasses.replace(plan_for(prepare_backward(*xs, do, dht, **kw)), dh_single=False, dh_ws_bv=ws)
    assert split.dh_segments is None
    kept = {}
    if form == "warm-saved":
        from kernels.forward.pipeline import chunk_gated_delta_rule as fwd
        fwd(*xs, **kw, keep_tables=kept)
        assert kept and split.takes_saved_tables
    seq = kern(*xs, do, dht, **kw, plan=split, saved_tables=dict(kept) or None)
    rc = dict(recompute_cp=split.recompute_cp, recompute_block_v=split.recompute_block_v, shared_scan=False)
    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    seen = []
    real = dh_segmented.end_gradients
    monkeypatch.setattr(dh_segmented, "end_gradients", lambda *a: seen.append(a[0].cu.numel() - 1) or real(*a))
    # the plan cache is keyed by the thresholds: no stale plan is reused
    if form == "warm-rc":
        rc = dict(shared_scan=False, recompute_warm=True)
    plan = dataclasses.replace(plan_for(prepare_backward(*xs, do, dht, **kw)), dh_ws_bv=ws,
                               dh_warm=form.startswith("warm"), **rc)
    assert plan.dh_segments is not None and plan.dh_segments.cu.numel() - 1 >= 4, plan.dh_segments
    seg = kern(*xs, do, dht, **kw, plan=plan, saved_tables=dict(kept) or None)
    torch.cuda.synchronize()
    assert bool(seen) != plan.segmented_warm, seen       # the end-gradient scan: the three passes' alone
    tt.assert_segmented_matches_sequential(seg, seq, xs[0].dtype, NAMES, label=f"{case.id} {form}")


@pytest.mark.parametrize("case", _WARM_SEGMENTED[1:3], ids=[c.id for c in _WARM_SEGMENTED[1:3]])
def test_prep_bounds_are_the_intra_kernels_row_7(case):
    """``gdn_bwd_prep``'s chunk bounds ``Lb`` (read by the warm segmented reverse pass) are bitwise the forward
    intra kernel's row 7 at its last row (``cp_warm``: the same operations), and the emulation's within fp32
    rounding."""
    from kernels.backward import emulation as E
    from kernels.backward.pipeline import plan_for, prep, prepare_backward
    from kernels.forward.pipeline import intra_chunk
    from kernels.forward.pipeline import plan_for as fplan_for

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    b = prepare_backward(*xs, do, dht, **kw)
    t = prep(b=b, plan=plan_for(b), saved=None)
    f = intra_chunk(x=b.x, plan=fplan_for(b.x, False))
    torch.cuda.synchronize()
    assert t.Lb is not None and torch.equal(t.Lb, f.F[:, :, 7, -1]), (t.Lb - f.F[:, :, 7, -1]).abs().max()
    x = b.x
    want = E.chunk_bounds(x.q.cpu(), x.k.cpu(), x.g.cpu(), x.beta.cpu(), x.cu.cpu().tolist(), x.use_l2)
    assert torch.allclose(t.Lb.cpu(), want, rtol=1e-5, atol=1e-4), (t.Lb.cpu() - want).abs().max()


@pytest.mark.parametrize("dht_form", ["key-first", "value-first view", "none"])
@pytest.mark.parametrize("D", [128, 64])
def test_end_walk_kernel_is_the_segment_scan(monkeypatch, D, dht_form):
    """The segmented pass's end gradients by ``gdn_cp_fixup`` over each sequence's segments in reverse order
    (``dh_segmented.walk_ends``, one launch) against the torch steps of ``end_gradients`` (both fp64, rounded once
    to fp32): within 1e-6 of the largest magnitude, on sequences of 13, 1 and 13 segments, each sequence's last
    transfer matrix NaN (never read)."""
    from kernels.backward import dh_segmented as dh_cp
    from kernels.build import get_kernel
    from kernels.forward.configs import FixupConfig

    monkeypatch.setattr(dh_cp, "MIN_SEQ_CHUNKS", 16)
    cu = [0, 64 * 200, 64 * 200 + 3, 64 * 450]
    p = dh_cp.plan(cu, HV=1, n_value_blocks=1, n_sms=40)
    assert p is not None and sorted(l - f + 1 for f, l in zip(p.first, p.last)) == [1, 13, 13], p
    t = dh_cp.plan_tensors(p, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(7)
    NS, HV = p.n_segments, 4
    P = torch.randn(NS, HV, D, D, generator=g, device=CUDA) / D ** 0.5
    P[list(p.last)] = float("nan")
    a = torch.randn(NS, HV, D, D, generator=g, device=CUDA)
    dht = None if dht_form == "none" else torch.randn(len(cu) - 1, HV, D, D, generator=g, device=CUDA)
    if dht_form == "value-first view":        # the key-first view of a value-first dht, as dh passes it
        dht = dht.transpose(-1, -2)
    want = dh_cp.end_gradients(t, a, P, dht)
    got = dh_cp.end_gradients(t, a, P, dht, get_kernel(FixupConfig(D)))
    torch.cuda.synchronize()
    assert torch.isfinite(got).all() and got.shape == want.shape
    d = tt.max_rel(got, want)
    print(f"  D {D} dht {dht_form}: max|walk - torch| / max|torch| = {d:.2e}")
    assert d <= 1e-6, d


@pytest.mark.parametrize("side", [False, True], ids=["serial", "side_stream"])
@pytest.mark.parametrize("shape", list(_RECOMPUTE_SHAPES))
@pytest.mark.parametrize("case", _STAGE_CASES[:2], ids=[c.id for c in _STAGE_CASES[:2]])
def test_recompute_plans_give_the_same_states(case, shape, side):
    """The forward recompute at other state-kernel shapes, serial or beside dh on the side stream, against the
    dispatched plan run serially: the recomputed S and U within 1e-6 of their largest magnitude, the gradients
    within a hundredth of the input dtype's rounding floor (the value columns per CTA change nothing in a
    column's sums; printed whether bitwise)."""
    from kernels.backward.pipeline import plan_for, prepare_backward

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = plan_for(prepare_backward(*args, do, dht, **kw))
    bv, occ = _RECOMPUTE_SHAPES[shape]
    other = dataclasses.replace(plan, overlap_recompute=side, recompute_block_v=bv, recompute_ctas_per_sm=occ,
                                recompute_ws=False)
    _same_recomputed_states(case, other, dataclasses.replace(plan, overlap_recompute=False), 1e-6, shape)


@pytest.mark.parametrize("case", _SEGMENTED, ids=[c.id for c in _SEGMENTED])
def test_shared_scan_gives_pass_bs_transfer_maps(monkeypatch, case):
    """``BackwardPlan.shared_scan`` with the segmented reverse pass in three passes (forced on here): the forward CP
    scan's maps over dh's segments against dh's own pass B -- within 1e-4 of their largest magnitude on every
    segment the end-gradient scan reads (printed), pass A's start gradients bitwise -- and every gradient no
    farther from fp64 than the plan without it plus a tenth of the input dtype's rounding floor, and within the
    FLA-like baseline."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import plan_for, prepare_backward

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    seen = []
    real = dh_segmented.end_gradients
    monkeypatch.setattr(dh_segmented, "end_gradients", lambda *a: seen.append(a) or real(*a))
    # the three passes, whose pass B the shared scan replaces (dispatched at K = 64, with the warm dh)
    plan = dataclasses.replace(plan_for(prepare_backward(*xs, do, dht, **kw)), dh_warm=False, recompute_warm=False,
                               shared_scan=True)
    got = _same_recomputed_states(case, plan, dataclasses.replace(plan, shared_scan=False), 2 ** -8, "shared scan",
                                  True)
    (t, a1, P1, _, _), (_, a2, P2, _, _) = seen
    need = [j for f, l in zip(t.first.tolist(), t.last.tolist()) for j in range(f + 1, l)]
    d = tt.max_rel(P1[need].double(), P2[need].double())
    print(f"  {case.id}: {len(need)} transfer maps, max|scan - pass B| / max = {d:.2e}")
    assert torch.equal(a1, a2) and d <= 1e-4, d
    _within_baseline(case, got)


@pytest.mark.parametrize("case", _WARM_SEGMENTED[2:], ids=[c.id for c in _WARM_SEGMENTED[2:]])
def test_warm_recompute_gives_the_sequential_states(monkeypatch, case):
    """``BackwardPlan.recompute_warm`` (the recompute per dh segment from its warm-up chunks, with the warm dh;
    segmented pass forced on): S and U within 2^-8 of their largest magnitude of one sequential recompute's (they
    differ by what the warm-ups drop, at most 2^-40 of the state, and the roundings after it), every gradient no
    farther from fp64 than that plan's plus a tenth of the input dtype's rounding floor, and within the FLA-like
    baseline."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import plan_for, prepare_backward

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    plan = dataclasses.replace(plan_for(prepare_backward(*xs, do, dht, **kw)), dh_warm=True, shared_scan=False)
    assert plan.dh_segments is not None and plan.recompute_ws
    got = _same_recomputed_states(case, dataclasses.replace(plan, recompute_warm=True),
                                  dataclasses.replace(plan, recompute_warm=False, recompute_cp=1), 2 ** -8,
                                  "warm recompute", True)
    _within_baseline(case, got)


def _same_recomputed_states(case, plan, ref, s_tol, label, to_fp64=False):
    """The backward of ``case`` under ``plan`` against ``ref``: the recomputed S and U within ``s_tol`` of their
    largest magnitude (printed, with whether bitwise), every gradient finite and within a hundredth of the input
    dtype's rounding floor of ``ref``'s (rel_rmse; printed with both plans' rel_rmse against fp64); with
    ``to_fp64`` instead no farther from fp64 than ``ref``'s plus a tenth of that floor.  Returns ``plan``'s
    gradients."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    sp, sr = {}, {}
    gp = kern(*args, do, dht, **kw, stages=sp, plan=plan)
    gr = kern(*args, do, dht, **kw, stages=sr, plan=ref)
    torch.cuda.synchronize()
    for name in ("S", "U"):
        a, b = sp[name].double(), sr[name].double()
        d = tt.max_rel(a, b)
        print(f"  {case.id} {label} {name}: max|diff| / max = {d:.2e} (bitwise {torch.equal(a, b)})")
        assert d <= s_tol, (name, d)
    want = tt.fp64_grads(case, CUDA)
    for n, a, b, r in zip(NAMES, gp, gr, want):
        if r is None:
            continue
        m, floor = compare(a, b), compare(r.to(args[0].dtype), r).rel_rmse
        ea, eb = compare(a, r).rel_rmse, compare(b, r).rel_rmse
        print(f"  {n}: {label} vs the reference plan {m.rel_rmse:.2e}, floor {floor:.2e}; against fp64 "
              f"{ea:.2e} / {eb:.2e}")
        assert m.finite, n
        if to_fp64:
            assert ea <= eb + 0.1 * floor, (n, ea, eb, floor)
        else:
            assert m.rel_rmse <= 0.01 * floor, (n, m.rel_rmse, floor)
    return gp


# the recompute in the ws form: as dispatched (one pass; per CP segment at few heads), and beside dh on the side stream
_RECOMPUTE_WS_CASES = ([(c, False, None) for c in _STAGE_CASES[:3] + _RECOMPUTE_CP_CASES[:2]]
                       + [(_GVA2_H0, False, 32), (_GVA2_H0, True, None)])


@pytest.mark.parametrize("case,side,bv", _RECOMPUTE_WS_CASES,
                         ids=[c.id + ("-side" if s else "") + (f"-bv{b}" if b else "")
                              for c, s, b in _RECOMPUTE_WS_CASES])
def test_recompute_ws_gives_the_smem_kernels_tables(case, side, bv):
    """The recompute's state kernel in the ws form storing the tables (``BackwardPlan.recompute_ws``, dispatched at
    K = 128) against the smem form of the same plan: the same products and roundings on the same operands in the
    same order, so the recomputed S (hi and its fp8 lo codes) and U are bitwise the same, and so is every
    gradient."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = dataclasses.replace(plan_for(prepare_backward(*args, do, dht, **kw)), overlap_recompute=side)
    if bv:
        plan = dataclasses.replace(plan, recompute_block_v=bv)
    sp, sr = {}, {}
    got = kern(*args, do, dht, **kw, stages=sp, plan=dataclasses.replace(plan, recompute_ws=True))
    ref = kern(*args, do, dht, **kw, stages=sr, plan=dataclasses.replace(plan, recompute_ws=False))
    torch.cuda.synchronize()
    print(f"  {case.id}: recompute BV {plan.recompute_block_v}, segments {plan.recompute_cp}, side stream {side}")
    for name in ("S", "U"):
        assert torch.equal(sp[name], sr[name]), (name, tt.max_rel(sp[name], sr[name]))
    _check_forms(case, got, ref)


_E_ONCE_CASES = _CLUSTER_CASES + [_STAGE_CASES[0]]


@pytest.mark.parametrize("off", ["dqk_e_once", "dqk_exp_mask"])
@pytest.mark.parametrize("case", _E_ONCE_CASES, ids=[c.id for c in _E_ONCE_CASES])
def test_dqk_gates_once_and_masked_widening_change_no_gradient(case, off):
    """The dispatched dqk, forming the intra terms' ``e^(G_t - G_j)`` once a chunk (``BackwardPlan.dqk_e_once``) and
    widening its fp8 lo tiles with a masked power of two (``dqk_exp_mask``), against the plan with one of the two
    off (the gates formed at each of their four uses; the powers of two by a shift): the same values in the same
    products, so every gradient bitwise the same (GVA 1, 2, 4, 8, varlen, fp16)."""
    _pipeline_bitwise_with(case, {off: False})


def _pipeline_bitwise_with(case, change: dict, base: dict | None = None):
    """The backward pipeline alone (prep's tables) on ``case``: every gradient with the dispatched plan changed by
    ``base`` and ``change`` bitwise that of the plan changed by ``base`` alone (``_check_forms``)."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = dataclasses.replace(plan_for(prepare_backward(*args, do, dht, **kw)), **(base or {}))
    got = kern(*args, do, dht, **kw, plan=dataclasses.replace(plan, **change))
    ref = kern(*args, do, dht, **kw, plan=plan)
    torch.cuda.synchronize()
    _check_forms(case, got, ref)


@pytest.mark.parametrize("case", _RECOMPUTE_CP_CASES, ids=[c.id for c in _RECOMPUTE_CP_CASES])
def test_recompute_per_segment_gives_the_sequential_states(case):
    """The dispatched recompute per CP segment (``recompute_cp``: the forward's exact scan and fp64 fix-up, then
    the state kernel per segment) against one sequential pass at BV 16: the recomputed S and U within 2^-8 of
    their largest magnitude (printed, with whether bitwise: the bound was set when the recompute's K S products
    took S's hi term alone, as ``ks_single`` still does, so that either pass's states carried up to about bf16's
    2^-9 relative error, which the exact segment starts reset, and the gradients of the two differed by about a
    rounding floor: 2.1e-3 in dq at K 64 under slow decay, H200; precision "recompute" now splits S there), every
    gradient no farther from fp64 than the sequential plan's plus a tenth of the input dtype's rounding floor, and
    within the FLA-like baseline."""
    from kernels.backward.pipeline import plan_for, prepare_backward

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = plan_for(prepare_backward(*args, do, dht, **kw))
    assert plan.recompute_cp > 1, plan
    one = dataclasses.replace(plan, recompute_cp=1, recompute_block_v=16, recompute_ctas_per_sm=1)
    _within_baseline(case, _same_recomputed_states(case, plan, one, 2 ** -8, f"cp {plan.recompute_cp}", True))


def _check_forms(case, got, ref, close=()):
    """Every gradient finite, of the same shape and dtype, and bitwise the same, except those named in ``close``:
    within 1e-5 of the largest magnitude (printed)."""
    for n, a, b in zip(NAMES, got, ref):
        if b is None:
            assert a is None, n
            continue
        assert torch.isfinite(a).all(), n
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape)
        if n in close:
            d = tt.max_rel(a, b)
            print(f"  {case.id} {n}: max|on - off| / max|off| = {d:.2e}")
            assert d <= 1e-5, (n, d)
        else:
            assert torch.equal(a, b), (n, case.id, tt.max_rel(a, b))


@pytest.mark.parametrize("case", _CLUSTER_CASES, ids=[c.id for c in _CLUSTER_CASES])
def test_cluster_group_sums_match_the_group_sum_kernel(case):
    """dqk summing each GVA group in a thread-block cluster (the dispatch's choice for groups of 2, 4, 8:
    ``dqk.cluster_group_sum``) against fp32 rows per value head summed by ``gdn_bwd_group_sum`` (a plan with
    ``cluster_group_sum`` off): the same fp32 additions in the same order, so every gradient is bitwise the same."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    assert case.HV // case.H in (2, 4, 8)
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = plan_for(prepare_backward(*args, do, dht, **kw))
    assert plan.cluster_group_sum
    got = kern(*args, do, dht, **kw, plan=plan)
    ref = kern(*args, do, dht, **kw, plan=dataclasses.replace(plan, cluster_group_sum=False))
    torch.cuda.synchronize()
    _check_forms(case, got, ref)


@pytest.mark.parametrize("case", _SAVED_CASES, ids=[c.id for c in _SAVED_CASES])
def test_saved_forward_tables_give_the_same_gradients(case):
    """The forward's intra kernel also stores Tinv and the Function hands it, with Ag hi + lo, to the backward,
    whose prep skips K K^T and the solve.  Those are the same operations on the same values as prep's own, so with
    a dh that reads no Tinv lo term (the single form; these cases take the sequential pass) every
    gradient is bitwise the same as with plans that keep no tables; the forward's output and final state are
    bitwise unchanged by the extra store.  The dispatched plan (dh split, Tinv's hi term alone on the saved tables)
    is within the input dtype's rounding floor of the emulation's ``tinv_hi_only`` and within the baseline."""
    from kernels import autograd
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import SAVED_TABLES, reads_saved_tables
    from kernels.forward.pipeline import chunk_gated_delta_rule as fwd
    from kernels.plan import BackwardPlan, ForwardPlan

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    kept = {}
    o1, ht1 = fwd(*args, **kw, output_final_state=True, keep_tables=kept)
    o2, ht2 = fwd(*args, **kw, output_final_state=True)
    assert set(kept) == set(SAVED_TABLES) and torch.equal(o1, o2) and torch.equal(ht1, ht2)

    def no_tables(plan):
        if isinstance(plan, ForwardPlan):
            return dataclasses.replace(plan, keep_tables=False)
        return dataclasses.replace(plan, reads_saved_tables=False)

    def single(plan):
        if isinstance(plan, BackwardPlan) and plan.dh_segments is None:
            return dataclasses.replace(plan, dh_single=True, lo8=False)
        return plan

    saved = tt.function_grads(autograd.apply, case, CUDA, alter=single)
    recomputed = tt.function_grads(autograd.apply, case, CUDA, alter=lambda p: single(no_tables(p)))
    torch.cuda.synchronize()
    _check_forms(case, saved, recomputed)
    got = tt.function_grads(autograd.apply, case, CUDA)
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    hi_only = reads_saved_tables(args[0])
    ge = emu(*args, do, dht, **kw, tinv_hi_only=hi_only)
    _within_floor_of_emulation(case, got, ge, f"dispatched vs emulation (Tinv hi alone: {hi_only})")
    _within_baseline(case, got)


@pytest.mark.parametrize("bv", DH_WS_BLOCKS)
@pytest.mark.parametrize("case", _SAVED_CASES, ids=[c.id for c in _SAVED_CASES])
def test_warp_specialised_dh_gives_the_register_kernels_gradients(case, bv):
    """dh's warp-specialised key-first kernel (``dh_ws``, ``bv`` value columns a CTA; dispatched at 32 where its CTAs
    fit one wave) in the dispatched plan otherwise, through the autograd Function: two calls give bitwise the same
    gradients (its warpgroups' hand-offs leave no race), every gradient is within the input dtype's rounding floor
    of the register kernel's and of the emulation's (the same products and roundings, summed in other wgmma shapes)
    and within the baseline."""
    from kernels import autograd
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import reads_saved_tables
    from kernels.plan import BackwardPlan

    def ws(plan):
        return dataclasses.replace(plan, dh_ws_bv=bv) if isinstance(plan, BackwardPlan) else plan

    def register_kernel(plan):
        return dataclasses.replace(plan, dh_ws_bv=0) if isinstance(plan, BackwardPlan) else plan

    got = tt.function_grads(autograd.apply, case, CUDA, alter=ws)
    again = tt.function_grads(autograd.apply, case, CUDA, alter=ws)
    register = tt.function_grads(autograd.apply, case, CUDA, alter=register_kernel)
    torch.cuda.synchronize()
    for n, x, y in zip(NAMES, got, again):
        assert (x is None and y is None) or torch.equal(x, y), n
    _within_floor_of_emulation(case, got, register, f"dh_ws{bv} vs the register dh")
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    hi_only = reads_saved_tables(args[0])
    ge = emu(*args, do, dht, **kw, tinv_hi_only=hi_only)
    _within_floor_of_emulation(case, got, ge, f"dh_ws{bv} vs emulation (Tinv hi alone: {hi_only})")
    _within_baseline(case, got)


def _within_floor_of_emulation(case, got, emulated, label):
    """Every gradient within the input dtype's rounding floor (rel_rmse of fp64 rounded, against fp64) of the
    emulation's (printed with ``label``)."""
    want = tt.fp64_grads(case, CUDA)
    dt = got[0].dtype
    for n, a, b, r in zip(NAMES, got, emulated, want):
        if r is None:
            continue
        d, floor = compare(a, b).rel_rmse, compare(r.to(dt), r).rel_rmse
        print(f"  {case.id} {n}: {label} {d:.2e}, floor {floor:.2e}")
        assert d <= floor, (n, d, floor)


# calls without an initial state (``BackwardPlan.s_single`` is no plan for others:
# tests/test_kernels_bwd_emulation.py), GVA 2 and 4, dense and varlen, qwen and slow gates, fp16
_S_SINGLE_CASES = [Case(T=1000, H=2, HV=4, dist="qwen-gates", grad=True),
                   Case(layout="varlen-ragged", T=1001, H=2, HV=8, dist="slow-decay", grad=True),
                   Case(B=2, T=333, H=2, HV=4, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", grad=True)]


def _backward_alternative_is_the_emulations(case, change: dict, emulated: dict, label: str):
    """The autograd Function with the dispatched BackwardPlan changed by ``change``: every gradient within the input
    dtype's rounding floor of the emulation called with ``emulated`` (printed with ``label``), and within the FLA-like
    baseline."""
    from kernels import autograd
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import reads_saved_tables
    from kernels.plan import BackwardPlan

    def alter(plan):
        return dataclasses.replace(plan, **change) if isinstance(plan, BackwardPlan) else plan

    got = tt.function_grads(autograd.apply, case, CUDA, alter=alter)
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    hi_only = reads_saved_tables(args[0])
    ge = emu(*args, do, dht, **kw, tinv_hi_only=hi_only, **emulated)
    _within_floor_of_emulation(case, got, ge, label)
    _within_baseline(case, got)


@pytest.mark.parametrize("case", _S_SINGLE_CASES, ids=[c.id for c in _S_SINGLE_CASES])
def test_recomputed_state_hi_alone_is_the_emulations(case):
    """``BackwardPlan.s_single`` (the recompute stores S's hi term alone, dqk reads no S lo table): every gradient
    within the input dtype's rounding floor of the emulation's ``s_single`` and within the FLA-like baseline."""
    _backward_alternative_is_the_emulations(case, dict(s_single=True, lo8=False), dict(s_single=True, lo8_tables=False),
                                            "S hi alone vs emulation")


# bf16 inputs (tests/test_kernels_bwd_emulation.py: one fp16 term is no plan for fp16 inputs): GVA 2 and 4
# (clusters), qwen and slow gates, varlen; GVA 4 under strong decay at 32 chunks; strong decay with h0 (dh0 needs
# the chunk exponents)
_ONE_TERM_CASES = [_S_SINGLE_CASES[0], _S_SINGLE_CASES[1], Case(T=2048, H=2, HV=8, dist="strong-decay", grad=True),
                   Case(T=1024, H=2, HV=4, dist="strong-decay", h0_dtype="fp32", grad=True)]
# BackwardPlan.one_term on the fp16 kernels (bench_kernels_bwd's ``ours-one16``: the sequential dh_ws)
ONE16 = dict(ONE_TERM_FIELDS, fused=False)
# the fused one-term plan with dq~, dk~ in fp32 (its GVA sums by gdn_bwd_group_sum; dispatched: fused_dq16 too)
FUSED16 = dict(ONE16, fused=True, fused_dq16=False, cluster_group_sum=False)


@pytest.mark.parametrize("case", _ONE_TERM_CASES, ids=[c.id for c in _ONE_TERM_CASES])
def test_one_term_fp16_tables_are_the_emulations(case):
    """``BackwardPlan.one_term`` through the fp16 kernels for bf16 inputs (v, dO under powers of two per GVA group,
    q, k, v, dO converted by ``gdn_bwd_convert``; dh_ws and dqk with every table and operand one fp16 term, dh's
    F1 dO and F0 dX under a power of two per chunk; dv, dq, dk stored in bf16): every gradient within the input
    dtype's rounding floor of the emulation's (``ONE_TERM_FP16``) and within the FLA-like baseline."""
    from kernels.backward.emulation import ONE_TERM_FP16
    _backward_alternative_is_the_emulations(case, ONE16, ONE_TERM_FP16, "one fp16 term vs emulation")


# and a ragged batch with empty sequences (their CTAs run no chunk), h0 and mixed decay
_FUSED_CASES = _ONE_TERM_CASES + [Case(layout="varlen-empty", T=2265, H=1, HV=2, h0_dtype="fp32", dist="mixed-heads",
                                       grad=True)]


@pytest.mark.parametrize("case", _FUSED_CASES, ids=[c.id for c in _FUSED_CASES])
def test_fused_one_term_is_the_emulations(case):
    """``BackwardPlan.fused``: the one-term fp16 backward with dh and dqk in one kernel, dUloc from one fp16 term of
    P: every gradient within the input dtype's rounding floor of the emulation's (``ONE_TERM_FP16`` with
    ``p_single``) and within the FLA-like baseline."""
    from kernels.backward.emulation import ONE_TERM_FP16
    _backward_alternative_is_the_emulations(case, dict(FUSED16), dict(ONE_TERM_FP16, p_single=True),
                                            "fused one fp16 term vs emulation")


@pytest.mark.parametrize("case", _FUSED_CASES[1:], ids=[c.id for c in _FUSED_CASES[1:]])
def test_recompute_one_is_the_emulations(case):
    """``recompute_one`` (dispatched with the fused plan) on small layouts (its state kernel at 16 value columns in
    one pass, at 64 per CP segment): K S, X and F2 U one term, every gradient within the input dtype's rounding floor
    of the emulation's ``FUSED_FP16`` and within the FLA-like baseline."""
    from kernels.backward.emulation import FUSED_FP16
    _backward_alternative_is_the_emulations(case, dict(FUSED16, fused_dq16=True, recompute_one=True), FUSED_FP16,
                                            "recompute one vs emulation")


# the fused plan's GVA groups of one value head: its group sums run only with fused_dq16
_DQ16_CASES = _FUSED_CASES + [Case(T=1024, H=2, HV=2, dist="qwen-gates", h0_dtype="fp32", grad=True)]


@pytest.mark.parametrize("case", _DQ16_CASES, ids=[c.id for c in _DQ16_CASES])
def test_fused_dq16_is_the_emulations(case):
    """``fused_dq16``: the fused kernel stores dq~, dk~ in fp16 under the GVA group scales and the group sums'
    scaled form applies the factors: every gradient within the input dtype's rounding floor of the emulation's
    (``FUSED_FP16`` with the recompute's products split, as ``FUSED16`` runs it) and within the FLA-like baseline."""
    from kernels.backward.emulation import FUSED_FP16
    _backward_alternative_is_the_emulations(case, dict(FUSED16, fused_dq16=True), dict(FUSED_FP16, recompute_one=()),
                                            "fused dq16 vs emulation")


@pytest.mark.parametrize("case", _DQ16_CASES[-2:], ids=[c.id for c in _DQ16_CASES[-2:]])
def test_fused_dq16_changes_dq_and_dk_alone(case):
    """``fused_dq16`` leaves dv, dg, dbeta and dh0 bitwise those of the fp32 dq~, dk~ (the kernel's other outputs
    and the finish are the same operations)."""
    from kernels import autograd
    from kernels.plan import BackwardPlan

    def form(change):
        return lambda plan: dataclasses.replace(plan, **change) if isinstance(plan, BackwardPlan) else plan
    a = tt.function_grads(autograd.apply, case, CUDA, alter=form(FUSED16))
    b = tt.function_grads(autograd.apply, case, CUDA, alter=form(dict(FUSED16, fused_dq16=True)))
    for n, x, y in zip(tt.GRAD_NAMES, a, b):
        if n in ("dq", "dk"):
            assert x.shape == y.shape and x.dtype == y.dtype, n
        elif x is not None:
            assert torch.equal(x, y), f"{n}: fused_dq16 changed it ({case.id})"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_longest_first_changes_no_gradient(fused):
    """``longest_first`` changes only the order in which the fused kernel (``fused``) and the recompute's ws tables
    form (in one pass at 64 value columns, forced) issue their CTAs: on a ragged batch with empty sequences and h0
    (whose order is not the index order) every gradient, dh0 included, is bitwise that of the index order."""
    from kernels import autograd
    from kernels.backward import pipeline as bp
    from kernels.plan import BackwardPlan

    case = Case(layout="varlen-empty", T=2265, H=1, HV=2, h0_dtype="fp32", dist="mixed-heads", grad=True)
    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    order = bp.prepare_backward(*xs, do, dht, **kw).x.seq_order.tolist()
    assert order != sorted(order), order

    def form(first):            # one sequential pass of dh and of the recompute
        one = dict(recompute_cp=1, recompute_block_v=64, recompute_ws=True, dh_segments=None, dh_warm=False,
                   recompute_warm=False, shared_scan=False, longest_first=first)
        change = dict(FUSED16, fused_dq16=True, recompute_one=True, **one) if fused else one
        return lambda plan: dataclasses.replace(plan, **change) if isinstance(plan, BackwardPlan) else plan
    a = tt.function_grads(autograd.apply, case, CUDA, alter=form(False))
    b = tt.function_grads(autograd.apply, case, CUDA, alter=form(True))
    for n, x, y in zip(tt.GRAD_NAMES, a, b):
        assert (x is None) == (y is None), n
        assert x is None or torch.equal(x, y), f"{n}: longest_first changed it ({case.id}, fused={fused})"


def test_one_term_hi_alone_tables_are_the_split_forms(monkeypatch):
    """The one-term plans' prep stores Tinv's hi term alone and their recompute U's (no lo tables): every table they
    store is bitwise that of the same kernels storing Tinv and U hi + lo."""
    from kernels.backward import pipeline as bp
    from kernels.plan import BackwardPlan

    case = Case(layout="varlen-ragged", T=1001, H=2, HV=8, dist="slow-decay", h0_dtype="fp32", grad=True)
    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    b = bp.prepare_backward(*xs, do, dht, **kw)
    plan = dataclasses.replace(bp.plan_for(b), **FUSED16)
    b, _ = bp._scaled(b, plan)
    prep_cfg = plan.prep_config(False)
    intra, state, *rest = plan.recompute_configs()
    assert prep_cfg.tinv_hi and state.prec.u == "bf16", (prep_cfg.name, state.name)
    t1 = bp.prep(b=b, plan=plan, saved=None)
    one = bp.recompute(x=b.x, plan=plan, tables=t1, side=None)
    split = (intra, dataclasses.replace(state, prec=dataclasses.replace(state.prec, u="split")), *rest)
    monkeypatch.setattr(BackwardPlan, "recompute_configs", lambda self: split)
    monkeypatch.setattr(BackwardPlan, "prep_config", lambda self, saved: dataclasses.replace(prep_cfg, tinv_hi=False))
    t2 = bp.prep(b=b, plan=plan, saved=None)
    two = bp.recompute(x=b.x, plan=plan, tables=t2, side=None)
    torch.cuda.synchronize()
    assert t1.Tl is t1.Th and t2.Tl is not t2.Th and one.Ul is one.Uh and two.Ul is not two.Uh
    pairs = [(f"prep {n}", getattr(t1, n), getattr(t2, n)) for n in ("Th", "Agh", "Agl", "Fb", "Lb")]
    pairs += [(f"recompute {n}", getattr(one, n), getattr(two, n)) for n in ("Sch", "Uh")]
    for name, a, r in pairs:
        assert torch.equal(a, r), (name, case.id, tt.max_rel(a, r))


# prep's converting form (``prep_converts``, dispatched with the fused plan): the in-kernel L2 norm on GVA 2 with h0 and
# dht, a ragged batch with empty sequences (chunks whose sequence ends inside them; CTAs of no chunk), GVA 8 under
# strong decay
_PREP_CONVERT_CASES = [Case(B=2, T=700, H=2, HV=4, dist="raw-qk-l2", h0_dtype="fp32", grad=True),
                       _FUSED_CASES[-1],
                       Case(layout="varlen-ragged", T=1001, H=1, HV=8, dist="strong-decay", grad=True)]


@pytest.mark.parametrize("case", _PREP_CONVERT_CASES, ids=[c.id for c in _PREP_CONVERT_CASES])
def test_converting_prep_is_convert_then_prep(case):
    """``BackwardPlan.prep_converts``: prep's converting form (``gdn_bwd_amax`` then prep on the caller's bf16 inputs)
    gives bitwise the q, k, v, dO copies, the scaled h0 and dht and the factors of ``gdn_bwd_convert``, and bitwise
    the tables of prep on its copies in every chunk whose q and k copies are exact; where one is not (an element
    outside fp16's normal range), tables within fp32 rounding of them (computed from the exact bf16 values)."""
    from kernels.backward import pipeline as bp

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    b = bp.prepare_backward(*xs, do, dht, **kw)
    plan = dataclasses.replace(bp.plan_for(b), **dict(FUSED16, fused_dq16=True, prep_converts=True))
    assert plan.converts_in_prep and plan.convert_config() is None and plan.prep_config(False).io == "bfloat16"
    b1, f1, t1 = bp.scaled_prep(b=b, plan=plan, saved=None)
    b2, f2, t2 = bp.scaled_prep(b=b, plan=dataclasses.replace(plan, prep_converts=False), saved=None)
    torch.cuda.synchronize()
    pairs = [(n, getattr(b1.x, n), getattr(b2.x, n)) for n in ("q", "k", "v", "h0")]
    pairs += [("do", b1.do, b2.do), ("dht", b1.dht, b2.dht), ("factors", f1, f2)]
    for name, a, r in pairs:
        assert (a is None) == (r is None), (name, case.id)
        assert a is None or torch.equal(a, r), (name, case.id, tt.max_rel(a.float(), r.float()))
    # the chunks (value head, chunk) whose q or k rows have an inexact fp16 copy
    x = b.x
    inexact = ((b1.x.q.float() != x.q.float()) | (b1.x.k.float() != x.k.float())).any(-1).cpu()     # [Ttot, H]
    cu, ci = x.cu.cpu().tolist(), x.chunk_indices.cpu().tolist()
    bad = torch.zeros(x.HV, x.NC, dtype=torch.bool)
    for c, (n, j) in enumerate(ci):
        t0 = cu[n] + 64 * j
        bad[:, c] = inexact[t0:min(t0 + 64, cu[n + 1])].any(0).repeat_interleave(x.HV // x.H)
    good = ~bad
    for n in ("Th", "Agh", "Agl", "Fb", "Lb"):
        a, r = getattr(t1, n).cpu(), getattr(t2, n).cpu()
        assert torch.equal(a[good], r[good]), (f"prep {n}", case.id, int(bad.sum()), tt.max_rel(a.float(), r.float()))
    ag1, ag2 = (t.Agh.float() + t.Agl.float() for t in (t1, t2))
    for name, a, r in (("Tinv", t1.Th, t2.Th), ("Ag", ag1, ag2), ("Fb", t1.Fb, t2.Fb)):
        assert tt.max_rel(a.float(), r.float()) <= 2 ** -10, (name, case.id, tt.max_rel(a.float(), r.float()))


# FUSED_MIN_CTAS (value head, sequence) pairs: the layout from which the fused plan is dispatched
_DISPATCHED_FUSED = Case(B=4, T=320, H=16, HV=32, grad=True)


def test_dispatched_fused_plan_is_the_emulations():
    """Where ``kernels.plan.dispatches_fused``: the backward's dispatched plan is the fused one, the forward keeps no
    tables, and the autograd Function's gradients are within the input dtype's rounding floor of the emulation's
    ``FUSED_FP16`` form and within the FLA-like baseline."""
    from kernels.backward.emulation import FUSED_FP16
    from kernels.backward.pipeline import plan_for, prepare_backward, reads_saved_tables
    from kernels.plan import FUSED_MIN_CTAS

    case = _DISPATCHED_FUSED
    assert case.B * case.HV == FUSED_MIN_CTAS
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    assert plan_for(prepare_backward(*args, do, dht, **kw)).fused
    assert not reads_saved_tables(args[0], args[2], kw.get("cu_seqlens"))
    _backward_alternative_is_the_emulations(case, {}, FUSED_FP16, "dispatched fused vs emulation")


# the warm segmented cases the fused kernel takes (K = 128): slow decay (every segment runs on to its sequence's
# end), strong decay (from warm-up chunks), qwen gates with h0 (both; dh0 from each sequence's first segment)
_FUSED_SEGMENTED = [c for c in _WARM_SEGMENTED if c.K == 128]


# (case, form, fused_dq16): every segmented case in both forms, and the last (h0) with dq~, dk~ in fp16
_FUSED_SEGMENTED_FORMS = ([(c, form, False) for c in _FUSED_SEGMENTED for form in ("warm", "exact")]
                          + [(_FUSED_SEGMENTED[-1], form, True) for form in ("warm", "exact")])


@pytest.mark.parametrize("case,form,dq16", _FUSED_SEGMENTED_FORMS,
                         ids=[f"{c.id}-{f}" + ("-dq16" if q else "") for c, f, q in _FUSED_SEGMENTED_FORMS])
def test_fused_segments_match_its_one_pass(monkeypatch, case, form, dq16):
    """``BackwardPlan.fused`` over CP segments (forced on: the thresholds set to 1) gives the gradients of its one
    pass per sequence on the GPU (``kernel_support.assert_segmented_matches_sequential``): each segment from its
    warm-up chunks (``fused_warm``: ``gdn_bwd_fused_warm``) or from its exact end gradient (``fused_exact``: the
    chain form, the forward CP scan's maps and the fp64 walk; within the input dtype's rounding floor of it); with
    ``fused_dq16`` (both plans) the same."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward, with_fused_segments

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    b = prepare_backward(*xs, do, dht, **kw)
    fused16 = dict(FUSED16, fused_dq16=dq16)
    one_pass = dataclasses.replace(plan_for(b), **fused16)
    seq = kern(*xs, do, dht, **kw, plan=one_pass)
    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    # the plan cache is keyed by the thresholds: no stale plan is reused
    plan = with_fused_segments(dataclasses.replace(plan_for(b), **fused16, **{f"fused_{form}": True}), b)
    assert plan.fused_segments is not None and plan.fused_segments.cu.numel() - 1 >= 4, plan.fused_segments
    assert plan.fused_config().warm == (form == "warm"), plan.fused_config()
    seg = kern(*xs, do, dht, **kw, plan=plan)
    torch.cuda.synchronize()
    if form == "warm":
        tt.assert_segmented_matches_sequential(seg, seq, xs[0].dtype, NAMES, label=f"{case.id} fused {form}")
        return
    # the exact end gradients are the true ones, which the one pass's chain of one fp16 term (dS' = rd(dS) a chunk)
    # does not reproduce: within one rounding of the input dtype (its floor against fp64) of the one pass, and
    # within the FLA-like baseline
    for n, a, one, r in zip(NAMES, seg, seq, tt.fp64_grads(case, CUDA)):
        if one is None:
            assert a is None, n
            continue
        err, floor = compare(a, one).rel_rmse, compare(r.to(xs[0].dtype), r).rel_rmse
        print(f"  {case.id} fused exact {n}: segmented vs sequential {err:.2e} (floor {floor:.2e})")
        assert compare(a, one).finite and err <= floor, (n, err, floor)
    _within_baseline(case, seg)


_ONE_TERM_SCALED = [_ONE_TERM_CASES[1], _ONE_TERM_CASES[3]]      # varlen; h0


@pytest.mark.parametrize("case", _ONE_TERM_SCALED, ids=[c.id for c in _ONE_TERM_SCALED])
def test_one_term_fp16_gradients_scale_exactly_with_do_and_v(case):
    """The one-term fp16 backward is homogeneous bit for bit: dO and dht times 2^-24 (past fp16's range) scale every
    gradient by 2^-24, v and h0 times 2^12 scale dq, dk, dg, dbeta by 2^12 and leave dv, dh0 as they are (the
    per-group powers of two give the kernels the same operands)."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.plan import BackwardPlan

    def one16(plan):
        return dataclasses.replace(plan, **ONE16) if isinstance(plan, BackwardPlan) else plan

    args, kw, do, dht = tt.bwd_args(case, CUDA)
    base = kern(*args, do, dht, **kw, plan=one16)
    s, t = 2.0 ** -24, 2.0 ** 12
    small = kern(*args, do * s, None if dht is None else dht * s, **kw, plan=one16)
    q, k, v, g, beta = args
    h0 = kw.get("initial_state")
    big = kern(q, k, v * t, g, beta, do, dht, **dict(kw, initial_state=None if h0 is None else h0 * t), plan=one16)
    for n, a, b, c in zip(NAMES, base, small, big):
        if a is None:
            continue
        assert torch.equal(a.float() * s, b.float()), (n, "dO x 2^-24", case.id)
        assert torch.equal(a.float() * (1 if n in ("dv", "dh0") else t), c.float()), (n, "v x 2^12", case.id)


def test_convert_forms_the_exponents_and_factors_of_scales():
    """``gdn_bwd_amax`` then ``gdn_bwd_convert`` on value heads whose maxima are 0, inf, NaN, 2^-98, 2^100 and
    ordinary (GVA 4: a NaN or 0 head beside ordinary ones): the bits are ``scales.magnitude_bits`` of torch's maxima,
    the exponents, scales and factors bitwise ``scales.scales_and_factors``', v and dO scaled and rounded to fp16 as
    torch does, q and k converted."""
    from kernels.backward.configs import AMAX_KIND, CONVERT_KIND, BwdConfig
    from kernels.backward.scales import magnitude_bits, scales_and_factors
    from kernels.build import get_kernel
    g = torch.Generator(device=CUDA).manual_seed(3)
    T, H, HV, D = 300, 4, 16, 128
    q, k = (torch.randn(T, H, D, device=CUDA, generator=g).bfloat16() for _ in range(2))
    v, do = (torch.randn(T, HV, D, device=CUDA, generator=g).bfloat16() for _ in range(2))
    v[:, 0:4] = 0
    v[7, 4, 3] = float("nan")
    v[:, 8:12] *= 2.0 ** -100            # every element normal: the kernel flushes inputs below 2^-126 to zero
    v[:, 12] *= 2.0 ** 100
    do[:, 0] = 0
    do[5, 5, 9] = float("inf")
    do[:, 8:12] *= 2.0 ** 60
    bits = torch.zeros(2, HV, device=CUDA, dtype=torch.int32)
    get_kernel(BwdConfig(AMAX_KIND, "bfloat16", D))(v, do, bits)
    want_bits = magnitude_bits(torch.stack([t.float().abs().amax(dim=(0, 2)) for t in (do, v)]))
    nan = (want_bits > 0x7F800000) & (bits > 0x7F800000)          # NaN either way, whatever its payload
    assert bool(((bits == want_bits) | nan).all()), ("gdn_bwd_amax", bits.tolist(), want_bits.tolist())
    q2, k2, v2, do2 = (torch.empty_like(t, dtype=torch.float16) for t in (q, k, v, do))
    sf = torch.empty(4, HV, device=CUDA)
    get_kernel(BwdConfig(CONVERT_KIND, "float16", D, io="bfloat16"))(q, k, v, do, bits, q2, k2, v2, do2, sf)
    want = scales_and_factors(bits, H)
    assert torch.equal(sf, want), (sf.tolist(), want.tolist())

    def same(a, b):                                     # bitwise, NaN where NaN
        na, nb = a.isnan(), b.isnan()
        return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))

    assert same(v2, (v.float() * want[1, :, None]).half()), "v"
    assert same(do2, (do.float() * want[0, :, None]).half()), "dO"
    assert torch.equal(q2, q.half()) and torch.equal(k2, k.half())


# with h0 and without, GVA 2, 4 and 8, dense and varlen, raw-qk-l2 (the row where S hi alone lost dg), fp16
_LO8_CASES = [Case(T=1000, H=1, HV=4, dist="raw-qk-l2", grad=True),
              Case(layout="varlen-ragged", T=1001, H=2, HV=8, dist="slow-decay", h0_dtype="fp32", grad=True),
              Case(B=2, T=333, H=2, HV=4, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", grad=True),
              Case(T=8192, H=4, HV=8, dist="strong-decay", grad=True)]


@pytest.mark.parametrize("case", _LO8_CASES, ids=[c.id for c in _LO8_CASES])
def test_fp8_lo_tables_are_the_emulations(case):
    """``BackwardPlan.lo8``, dispatched (the recompute and dh store the S and dS' lo terms as fp8 under their hi
    terms' exponents, dqk widens them): every gradient within the input dtype's rounding floor of the emulation's
    ``lo8_tables`` and within the FLA-like baseline."""
    _backward_alternative_is_the_emulations(case, dict(lo8=True), dict(lo8_tables=True), "fp8 lo tables vs emulation")


@pytest.mark.parametrize("case", _LO8_CASES[:2], ids=[c.id for c in _LO8_CASES[:2]])
def test_input_dtype_lo_tables_are_the_emulations(case):
    """The backward benchmark's ``ours-lo16`` (``lo8=False``: the S and dS' lo tables in the input dtype): every
    gradient within the input dtype's rounding floor of the emulation's and within the FLA-like baseline."""
    _backward_alternative_is_the_emulations(case, dict(lo8=False), dict(lo8_tables=False),
                                            "input-dtype lo tables vs emulation")


@pytest.mark.parametrize("merge", ["bf16", "split"])
@pytest.mark.parametrize("case", [_STAGE_CASES[0], _SAVED_CASES[6], _S_SINGLE_CASES[1]],
                         ids=[c.id for c in (_STAGE_CASES[0], _SAVED_CASES[6], _S_SINGLE_CASES[1])])
def test_wgmma_merges_saved_or_recomputed_give_the_same_gradients(case, merge):
    """The backward benchmark's ``ours-m1`` / ``ours-msplit``: the forward at merge "bf16" / "split" keeps its Tinv
    and Ag, and prep with the same merges (``BackwardPlan.merge``) computes the same tables, so with dh's single form
    (no Tinv lo term) every gradient is bitwise the same either way; the dispatched dh on the saved tables is within
    the rounding floor of the emulation's at that ``merge`` and within the FLA-like baseline."""
    from kernels import autograd
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emu
    from kernels.backward.pipeline import reads_saved_tables
    from kernels.plan import ForwardPlan

    def merges(plan, single=False, keep=True):
        if isinstance(plan, ForwardPlan):
            return dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, merge=merge),
                                       keep_tables=plan.keep_tables and keep,
                                       p_table=plan.p_table and merge != "split")   # (P tables: no split merges)
        single = single and plan.dh_segments is None        # dh's single form writes no fp8 lo tables
        return dataclasses.replace(plan, merge=merge, dh_single=single, lo8=plan.lo8 and not single,
                                   reads_saved_tables=plan.reads_saved_tables and keep)

    saved = tt.function_grads(autograd.apply, case, CUDA, alter=lambda p: merges(p, single=True))
    recomputed = tt.function_grads(autograd.apply, case, CUDA, alter=lambda p: merges(p, single=True, keep=False))
    torch.cuda.synchronize()
    _check_forms(case, saved, recomputed)
    got = tt.function_grads(autograd.apply, case, CUDA, alter=merges)
    args, kw, do, dht = tt.bwd_args(case, CUDA)
    hi_only = reads_saved_tables(args[0])
    ge = emu(*args, do, dht, **kw, tinv_hi_only=hi_only, merge=merge)
    _within_floor_of_emulation(case, got, ge, f"{merge} merges vs emulation (Tinv hi alone: {hi_only})")
    _within_baseline(case, got)
