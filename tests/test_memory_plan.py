"""``benchmarks/memory_plan.py``: its accounting of one forward + backward on the CPU (no-op kernels), checked
against itself (the peak is the sum of what it lists alive there) and against the CPU allocator's own events
(``torch.profiler``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import memory_plan as mp

# (B, T, H, HV, varlen lengths): dense GVA 2, varlen with a partial chunk, GVA 3 (the group-sum kernel)
SHAPES = {"dense": (1, 256, 2, 4, None), "varlen": (1, 300, 2, 4, [100, 200]), "gva3": (2, 128, 1, 3, None)}


@pytest.fixture(scope="module", params=list(SHAPES))
def traced(request):
    return mp.plan(SHAPES[request.param], check=True)


def test_peak_is_the_sum_of_the_tensors_alive_there(traced):
    t = traced.trace
    assert t.peak > 0 and t.peak == sum(a.nbytes for a in t.peak_alive)
    assert len({a.id for a in t.peak_alive}) == len(t.peak_alive)


def test_peak_equals_the_cpu_allocators(traced):
    """Every allocation of the call is seen (no view of an input counted, no temporary missed)."""
    assert traced.profiler_peak == traced.peak


def test_outputs_and_gradients_are_alive_at_the_peak_and_named(traced):
    labels = [(a.site.split(":")[0], a.func, a.name) for a in traced.trace.peak_alive]
    assert ("kernels/forward/pipeline.py", "output", "o") in labels
    assert ("kernels/backward/pipeline.py", "dh", "dv") in labels
    # the gradients' storages are allocations of the call, alive at the end, and ``grads`` their sum
    end = {a.key: a for a in traced.trace.alive()}
    assert set(traced.grad_keys) <= set(end) and len(traced.grad_keys) == 5
    assert traced.grads == sum(end[k].nbytes for k in traced.grad_keys) > 0
    assert traced.peak_above_grads == traced.peak - traced.grads
    assert all(a.site.startswith("kernels/") for a in traced.trace.alive())


def test_timeline_has_every_stage_in_call_order(traced):
    stages = [(d, s) for d, s, _, _ in traced.trace.timeline]
    fwd = [s for d, s in stages if d == "forward"]
    bwd = [s for d, s in stages if d == "backward"]
    assert fwd[0] == "prepare" and fwd[-1] == "finish" and "intra_chunk" in fwd and "output" in fwd
    assert bwd[0] == "prepare_backward" and bwd[-1] == "dg_dbeta"
    assert {"prep", "recompute", "dh", "dqk"} <= set(bwd)
    assert max(pk for _, _, _, pk in traced.trace.timeline) == traced.peak


def test_stub_path_restores_what_it_patched():
    import kernels.build as build
    import kernels.forward.pipeline as fpipe
    before = (build.get_kernel, fpipe.check_inputs, fpipe.intra_chunk, torch.cuda.get_device_capability)
    with mp.stub_kernel_path(mp.MemoryTrace()):
        assert build.get_kernel is not before[0] and fpipe.intra_chunk is not before[2]
    assert (build.get_kernel, fpipe.check_inputs, fpipe.intra_chunk, torch.cuda.get_device_capability) == before


def test_unknown_shape_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        mp.main(["--shapes", "B1_T7_H1_HV1"])
    assert "--shapes" in capsys.readouterr().err
