"""Head dim K = V = 64 as its own kernels (CPU, no tilelang needed): the plans build every kernel of a call for the
call's head dim, their occupancy math counts CTAs at that head dim, and the compile list holds every configuration
at both head dims.  (Compiling them: ``test_kernels_compile.py`` / ``test_kernels_bwd_compile.py``; running them:
the GPU tests' K = V = 64 cases.)"""

import dataclasses

import pytest
import torch

from kernels.backward.configs import BwdConfig
from kernels.forward.configs import HEAD_DIMS, IntraConfig, OutputConfig, StateConfig
from kernels.plan import N_SM, ForwardPlan, backward_plan, block_v, forward_plan
from kernels.forward.precision import preset

# (n_seq, HV, max_chunks, has_h0): the smem form at one and two CTAs per SM, the rv form with CP
_SHAPES = [(8, 32, 64, False), (1, 32, 512, True), (2, 4, 1024, False), (1, 2, 2048, True), (64, 8, 16, False)]


@pytest.mark.parametrize("DK", HEAD_DIMS)
@pytest.mark.parametrize("shape", _SHAPES, ids=[f"N{n}_HV{hv}_C{c}_h0{int(h)}" for n, hv, c, h in _SHAPES])
def test_plans_build_every_kernel_at_the_call_head_dim(DK, shape):
    n_seq, HV, chunks, h0 = shape
    fp = forward_plan("bfloat16", n_seq, HV, chunks, h0, keep_tables=True, DK=DK)
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
    # 8 value heads of one long sequence: 16 rv CTAs at DK 128 (over CP_MAX_CTAS), 8 at DK 64
    wide, narrow = (forward_plan("bfloat16", 1, 8, 1024, False, DK=d) for d in (128, 64))
    assert (wide.state_form, narrow.state_form) == ("smem", "rv") and narrow.cp > 1
    assert backward_plan("bfloat16", 1, 32, 64, 2, DK=64).recompute_block_v == block_v(2, 32, 1, 64) == 32


def test_reverse_pass_segments_count_value_blocks_at_the_head_dim():
    """The backward's segmented reverse pass is chosen from N x HV x DK / 64 dh CTAs: 33 value heads of one long
    sequence are 66 CTAs at K = 128 (half the SMs: sequential, reading the forward's tables) but 33 at K = 64
    (segmented, so the forward keeps no tables for it)."""
    from kernels.backward.pipeline import reads_saved_tables

    T, HV = 256 * 64, 33
    for K, seq in ((128, True), (64, False)):
        q = torch.empty(1, 1, 1, K, dtype=torch.bfloat16).expand(1, T, 1, K)
        v = torch.empty(1, 1, 1, K, dtype=torch.bfloat16).expand(1, T, HV, K)
        assert reads_saved_tables(q, v) is seq, K


def _at_64(c):
    """The DK 64 counterpart of a DK 128 configuration (value blocks of 128 columns become 64)."""
    if isinstance(c, BwdConfig):
        return dataclasses.replace(c, DK=64)
    if isinstance(c, IntraConfig):
        return dataclasses.replace(c, DK=64)
    return dataclasses.replace(c, DK=64, BV=min(c.BV, 64))


def test_compile_list_holds_every_configuration_at_both_head_dims():
    from kernels.build import all_configs, forward_configs

    cfgs = all_configs()
    assert len(set(cfgs)) == len(cfgs)
    at = {D: [c for c in cfgs if c.DK == D] for D in HEAD_DIMS}
    assert set(at) == {64, 128} and all(at.values())
    assert {_at_64(c) for c in at[128]} == set(at[64])
    fwd = forward_configs()
    assert cfgs[:len(fwd)] == fwd and not any(isinstance(c, BwdConfig) for c in fwd)
    kinds = {type(c).__name__ if not isinstance(c, BwdConfig) else c.kind for c in at[64]}
    assert {"IntraConfig", "StateConfig", "OutputConfig", "prep", "dh", "dqk", "dgdb", "gsum", "gsum32"} <= kinds
    assert any(isinstance(c, StateConfig) and c.scan for c in at[64])
    assert any(isinstance(c, OutputConfig) and c.vt for c in at[64])


def test_a_head_dim_without_kernels_is_refused():
    for bad in (32, 96, 256):
        with pytest.raises(ValueError, match=f"DK={bad}"):
            forward_plan("bfloat16", 1, 4, 64, False, DK=bad)
        with pytest.raises(ValueError, match=f"DK={bad}"):
            backward_plan("bfloat16", 1, 4, 64, 1, DK=bad)
    with pytest.raises(ValueError, match="at most DK"):        # the rv form's 128 value columns at DK 64
        ForwardPlan("bfloat16", preset(False), "rv", 128, DK=64)
