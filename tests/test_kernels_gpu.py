"""GPU correctness of our TileLang GDN forward against the fp64 reference (marker ``gpu``).

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or
tilelang is missing.  Cases (``tests.kernel_support.GPU_CASES``): T in 1, 63,
64, 65, 1000, 8192, 20468; dense B=1 and B=3; varlen with boundary lengths
(1, 63, 64, 65, 127, 128, 129) and with 300 short sequences; GVA ratios 2 and 4;
h0 (also ~50x) and both state layouts; bf16 and fp16; fp32, bf16 and fp16
gates; g near -20, g == 0, tiny decays; beta near 0/1; in-kernel l2 norm; K=V=64.

Bounds (see ``testing.bounds``; default v2 path): o rel_rmse <= 2x the rounding floor
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


# with h0 (precision "default_h0") and without ("default": the pipelined output kernel's 128-column form)
_KNOB_CASES = [c for c in tt.GPU_CASES if c.name in ("T1000_h0_gva2", "varlen_boundaries_h0_vfirst", "D64_h0_vfirst",
                                                     "varlen_300_short_h0", "T8192", "gva4_l2norm")]


@pytest.mark.parametrize("knobs", [dict(_form="rv", _cp=1), dict(_cp=3), dict(_form="rv", _block_v=128, _cp=1),
                                   dict(_form="smem", _precision="max"), dict(_out="chunk"), dict(_out="pipe"),
                                   dict(_out="pipe", _form="rv", _cp=1), dict(_intra="v2"),
                                   dict(_form="smem", _occ=2), dict(_form="smem", _occ=2, _block_v=32),
                                   dict(_form="smem", _occ=1)],
                         ids=["v2_rv", "v2_rv_cp3", "v2_rv_bv128", "v2_smem_max", "v2_chunk", "v2_pipe",
                              "v2_pipe_rv", "v2_intra_v2", "v2_occ2", "v2_occ2_bv32", "v2_occ1"])
@pytest.mark.parametrize("case", _KNOB_CASES, ids=[c.name for c in _KNOB_CASES])
def test_private_knobs(case, knobs):
    """The variants the benchmark times besides the default: the register-operand state kernel
    without CP, with CP forced on and with BV 128, the shared-memory one at the "max" precision
    preset, both output kernel forms ("chunk", "pipe"; with key-first and value-first chunk tables), the
    intra kernel's older "v2" form and the smem state kernel at two CTAs per SM and at one (bounds:
    ``testing.bounds``)."""
    from kernels.forward.pipeline import chunk_gated_delta_rule as impl

    dev = torch.device("cuda")
    args, kwargs = case.inputs(dev)
    o, ht = impl(*args, **kwargs, **knobs)
    torch.cuda.synchronize()
    o_ref, ht_ref = tt.reference_fn()(*args, **kwargs)
    floor = tt.rel_rmse(o_ref.to(case.dtype), o_ref)
    e_o, e_s = tt.rel_rmse(o, o_ref), tt.rel_rmse(ht, ht_ref)
    print(f"{case.name} {knobs}: o {e_o:.3e} (floor {floor:.3e}) state {e_s:.3e}")
    assert tt.nonfinite(o) == 0 and tt.nonfinite(ht) == 0
    b_o, b_s = tt.bounds(case, floor)
    assert e_o <= b_o and e_s <= b_s


_BITWISE_CASES = [c for c in tt.GPU_CASES if c.name in ("T1000_h0_gva2", "varlen_boundaries_h0_vfirst", "D64_h0_vfirst",
                                                        "varlen_300_short_h0", "T8192")]


@pytest.mark.parametrize("knobs", [dict(_intra="v2"), dict(_cpb=16)], ids=["intra_chunk", "out_cpb16"])
@pytest.mark.parametrize("case", _BITWISE_CASES, ids=[c.name for c in _BITWISE_CASES])
def test_forms_are_bitwise_equal(case, knobs):
    """Forms that change only the schedule give bitwise the same o and final state as the default: the intra
    kernel's "v2" form (the default "ax" writes the merge product over the dead A_o tile) and the pipe output
    kernel at 16 chunks per CTA (default 8).  (In session 5 this test also held the state kernel with a wgmma
    wait after every product, the form the grouped default replaced: bitwise equal on all five cases.)"""
    from kernels.forward.pipeline import chunk_gated_delta_rule as impl

    dev = torch.device("cuda")
    args, kwargs = case.inputs(dev)
    o, ht = impl(*args, **kwargs)
    o2, ht2 = impl(*args, **kwargs, **knobs)
    torch.cuda.synchronize()
    assert torch.equal(o, o2), f"o differs: max |diff| {tt.max_diff(o, o2):.3e}"
    assert torch.equal(ht, ht2), f"final state differs: max |diff| {tt.max_diff(ht, ht2):.3e}"
