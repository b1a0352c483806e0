"""Every kernel launch of the forward and backward pipelines passes what its TileLang function declares: as many
arguments, each tensor of the declared dtype and rank, each scalar a Python number (what TVM-FFI's executable
checks at launch on a GPU).  On the CPU: the pipelines run on the no-op kernel path of
``benchmarks.memory_plan.stub_kernel_path`` with each kernel replaced by that check, for the dispatched plans at a
few layouts and for the A/B forms that change a kernel's arguments (fp16 operands, P @ U in fp16, the one-term
fp16 backward, fused or not)."""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import pytest
import torch

from tests.kernel_support import compile_skip_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compile_skip_reason() is not None, reason=compile_skip_reason() or "")]

# TileLang's dtype names -> torch's
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
           "int64": torch.int64, "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}


@functools.lru_cache(maxsize=None)
def _declared(cfg) -> tuple:
    """(name, torch dtype or None for a scalar, rank) of each parameter of ``cfg``'s TileLang function."""
    from kernels.build import prim_func

    pf = prim_func(cfg)
    out = []
    for v in pf.params:
        b = pf.buffer_map.get(v)
        out.append((v.name, None, 0) if b is None else (v.name, _DTYPES[str(b.dtype)], len(b.shape)))
    return tuple(out)


def _checking_kernel(launches):
    def get(cfg):
        want = _declared(cfg)

        def launch(*args):
            assert len(args) == len(want), f"{cfg.name}: {len(args)} arguments, its function takes {len(want)}"
            for a, (name, dt, rank) in zip(args, want):
                if dt is None:
                    assert isinstance(a, (int, float)) and not isinstance(a, bool), f"{cfg.name}: {name} is {a!r}"
                else:
                    assert isinstance(a, torch.Tensor) and (a.dtype, a.dim()) == (dt, rank), (
                        f"{cfg.name}: {name} is {getattr(a, 'dtype', type(a))} of rank {getattr(a, 'dim', int)()}, "
                        f"declared {dt} of rank {rank}")
            launches.append(cfg.name)
        return launch
    return get


# (B, T, H, HV, varlen lengths, K = V, input dtype)
LAYOUTS = {"few-heads-long": (1, 4096, 2, 4, None, 128, torch.bfloat16),
           "many-heads": (2, 512, 16, 32, None, 128, torch.bfloat16),
           "varlen": (1, 1100, 2, 4, [300, 64, 700, 36], 128, torch.bfloat16),
           "k64-fp16": (1, 2048, 2, 8, None, 64, torch.float16)}


def _run(layout, alter=None, grad=True, l2=False):
    """The kernel launches of one call at ``layout`` (an initial state given): forward + backward, or with ``grad``
    False the forward alone; with ``l2`` q and k L2-normalised in the kernels."""
    from benchmarks.memory_plan import inputs, stub_kernel_path
    from kernels.autograd import apply

    B, T, H, HV, lens, DK, dtype = LAYOUTS[layout]
    leaves, kw, do, dht = inputs(B, T, H, HV, lens, dtype, DK=DK, h0=True)
    kw["use_qk_l2norm_in_kernel"] = l2
    launches = []
    with stub_kernel_path(), mock.patch("kernels.build.get_kernel", _checking_kernel(launches)):
        with torch.set_grad_enabled(grad):
            o, ht = apply(*leaves, **kw, alter=alter)
        if grad:
            torch.autograd.backward((o, ht), (do, dht))
    return launches


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dispatched_forward_and_backward_launch_what_the_kernels_declare(layout):
    launches = _run(layout)
    assert any(n.startswith("intra") for n in launches) and any("dqk" in n for n in launches), launches


def _forward_form(**change):
    from kernels.plan import ForwardPlan

    return lambda plan: dataclasses.replace(plan, **change) if isinstance(plan, ForwardPlan) else plan


@pytest.mark.parametrize("form", ["half", "half128np", "noptab", "split2"])
def test_forward_forms_launch_what_the_kernels_declare(form):
    from kernels.forward.precision import PRESETS

    ws = dict(state_form="ws", ctas_per_sm=1, cp=1, warm=False, p_table=True)
    change = {"half": dict(ws, block_v=64, precision=PRESETS["half"]),
              "half128np": dict(ws, block_v=128, precision=PRESETS["half"], p_table=False),
              "noptab": dict(ws, block_v=64, precision=PRESETS["default"], p_table=False),
              "split2": dict(ws, block_v=64, cp=2, warm=True, split_heads=True, precision=PRESETS["default"])}[form]
    launches = _run("many-heads", _forward_form(**change), grad=False)
    states = 3 if form == "split2" else 2             # split_heads: the warm segments' and the whole sequences'
    assert len(launches) == states and all(n.startswith("state_ws") for n in launches[1:]), launches


def test_one_term_fp16_backward_launches_what_the_kernels_declare():
    """bf16 inputs, fp16 kernels: the conversion, the one forms of dh_ws and dqk, dv, dq, dk stored in bf16."""
    from benchmarks.bench_kernels_bwd import alter

    launches = _run("many-heads", alter("ours-one16"))
    assert any(n.startswith("bwd_cvt") for n in launches) and any(",one," in n for n in launches), launches


@pytest.mark.parametrize("layout,l2", [("many-heads", False), ("varlen", False), ("varlen", True)])
def test_fused_one_term_backward_launches_what_the_kernels_declare(layout, l2):
    """The one-term fp16 backward with dh and dqk fused (``BackwardPlan.fused``): the fused kernel in their place,
    then the group sums of its per-value-head dq~, dk~: straight to the caller's bf16, or in fp32 where the L2
    norm's chain follows (``l2``)."""
    from benchmarks.bench_kernels_bwd import alter

    launches = _run(layout, alter("ours-fused"), l2=l2)
    names = [n.split("[")[0] for n in launches]
    assert "bwd_fused" in names and "bwd_dh" not in names and "bwd_dqk" not in names, launches
    want = "bwd_gsum32[DK=DV=128,float16]" if l2 else "bwd_gsum[DK=DV=128,bfloat16]"
    assert launches.count(want) == 2 and sum(n.startswith("bwd_gsum") for n in launches) == 2, launches


@pytest.mark.parametrize("layout", ["few-heads-long", "varlen"])
def test_fused_warm_segments_launch_what_the_kernel_declares(monkeypatch, layout):
    """The fused kernel over its warm-up segments (``fused_warm``, forced on: the segment thresholds set to 1):
    its warm form, on the segments' tables, in the place of the one pass."""
    from benchmarks.bench_kernels_bwd import alter
    from kernels.backward import dh_segmented

    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    launches = _run(layout, alter("ours-fused"))
    names = [n.split("[")[0] for n in launches]
    assert "bwd_fused" in names and not any("fused" in n and ",warm," not in n for n in launches), launches
    assert not any(",warm," in n for n in _run(layout, alter("ours-fused-seq")) if "fused" in n)
    # exact end gradients: the chain form, the forward CP scan over the segments and the walk, then the one pass
    launches = _run(layout, alter("ours-fused-exact"))
    bwd = launches[next(i for i, n in enumerate(launches) if n.startswith("bwd_")):]       # the forward's left out
    fused = [n for n in bwd if "fused" in n or n.startswith(("scan", "cp_fix"))]
    i = next(i for i, n in enumerate(fused) if ",chain," in n)
    assert fused[0].startswith("scan_rv") and [n.split("[")[0] for n in fused[i:]] == [
        "bwd_fused", "cp_fixup", "bwd_fused"], fused
    assert not any(f in fused[-1] for f in (",chain,", ",warm,")), fused


def test_only_a_fused_warm_plan_builds_the_fused_segments(monkeypatch):
    """The fused kernel's segment tables (host copies for each new layout) are built for the plans that run its warm
    form alone: the dispatched backward and the fused one pass build none."""
    from benchmarks.bench_kernels_bwd import alter
    from kernels.backward import dh_segmented
    from kernels.backward import pipeline as bp

    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    blocks = []
    real = bp._dh_plan
    monkeypatch.setattr(bp, "_dh_plan", lambda *a: blocks.append(a[4]) or real(*a))
    for col, want in ((None, 0), ("ours-fused-seq", 0), ("ours-fused", 1), ("ours-fused-exact", 1)):
        blocks.clear()
        _run("few-heads-long", None if col is None else alter(col))
        assert blocks.count(1) == want, (col, blocks)


def test_fused_backward_refuses_stage_records_before_any_launch():
    """``stages`` with ``BackwardPlan.fused``: a ValueError naming it, raised before a kernel is launched."""
    from benchmarks.bench_kernels_bwd import alter
    from benchmarks.memory_plan import inputs, stub_kernel_path
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd

    B, T, H, HV, lens, DK, dtype = LAYOUTS["many-heads"]
    (q, k, v, g, beta), kw, do, dht = inputs(B, T, H, HV, lens, dtype, DK=DK, h0=True)
    launches = []
    with stub_kernel_path(), mock.patch("kernels.build.get_kernel", _checking_kernel(launches)):
        with pytest.raises(ValueError, match="stages: the fused backward"):
            chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=kw["initial_state"],
                                       plan=alter("ours-fused"), stages={})
    assert launches == []


@pytest.mark.parametrize("layout,l2,col", [("many-heads", False, "ours-fused"), ("varlen", True, "ours-fused"),
                                           ("group-one", False, "ours-fused"), ("varlen", False, "ours-fused-exact")])
def test_fused_dq16_launches_what_the_kernels_declare(monkeypatch, layout, l2, col):
    """``fused_dq16``: the fused kernel storing dq~, dk~ in fp16 (over warm or exact segments too: the segment
    thresholds set to 1; the exact form's chain pass takes the same buffers), then the group sums' scaled form (the
    one-term plan's factors among their arguments) at every group size, groups of one value head included."""
    from benchmarks.bench_kernels_bwd import alter
    from kernels.backward import dh_segmented
    from kernels.plan import BackwardPlan

    monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
    monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
    monkeypatch.setitem(LAYOUTS, "group-one", (1, 1024, 4, 4, None, 128, torch.bfloat16))
    fused = alter(col)

    def change(plan):
        plan = fused(plan)
        return dataclasses.replace(plan, fused_dq16=True) if isinstance(plan, BackwardPlan) else plan
    launches = _run(layout, change, l2=l2)
    kernels = [n for n in launches if n.startswith(("bwd_fused", "bwd_gsum"))]
    assert kernels and all(",dq16" in n for n in kernels), launches
    if col == "ours-fused-exact":
        assert any(",chain," in n for n in kernels), launches
    want = "bwd_gsum32[DK=DV=128,dq16,float16]" if l2 else "bwd_gsum[DK=DV=128,dq16,bfloat16]"
    assert launches.count(want) == 2 and sum(n.startswith("bwd_gsum") for n in launches) == 2, launches


@pytest.mark.parametrize("layout,l2", [("many-heads", False), ("varlen", True)])
def test_converting_prep_launches_what_the_kernels_declare(layout, l2):
    """``prep_converts`` (dispatched with the fused plan): the maxima, then prep's converting form on the caller's
    bf16 inputs with the fp16 copies and the scale factors among its arguments, and no ``gdn_bwd_convert``."""
    from benchmarks.bench_kernels_bwd import alter
    from kernels.plan import BackwardPlan

    fused = alter("ours-fused-seq")

    def change(plan):
        plan = fused(plan)
        return (dataclasses.replace(plan, fused_dq16=True, prep_converts=True) if isinstance(plan, BackwardPlan)
                else plan)
    launches = _run(layout, change, l2=l2)
    prep = "bwd_prep[DK=DV=128,tinv_hi,no_du,merge=fp32,io=bfloat16,float16]"
    amax = "bwd_amax[DK=DV=128,bfloat16]"
    assert launches.count(prep) == 1 and launches.count(amax) == 1, launches
    assert launches.index(amax) < launches.index(prep) and not any(n.startswith("bwd_cvt") for n in launches)
