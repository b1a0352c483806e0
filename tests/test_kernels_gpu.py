"""GPU correctness of our TileLang GDN forward against the fp64 reference (marker ``gpu``).

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or
tilelang is missing.  Cases (``tests.kernel_support.GPU_CASES``): T in 1, 63,
64, 65, 1000, 8192, 20468; dense B=1 and B=3; varlen with boundary lengths
(1, 63, 64, 65, 127, 128, 129) and with 300 short sequences; GVA ratios 2 and 4;
h0 (also ~50x) and both state layouts; bf16 and fp16; fp32, bf16 and fp16
gates; g near -20, g == 0, tiny decays; beta near 0/1; in-kernel l2 norm; K=V=64.

Bounds (see ``kernel_support.bounds``; the dispatched plan): o rel_rmse <= 2x the rounding floor
``rel_rmse(ref.to(dtype), ref)``; final state rel_rmse <= 5e-3; no NaN/Inf.
For some cases also: our errors <= FLA Triton's on the same inputs.
"""

import pytest
import torch

from tests import kernel_support as tt


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]


@pytest.mark.parametrize("case", tt.GPU_CASES, ids=[c.name for c in tt.GPU_CASES])
def test_against_fp64_reference(case):
    import kernels

    dev = torch.device("cuda")
    args, kwargs = case.inputs(dev)
    o, ht = kernels.chunk_gated_delta_rule(*args, **kwargs)
    torch.cuda.synchronize()
    o_ref, ht_ref = tt.reference_fn()(*args, **kwargs)
    assert o.shape == o_ref.shape and o.dtype == case.dtype
    assert ht.shape == ht_ref.shape and ht.dtype == torch.float32
    assert tt.nonfinite(o) == 0 and tt.nonfinite(ht) == 0
    floor = tt.rel_rmse(o_ref.to(case.dtype), o_ref)
    e_o, e_s = tt.rel_rmse(o, o_ref), tt.rel_rmse(ht, ht_ref)
    b_o, b_s = tt.bounds(case, floor)
    print(f"{case.name}: o {e_o:.3e} (floor {floor:.3e}, bound {b_o:.3e}) state {e_s:.3e} "
          f"max|do| {tt.max_diff(o, o_ref):.2e}")
    assert e_o <= b_o, (e_o, floor)
    assert e_s <= b_s, e_s
    if case.compare_fla:
        fla = tt.fla_triton_fn()
        if fla is None:
            pytest.skip("fla not importable: accuracy checked, FLA comparison skipped")
        o_f, ht_f = fla(*args, **kwargs)
        e_of, e_sf = tt.rel_rmse(o_f, o_ref), tt.rel_rmse(ht_f, ht_ref)
        print(f"  FLA Triton: o {e_of:.3e} state {e_sf:.3e}")
        assert e_o <= e_of * 1.001, (e_o, e_of)
        assert e_s <= e_sf * 1.001, (e_s, e_sf)


def test_output_final_state_false_and_no_h0():
    import kernels

    case = tt.Case("plain", 2, 300, 2, 4)
    (q, k, v, g, b), _ = case.inputs(torch.device("cuda"))
    o, ht = kernels.chunk_gated_delta_rule(q, k, v, g, b)
    assert ht is None
    o_ref, _ = tt.reference_fn()(q, k, v, g, b)
    assert tt.rel_rmse(o, o_ref) <= 1.5 * tt.rel_rmse(o_ref.to(o.dtype), o_ref) + 1e-6


def test_bad_input_on_gpu_raises_valueerror():
    import kernels

    case = tt.Case("bad", 2, 64, 2, 4)
    (q, k, v, g, b), _ = case.inputs(torch.device("cuda"))
    with pytest.raises(ValueError, match="batch size must be 1"):
        kernels.chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.tensor([0, 64], device="cuda"))
    with pytest.raises(ValueError, match="initial_state"):
        kernels.chunk_gated_delta_rule(q, k, v, g, b, initial_state=torch.zeros(3, 4, 128, 128, device="cuda"))


# with h0 (precision "default_h0") and without ("default": the output kernel's 128-column form)
_PLAN_CASES = [c for c in tt.GPU_CASES if c.name in ("T1000_h0_gva2", "varlen_boundaries_h0_vfirst", "D64_h0_vfirst",
                                                     "varlen_300_short_h0", "T8192", "gva4_l2norm")]
# plan values besides the dispatched one (ForwardPlan fields): the register-operand state kernel without CP, with
# CP forced and with BV 128; the shared-memory one at two CTAs per SM and at one
_PLANS = {"rv": dict(state_form="rv", block_v=64, ctas_per_sm=1, cp=1),
          "rv_cp3": dict(state_form="rv", block_v=64, ctas_per_sm=1, cp=3),
          "rv_bv128": dict(state_form="rv", block_v=128, ctas_per_sm=1, cp=1),
          "smem_occ2_bv16": dict(state_form="smem", block_v=16, ctas_per_sm=2, cp=1),
          "smem_occ2_bv32": dict(state_form="smem", block_v=32, ctas_per_sm=2, cp=1),
          "smem_occ1_bv64": dict(state_form="smem", block_v=64, ctas_per_sm=1, cp=1)}


@pytest.mark.parametrize("change", list(_PLANS))
@pytest.mark.parametrize("case", _PLAN_CASES, ids=[c.name for c in _PLAN_CASES])
def test_every_plan_the_dispatch_can_choose(case, change):
    """Each state-kernel plan the dispatch can choose, forced on inputs where it would choose another, meets the
    same bounds (``kernel_support.bounds``)."""
    import dataclasses

    from kernels.forward.pipeline import chunk_gated_delta_rule as impl
    from kernels.forward.pipeline import plan_for, prepare

    if case.D < _PLANS[change]["block_v"]:
        pytest.skip(f"{change}: a block of {_PLANS[change]['block_v']} value columns needs V >= that (V = {case.D})")
    dev = torch.device("cuda")
    args, kwargs = case.inputs(dev)
    plan = dataclasses.replace(plan_for(prepare(*args, **kwargs)), **_PLANS[change])
    o, ht = impl(*args, **kwargs, plan=plan)
    torch.cuda.synchronize()
    o_ref, ht_ref = tt.reference_fn()(*args, **kwargs)
    floor = tt.rel_rmse(o_ref.to(case.dtype), o_ref)
    e_o, e_s = tt.rel_rmse(o, o_ref), tt.rel_rmse(ht, ht_ref)
    print(f"{case.name} {change}: o {e_o:.3e} (floor {floor:.3e}) state {e_s:.3e}")
    assert tt.nonfinite(o) == 0 and tt.nonfinite(ht) == 0
    b_o, b_s = tt.bounds(case, floor)
    assert e_o <= b_o and e_s <= b_s


_BITWISE_CASES = [c for c in tt.GPU_CASES if c.name in ("T1000_h0_gva2", "varlen_boundaries_h0_vfirst", "D64_h0_vfirst",
                                                        "varlen_300_short_h0", "T8192")]


@pytest.mark.parametrize("case", _BITWISE_CASES, ids=[c.name for c in _BITWISE_CASES])
def test_kept_tables_change_nothing_else(case):
    """The forward that keeps its intra tables for the backward (the intra kernel also storing Tinv) gives bitwise
    the same o and final state as the one that does not, and hands over Th, Ah, Al of [HV, NC, 64, 64]."""
    from kernels.forward.pipeline import chunk_gated_delta_rule as impl

    dev = torch.device("cuda")
    args, kwargs = case.inputs(dev)
    o, ht = impl(*args, **kwargs)
    kept = {}
    o2, ht2 = impl(*args, **kwargs, keep_tables=kept)
    torch.cuda.synchronize()
    assert torch.equal(o, o2), f"o differs: max |diff| {tt.max_diff(o, o2):.3e}"
    assert torch.equal(ht, ht2), f"final state differs: max |diff| {tt.max_diff(ht, ht2):.3e}"
    assert set(kept) == {"Th", "Ah", "Al"} and kept["Th"].shape[-2:] == (64, 64)
