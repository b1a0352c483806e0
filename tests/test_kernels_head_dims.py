"""Head dim K = V = 64 as its own kernels (CPU, no tilelang needed): the plans build every kernel of a call for the
call's head dim, their occupancy math counts CTAs at that head dim, and the compile list holds every configuration
at both head dims.  (Compiling them: ``test_kernels_compile.py`` / ``test_kernels_bwd_compile.py``; running them:
the GPU tests' K = V = 64 cases and ``test_head_dim_64_kernels_match_the_padded_128_call`` below.)"""

import dataclasses

import pytest
import torch

from kernels.backward.configs import ONE_TERM_KINDS, BwdConfig
from kernels.forward.configs import HEAD_DIMS, FixupConfig, IntraConfig, OutputConfig, StateConfig
from kernels.forward.precision import preset
from kernels.plan import N_SM, WS_HEAD_DIMS, ForwardPlan, backward_plan, block_v, forward_plan
from cases.case import Case
from tests import kernel_support as tt

# (n_seq, HV, max_chunks): the ws form (smem at one and two CTAs per SM at DK 64), the rv form with CP
_SHAPES = [(8, 32, 64), (1, 32, 512), (2, 4, 1024), (1, 2, 2048), (64, 8, 16)]


@pytest.mark.parametrize("DK", HEAD_DIMS)
@pytest.mark.parametrize("shape", _SHAPES, ids=[f"N{n}_HV{hv}_C{c}" for n, hv, c in _SHAPES])
def test_plans_build_every_kernel_at_the_call_head_dim(DK, shape):
    n_seq, HV, chunks = shape
    fp = forward_plan("bfloat16", n_seq, HV, chunks, keep_tables=True, DK=DK)
    bp = backward_plan("bfloat16", 1, HV, chunks * n_seq, n_seq, DK=DK)
    cfgs = fp.configs() + bp.configs(with_saved=True) + bp.configs(with_saved=False)
    assert fp.DK == bp.DK == DK
    assert {c.DK for c in cfgs} == {DK}, [c.name for c in cfgs if c.DK != DK]
    for c in cfgs:
        assert getattr(c, "BV", DK) <= DK and DK % getattr(c, "BV", DK) == 0, c.name


def test_state_kernel_occupancy_counts_ctas_at_the_head_dim():
    """``block_v`` and the choice of the rv form with CP count N x HV x DK / BV CTAs at the call's DK: at DK 64 a
    call has half the value blocks of DK 128, so it takes the narrower block (or CP) where 128 would not."""
    for n_seq, HV in ((2, 32), (1, 128), (4, 16)):
        for DK in HEAD_DIMS:
            bv = block_v(n_seq, HV, 1, DK)
            assert bv == 16 or n_seq * HV * (DK // bv) >= N_SM, (n_seq, HV, DK, bv)
            if bv < 64:                 # the next wider block would leave SMs idle
                assert n_seq * HV * (DK // (2 * bv)) < N_SM, (n_seq, HV, DK, bv)
    assert (block_v(2, 32, 1, 128), block_v(2, 32, 1, 64)) == (64, 32)
    # 8 value heads of one long sequence: 16 CTAs of 64 value columns at DK 128 (over CP_MAX_CTAS: the ws form's
    # CP, 8 segments for 128 CTAs), 8 at DK 64 (the rv form's CP, 16 segments)
    wide, narrow = (forward_plan("bfloat16", 1, 8, 1024, DK=d) for d in (128, 64))
    assert (wide.state_form, wide.cp, narrow.state_form, narrow.cp) == ("ws", 8, "rv", 16)
    assert backward_plan("bfloat16", 1, 32, 64, 2, DK=64).recompute_block_v == block_v(2, 32, 1, 64) == 32


def test_reverse_pass_segments_count_value_blocks_at_the_head_dim():
    """The backward's segmented reverse pass is chosen from N x HV x DK / 64 dh CTAs: 33 value heads of one long
    sequence are 66 CTAs at K = 128 (half the SMs: sequential) but 33 at K = 64 (segmented)."""
    from kernels.backward import dh_segmented
    from kernels.backward.pipeline import dh_value_blocks

    T, HV = 256 * 64, 33
    for K, seq in ((128, True), (64, False)):
        assert (dh_segmented.plan([0, T], HV, dh_value_blocks(K), 132) is None) is seq, K


def _at_64(c):
    """The DK 64 counterpart of a DK 128 configuration (value blocks of 128 columns become 64)."""
    if isinstance(c, BwdConfig):
        return dataclasses.replace(c, DK=64)
    if isinstance(c, (IntraConfig, FixupConfig)):
        return dataclasses.replace(c, DK=64)
    return dataclasses.replace(c, DK=64, BV=min(c.BV, 64))


def test_compile_list_holds_every_configuration_at_both_head_dims():
    from kernels.build import all_configs, forward_configs

    cfgs = all_configs()
    assert len(set(cfgs)) == len(cfgs)
    at = {D: [c for c in cfgs if c.DK == D] for D in HEAD_DIMS}
    assert set(at) == {64, 128} and all(at.values())
    # the P-table, warm-up and recompute table forms (and the scan and fix-up of the warm-up), the fp16-operand
    # forms, dqk's A/B forms and the one-term backward's forms (with its element-wise passes and its prep storing
    # Tinv hi alone) are built at the head dims where the ws form is dispatched (WS_HEAD_DIMS) alone, as are the
    # fused backward's (its prep without dUloc^T, its dq16 group sums); the backward's warm dh (the segmented reverse
    # pass, the register kernel) at both
    ws_only = ("pt", "warm", "tables", "e_once", "exp_mask", "one", "io", "no_du", "dq16")

    def at_128_only(c):
        half = getattr(getattr(c, "prec", None), "half", False) or getattr(c, "ag", None) == "fp16"
        flags = [f for f in ws_only if not (f == "warm" and isinstance(c, BwdConfig))]
        one_prep = getattr(c, "kind", None) == "prep" and c.tinv_hi
        one = getattr(c, "kind", None) in ONE_TERM_KINDS or one_prep
        return any(getattr(c, f, False) for f in flags) or half or one
    assert WS_HEAD_DIMS == (128,) and not any(at_128_only(c) for c in at[64])
    assert {_at_64(c) for c in at[128] if not at_128_only(c)} == set(at[64])
    fwd = forward_configs()
    assert cfgs[:len(fwd)] == fwd and not any(isinstance(c, BwdConfig) for c in fwd)
    kinds = {type(c).__name__ if not isinstance(c, BwdConfig) else c.kind for c in at[64]}
    assert {"IntraConfig", "StateConfig", "OutputConfig", "FixupConfig", "prep", "dh", "dqk", "dgdb", "gsum",
            "gsum32"} <= kinds
    assert any(isinstance(c, StateConfig) and c.scan for c in at[64])
    assert any(isinstance(c, OutputConfig) and c.vt for c in at[64])


def test_a_head_dim_without_kernels_is_refused():
    for bad in (32, 96, 256):
        with pytest.raises(ValueError, match=f"DK={bad}"):
            forward_plan("bfloat16", 1, 4, 64, DK=bad)
        with pytest.raises(ValueError, match=f"DK={bad}"):
            backward_plan("bfloat16", 1, 4, 64, 1, DK=bad)
    with pytest.raises(ValueError, match="at most DK"):        # the rv form's 128 value columns at DK 64
        ForwardPlan("bfloat16", preset(), "rv", 128, DK=64)


# K = V = 64 on the GPU against the same call zero-padded to 128 (what the API ran before the DK 64 kernels; the
# padding is exact): the dispatch's forms at DK 64 (smem at one and two CTAs per SM, rv with CP; dqk alone, in
# clusters of 2 / 4 / 8 and with the group-sum kernel; the sequential and the segmented reverse pass)
_GPU_CASES = [Case(B=2, T=700, H=1, HV=3, K=64, V=64, dtype="fp16", dist="raw-qk-l2", grad=True),
              Case(layout="varlen-ragged", T=2065, H=2, HV=4, K=64, V=64, h0_dtype="fp32", grad=True),
              Case(T=40000, H=1, HV=4, K=64, V=64, grad=True),
              Case(T=2000, H=2, HV=16, K=64, V=64, h0_dtype="fp32", state_v_first=True, grad=True),
              Case(B=8, T=300, H=4, HV=16, K=64, V=64, grad=True)]


def _padded(x, dims: int):
    """``x`` zero-padded from 64 to 128 in its last ``dims`` dims (None stays None)."""
    return None if x is None else torch.nn.functional.pad(x, (0, 64) * dims)


@pytest.mark.gpu
@pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")
@pytest.mark.parametrize("case", _GPU_CASES, ids=[c.id for c in _GPU_CASES])
def test_head_dim_64_kernels_match_the_padded_128_call(case):
    """Forward and backward at K = V = 64 run the DK 64 kernels and agree with the same call zero-padded to 128
    (the DK 128 kernels: exact arithmetic on the zero columns) within the input dtype's rounding floor of each
    output against fp64.  (Their verdicts against fp64: the K = V = 64 rows of ``test_kernels_verdicts_gpu.py``.)"""
    from cases.inputs import make_inputs
    from kernels.backward.pipeline import plan_for, prepare_backward
    from kernels.forward.pipeline import plan_for as fplan_for
    from parity.refs import compute

    dev = torch.device("cuda")
    args, kw, do, dht = tt.bwd_args(case, dev)
    b = prepare_backward(*args, do, dht, **kw)
    fp, bp = fplan_for(b.x, True), plan_for(b)
    assert {c.DK for c in fp.configs() + bp.configs(True)} == {64}, (fp, bp)
    print(f"{case.id}: forward {fp.state_form} BV {fp.block_v} occ {fp.ctas_per_sm} cp {fp.cp}; backward "
          f"segmented {bp.dh_segments is not None}, group {bp.group}, cluster {bp.cluster_group_sum}")
    scale = 64 ** -0.5 if kw["scale"] is None else kw["scale"]      # the K = 64 call's default, not 128's
    kw = dict(kw, scale=scale)
    pad_kw = dict(kw, initial_state=_padded(kw["initial_state"], 2))
    pad_args = [_padded(x, 1) for x in args[:3]] + list(args[3:])
    got = tt.call_grads(args, kw, do, dht)
    padded = tt.call_grads(pad_args, pad_kw, _padded(do, 1), _padded(dht, 2))
    ref = compute(case, make_inputs(case, dev))
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"][:len(got)]
    for n, a, p in zip(names, got, padded):
        r = ref[n]
        p = p[tuple(slice(0, s) for s in a.shape)]
        d, fl = tt.rel_rmse(a, p), tt.rel_rmse(r.to(args[0].dtype), r)
        print(f"  {n}: vs padded {d:.3e}, floor {fl:.3e}, vs fp64 {tt.rel_rmse(a, r):.3e} "
              f"(padded {tt.rel_rmse(p, r):.3e})")
        assert bool(torch.isfinite(a).all()) and a.shape == r.shape, n
        assert d <= fl, f"{n}: rel_rmse vs the padded call {d:.3e} > floor {fl:.3e} | case {case.id}"
