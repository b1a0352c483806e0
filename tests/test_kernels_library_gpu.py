"""The GDN ops registered through ``torch.library`` (``kernels.library``) on the GPU (marker ``gpu``; skips with
the reason without an sm_90 GPU or tilelang): ``torch.compile(fullgraph=True)`` (inductor) equal to eager, dense
and varlen, outputs and gradients; eager through the op equal to the autograd Function (``kernels.autograd.apply``);
``torch.library.opcheck`` (the fake's shapes, the kept tables' included, against the TileLang results); CUDA graph
capture and replay of the dense forward and of forward + backward at fixed shapes equal to eager on new input
values; ``torch.inference_mode()`` and ``torch.no_grad()`` on dense and varlen input.  Every comparison is bitwise:
the kernels are deterministic and the compiled or captured calls run the same kernels on the same values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases.case import Case
from tests import kernel_support as tt
from tests.library_support import OpCase, assert_same, results

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

CASES = [
    OpCase("dense_B2_T1000_h0_final", Case(B=2, T=1000, H=2, HV=4, h0_dtype="fp32", grad=True)),
    OpCase("dense_T300_no_h0_no_final", Case(T=300, H=2, HV=4, grad=True), final=False),
    # few heads over a long sequence: the backward's warm segmented reverse pass, on the forward's tables
    OpCase("dense_T19200_segmented_backward_h0", Case(T=19200, H=1, HV=2, h0_dtype="fp32", grad=True)),
    # 128 (value head, sequence) pairs: the fused one-term backward, the forward keeping no tables
    OpCase("dense_B4_T320_fused_backward", Case(B=4, T=320, H=16, HV=32, grad=True)),
    OpCase("varlen_empty_h0_vfirst_final", Case(layout="varlen-empty", T=429, H=2, HV=4, h0_dtype="fp32",
                                                state_v_first=True, grad=True)),
    OpCase("varlen_D64_l2_no_final", Case(layout="varlen-ragged", T=300, H=1, HV=2, K=64, V=64, dist="raw-qk-l2",
                                          grad=True), final=False),
]
DENSE = [c for c in CASES if not c.varlen]
VARLEN = [c for c in CASES if c.varlen]
_IDS = lambda cases: [c.id for c in cases]     # noqa: E731


def _dev():
    return torch.device("cuda")


def _rerun(test: str, case: OpCase) -> str:
    return f"pytest -m gpu tests/test_kernels_library_gpu.py::{test} -k {case.id}"


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel the cases need in parallel processes first (fills TileLang's disk cache)."""
    import os

    from kernels.backward.pipeline import plan_for, prepare_backward
    from kernels.build import precompile
    from kernels.forward.pipeline import plan_for as fplan_for
    cfgs = []
    for c in CASES:
        xs, do, dht, kw = c.inputs(_dev())
        kw = {n: x for n, x in kw.items() if n != "output_final_state"}
        b = prepare_backward(*xs, do, dht, **kw)
        fp, bp = fplan_for(b.x, True), plan_for(b)
        cfgs += fp.configs() + dataclasses.replace(fp, keep_tables=False).configs()
        cfgs += bp.configs(True) + bp.configs(False) + bp.recompute_configs()
    failed = precompile(list(dict.fromkeys(cfgs)), min(10, os.cpu_count() or 1))
    assert not failed, failed


@pytest.mark.parametrize("case", CASES, ids=_IDS(CASES))
def test_compile_fullgraph_equals_eager(case):
    import kernels
    from kernels.autograd import apply
    from kernels.library import op_call

    torch._dynamo.reset()
    eager = results(kernels.chunk_gated_delta_rule, case, _dev())
    compiled = torch.compile(kernels.chunk_gated_delta_rule, fullgraph=True)
    assert_same(results(compiled, case, _dev()), eager, case, "compiled (inductor) vs eager",
                _rerun("test_compile_fullgraph_equals_eager", case))
    assert_same(results(op_call, case, _dev()), eager, case, "the op in eager (op_call) vs eager",
                _rerun("test_compile_fullgraph_equals_eager", case))
    assert_same(eager, results(apply, case, _dev()), case, "eager vs autograd.apply",
                _rerun("test_compile_fullgraph_equals_eager", case))


@pytest.mark.parametrize("case", CASES, ids=_IDS(CASES))
def test_opcheck(case):
    """Schema, autograd registration, fake vs TileLang outputs (shapes, dtypes, strides: the kept tables' chunk
    count included) and AOT dispatch, for the forward keeping its tables and for the backward reading them."""
    from kernels.library import chunk_gdr_bwd, chunk_gdr_fwd

    xs, do, dht, kw = case.inputs(_dev())
    xs = [x.requires_grad_() for x in xs]
    h0, cu = kw["initial_state"], kw["cu_seqlens"]
    fwd_args = (*xs, h0, cu, None, case.final, case.l2, case.vf, True)
    out = torch.library.opcheck(chunk_gdr_fwd, fwd_args)
    assert set(out.values()) == {"SUCCESS"}, out
    _, _, *tables = (t.detach() for t in chunk_gdr_fwd(*fwd_args))
    out = torch.library.opcheck(chunk_gdr_bwd, (*[x.detach() for x in xs], do, dht, h0, cu, *tables, None,
                                                case.l2, case.vf))
    assert set(out.values()) == {"SUCCESS"}, out


def _static_inputs(case: OpCase, grad: bool):
    xs, do, dht, kw = case.inputs(_dev())
    xs = [x.requires_grad_(grad) for x in xs]
    if kw["initial_state"] is not None:
        kw["initial_state"].requires_grad_(grad)
    return xs, do, dht, kw


def _refill(xs, kw, seed: int):
    """New values into the static inputs (in place): each element times U(0.9, 1.1), so that beta |k|^2 stays
    below 2 (a contracting recurrence)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for x in xs + ([kw["initial_state"]] if kw["initial_state"] is not None else []):
            x.copy_(x * (0.9 + 0.2 * torch.rand(x.shape, device="cuda", generator=gen)).to(x.dtype))


def _call(case, xs, kw, do, dht, grad: bool) -> dict:
    import kernels

    o, ht = kernels.chunk_gated_delta_rule(*xs, **kw)
    out = {"o": o} if ht is None else {"o": o, "final_state": ht}
    if grad:
        h0 = kw["initial_state"]
        wrt = list(xs) + ([h0] if h0 is not None else [])
        outs, gouts = ((o,), (do,)) if ht is None else ((o, ht), (do, dht))
        names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 is not None else [])
        out.update(zip(names, torch.autograd.grad(outs, wrt, gouts)))
    return out


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("case", DENSE, ids=_IDS(DENSE))
def test_cuda_graph_replay_equals_eager(case, grad):
    """Capture one call (and its backward, ``grad``) at fixed shapes after a warm-up on a side stream, refill the
    static inputs with new values, replay: every output equals an eager call on those values."""
    xs, do, dht, kw = _static_inputs(case, grad)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _call(case, xs, kw, do, dht, grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _call(case, xs, kw, do, dht, grad)
    for seed in (1, 2):
        _refill(xs, kw, seed)
        graph.replay()
        torch.cuda.synchronize()
        got = {n: t.clone() for n, t in static_out.items()}
        want = _call(case, xs, kw, do, dht, grad)
        assert_same(got, want, case, f"CUDA graph replay {seed} vs eager ({'fwd+bwd' if grad else 'fwd'})",
                    _rerun("test_cuda_graph_replay_equals_eager", case))


@pytest.mark.parametrize("case", DENSE[:1], ids=_IDS(DENSE[:1]))
def test_compile_reduce_overhead_forward_equals_eager(case):
    """torch.compile(mode="reduce-overhead") records the dense forward in a CUDA graph: its third call (a replay)
    equals eager."""
    import kernels

    torch._dynamo.reset()
    want = results(kernels.chunk_gated_delta_rule, case, _dev(), grad=False)
    compiled = torch.compile(kernels.chunk_gated_delta_rule, fullgraph=True, mode="reduce-overhead")
    xs, _, _, kw = case.inputs(_dev())
    with torch.no_grad():
        for _ in range(3):
            o, ht = compiled(*xs, **kw)
            got = {"o": o.clone()} if ht is None else {"o": o.clone(), "final_state": ht.clone()}
    assert_same(got, want, case, "compiled (reduce-overhead) vs eager",
                _rerun("test_compile_reduce_overhead_forward_equals_eager", case))


@pytest.mark.parametrize("case", [DENSE[0]] + VARLEN, ids=_IDS([DENSE[0]] + VARLEN))
def test_inference_mode_and_no_grad(case):
    """Under inference_mode (inputs and cu_seqlens made there, as engines make them) and no_grad the op gives the
    grad-enabled outputs bitwise (keeping the tables changes no output) and none requires grad."""
    import kernels

    want = {n: t.detach() for n, t in results(kernels.chunk_gated_delta_rule, case, _dev(), grad=True).items()
            if n in ("o", "final_state")}
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            got = results(kernels.chunk_gated_delta_rule, case, _dev(), grad=False)
        assert not any(t.requires_grad for t in got.values())
        assert_same(got, want, case, f"under {mode.__name__}", _rerun("test_inference_mode_and_no_grad", case))


def _no_sync(fn):
    """``fn()`` with synchronising CUDA calls turned into errors (``torch.cuda.set_sync_debug_mode``)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# the segmented backward too: its warm forms read per-layout segment tables made once
SYNC_CASES = [DENSE[0], next(c for c in DENSE if "segmented" in c.id), VARLEN[0]]


@pytest.mark.parametrize("case", SYNC_CASES, ids=_IDS(SYNC_CASES))
def test_no_host_synchronisation_once_the_layout_is_known(case):
    """Forward + backward make no synchronising CUDA call once a dense shape, or a varlen ``cu_seqlens`` tensor,
    has been seen; a varlen call on a new ``cu_seqlens`` tensor copies it to the host (one synchronisation)."""
    xs, do, dht, kw = _static_inputs(case, True)
    _call(case, xs, kw, do, dht, True)
    torch.cuda.synchronize()
    _no_sync(lambda: _call(case, xs, kw, do, dht, True))
    if case.varlen:
        with torch.no_grad(), pytest.raises(RuntimeError, match="synchroniz"):
            _no_sync(lambda: _call(case, xs, dict(kw, cu_seqlens=kw["cu_seqlens"].clone()), do, dht, False))
