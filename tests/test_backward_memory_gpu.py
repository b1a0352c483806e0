"""GPU checks of the backward's buffer lifetimes (marker ``gpu``): the CPU memory plan
(``benchmarks/memory_plan.py``) predicts the GPU's peak of one forward + backward, and the recompute overlapped
with the reverse pass gives the serial schedule's gradients.

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or tilelang is missing.
"""

import dataclasses

import pytest
import torch

from cases.case import Case
from tests import kernel_support as tt

CUDA = torch.device("cuda")
MiB = 2 ** 20

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]


@pytest.mark.parametrize("shape,col", [("B1_T8192_H4_HV8", None), ("B1_T65536_H2_HV4", None),
                                       ("B1_T65536_H2_HV4", "ours-s-single"), ("B1_T65536_H2_HV4", "ours-lo16")])
def test_memory_plan_predicts_the_gpu_peak(shape, col):
    """One forward + backward as ``bench_kernels_bwd`` measures it: the peak above the inputs (gradients included)
    within 1 MiB of the CPU trace's; with the dispatched plans, or those of the benchmark's A/B column ``col``."""
    from benchmarks import memory_plan as mp
    from benchmarks.bench_kernels_bwd import alter, make
    from benchmarks.inputs import SHAPES
    from kernels.autograd import apply

    B, T, H, HV, lens = SHAPES[shape]
    a, kw, do, dht = make(B, T, H, HV, lens, CUDA)
    leaves = [x.detach().requires_grad_() for x in a]
    plans = {} if col is None else {"alter": alter(col)}

    def fwd_bwd():
        o, ht = apply(*leaves, **kw, **plans)
        torch.autograd.backward((o, ht), (do, dht))

    fwd_bwd()                                   # compiles; the layout caches
    for x in leaves:
        x.grad = None
    gpu = mp.gpu_peak(fwd_bwd) / MiB
    cpu = mp.plan(shape, alter=plans.get("alter")).peak / MiB
    print(f"  {shape} {col or 'dispatched'}: GPU {gpu:.1f} MiB, CPU trace {cpu:.1f} MiB")
    assert abs(gpu - cpu) <= 1, (gpu, cpu)


@pytest.mark.parametrize("case,segmented", [(Case(T=65536, H=2, HV=4, grad=True), True),
                                            (Case(T=8192, H=4, HV=8, h0_dtype="fp32", grad=True), False)],
                         ids=["B1_T65536_H2_HV4", "B1_T8192_H4_HV8_h0"])
def test_overlapped_recompute_equals_the_serial_schedule(case, segmented):
    """The recompute on the side stream beside dh: beside the segmented reverse pass from warm-up chunks, as
    dispatched (B1 T65536 H2 HV4), and beside the sequential one per CP segment from the exact scan and fix-up,
    which then also run on the side stream (B1 T8192 H4 HV8 with h0, where the dispatch runs it serially); three
    calls give the serial schedule's gradients bitwise (the same kernels on the same inputs), none touched by a
    buffer the side stream reused while dh still read it."""
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as kern
    from kernels.backward.pipeline import plan_for, prepare_backward

    xs, kw, do, dht = tt.bwd_args(case, CUDA)
    plan = plan_for(prepare_backward(*xs, do, dht, **kw))
    assert plan.overlap_recompute == segmented and (plan.dh_segments is not None) == segmented, plan
    assert segmented or plan.recompute_cp > 1, plan
    plan = dataclasses.replace(plan, overlap_recompute=True)
    serial = kern(*xs, do, dht, **kw, plan=dataclasses.replace(plan, overlap_recompute=False))
    for _ in range(3):
        got = kern(*xs, do, dht, **kw, plan=plan)
        torch.cuda.synchronize()
        for n, a, b in zip(tt.GRAD_NAMES, got, serial):
            if b is None:
                continue
            assert torch.isfinite(a).all() and torch.equal(a, b), (n, tt.max_rel(a, b))
