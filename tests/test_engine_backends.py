"""The engine backends' conversions on the CPU, through stand-in modules (tests/engine_stubs.py) that record their
arguments and answer in the engine's own layout: packing and cu_seqlens, exp(g), dtypes, state transposes, the
recorded kernel, and the unsupported reasons (FlashInfer's SM checks) found without running a kernel."""

from __future__ import annotations

import pytest
import torch

import reference
from cases.case import Case
from cases.inputs import make_inputs
from parity.backends import BACKENDS, get_backend
from parity.backends import flashinfer as fi_mod
from tests import engine_stubs

CPU = torch.device("cpu")
DENSE = Case(layout="dense", B=2, T=80, H=2, HV=4, K=128, V=128, dtype="bf16", g_dtype="bf16", beta_dtype="bf16",
             h0_dtype="bf16", dist="qwen-gates")


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _expected(case):
    inp = make_inputs(case)
    return reference.chunk_gated_delta_rule(**inp.kwargs())


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(fi_mod, "cuda_capability", lambda: (9, 0))
    from parity.backends import engine_fla

    monkeypatch.setattr(engine_fla, "cuda_capability", lambda: (9, 0))


@pytest.mark.parametrize("case", [
    DENSE,
    DENSE.replace(state_v_first=True),
    Case(layout="varlen-ragged", B=1, T=300, H=2, HV=4, dtype="fp16", g_dtype="fp32", beta_dtype="fp32",
         h0_dtype="fp32", dist="raw-qk-l2"),
], ids=lambda c: c.layout + ("-vfirst" if c.state_v_first else "") + f"-{c.dist}")
def test_flashinfer_converts_as_the_engines_do(monkeypatch, hopper, case):
    rec = engine_stubs.install_flashinfer(monkeypatch)
    be = get_backend("flashinfer")
    assert be.available() == (True, "") and be.supports(case, CPU) == (True, "")
    inp = make_inputs(case)
    res = be.run(inp)
    kw = rec["kwargs"]
    B, T = case.B, case.T
    assert kw["q"].shape == (B * T, case.H, case.K) and kw["q"].is_contiguous()
    assert kw["v"].shape == (B * T, case.HV, case.V)
    want_cu = inp.cu_seqlens if inp.cu_seqlens is not None else torch.arange(0, (B + 1) * T, T)
    assert kw["cu_seqlens"].dtype == torch.int64 and torch.equal(kw["cu_seqlens"], want_cu)
    assert kw["g"].dtype == torch.float32 and kw["beta"].dtype == torch.float32
    assert torch.equal(kw["g"], torch.exp(inp.g.float()).reshape(B * T, case.HV))
    assert (kw["g"] > 0).all() and (kw["g"] <= 1).all()  # linear-space alpha, not log-space g
    h0 = kw["initial_state"]
    assert h0.dtype == torch.float32
    want_h0 = inp.initial_state.float() if case.state_v_first else inp.initial_state.float().transpose(-1, -2)
    assert torch.equal(h0, want_h0)  # FlashInfer's [N, HV, V, K]
    assert kw["use_qk_l2norm_in_kernel"] is False and kw["backend"] == "auto"
    norms = kw["q"].float().norm(dim=-1)
    if inp.use_qk_l2norm_in_kernel:  # normalised before the call, as the engines' l2norm_fwd does
        assert (norms - 1).abs().max() < 1e-2 and not torch.allclose(inp.q.float().norm(dim=-1), torch.ones(1))
    else:
        assert torch.equal(kw["q"], inp.q.reshape(B * T, case.H, case.K))
    o, ht = _expected(case)
    assert res.o.shape == o.shape and res.final_state.shape == ht.shape
    # the stand-in is exact: only input rounding (q/k normalised then rounded to their dtype) separates them
    assert _rel(res.o, o) < 1e-2 and _rel(res.final_state, ht) < (1e-2 if inp.use_qk_l2norm_in_kernel else 1e-5)
    assert res.impl == "flashinfer/cute-dsl sm90"


def test_flashinfer_impl_names_the_context_parallel_kernel(monkeypatch, hopper):
    engine_stubs.install_flashinfer(monkeypatch, cp=True)
    res = get_backend("flashinfer").run(make_inputs(DENSE))
    assert res.impl == "flashinfer/cute-dsl sm90 context-parallel"
    assert fi_mod.describe(["cute-dsl sm90", "warning: CP ... falling back"]) == \
        "flashinfer/cute-dsl sm90 (CP ... falling back)"


def test_flashinfer_kernel_globals_are_restored(monkeypatch, hopper):
    engine_stubs.install_flashinfer(monkeypatch)
    import sys

    mod = sys.modules["flashinfer.gdn_prefill"]
    before = mod.chunk_gated_delta_rule_sm90
    get_backend("flashinfer").run(make_inputs(DENSE))
    assert mod.chunk_gated_delta_rule_sm90 is before


def test_log_space_gate_would_give_nan(monkeypatch, hopper):
    """The stand-in takes linear-space gates like FlashInfer: log-space g passed as alpha (flashinfer #2490) turns
    into NaN gates, so the exp(g) conversion is what makes the answer right."""
    rec = engine_stubs.install_flashinfer(monkeypatch)
    get_backend("flashinfer").run(make_inputs(DENSE))
    import sys

    kw = dict(rec["kwargs"])
    kw["g"] = torch.log(kw["g"])
    with pytest.raises(ValueError, match="g contains .* NaN"):
        sys.modules["flashinfer.gdn_prefill"].chunk_gated_delta_rule(**kw)


@pytest.mark.parametrize("name,changes,words", [
    ("flashinfer", dict(dtype="fp32"), "fp16/bf16"),
    ("flashinfer", dict(K=64, V=64), "K=V=128"),
    ("flashinfer", dict(dist="qwen-gates-kernel"), "in-kernel gate"),
    ("flashinfer-cake", {}, "Cake GDN supports only SM100a/SM103a"),
    ("cudnn", {}, "gdn has no cuDNN backend lowering"),
])
def test_unsupported_on_hopper_with_the_reason(monkeypatch, hopper, name, changes, words):
    engine_stubs.install_flashinfer(monkeypatch)
    be = get_backend(name)
    assert be.available()[0]
    ok, reason = be.supports(DENSE.replace(**changes), CPU)
    assert not ok and words in reason


def test_cake_and_cudnn_run_where_the_package_says_they_do(monkeypatch):
    rec = engine_stubs.install_flashinfer(monkeypatch)
    monkeypatch.setattr(fi_mod, "cuda_capability", lambda: (10, 0))
    for name, backend in (("flashinfer-cake", "cake_gdn"), ("cudnn", "cudnn")):
        be = get_backend(name)
        assert be.supports(DENSE, CPU) == (True, "")
        res = be.run(make_inputs(DENSE))
        assert rec["kwargs"]["backend"] == backend
        assert _rel(res.o, _expected(DENSE)[0]) < 1e-2
        assert res.impl == {"cake_gdn": "flashinfer[cake_gdn]/cake_gdn",
                            "cudnn": "flashinfer[cudnn]/cudnn fused engine"}[backend]


def test_flashinfer_is_forward_only_and_needs_a_gpu(monkeypatch):
    engine_stubs.install_flashinfer(monkeypatch)
    monkeypatch.setattr(fi_mod, "cuda_capability", lambda: None)
    for name in ("flashinfer", "flashinfer-cake", "cudnn"):
        be = BACKENDS[name]()
        assert not be.has_backward
        ok, reason = be.available()
        assert not ok and "no CUDA GPU" in reason


def test_flashinfer_missing_package_is_unavailable(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("flashinfer") else real(n, *a))
    ok, reason = get_backend("flashinfer").available()
    assert not ok and "flashinfer-python is not installed" in reason


ENGINES = {
    "vllm-fla": ("vllm", "vllm.model_executor.layers.fla.ops", "vllm.model_executor.layers.fla.ops.fused_gdn_gating",
                 False),
    "sglang-fla": ("sglang", "sglang.srt.layers.attention.fla.chunk",
                   "sglang.srt.layers.attention.fla.fused_gdn_gating", True),
}


@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("v_first", [False, True])
def test_engine_fla_copies_pack_and_follow_the_documented_state_layout(monkeypatch, hopper, name, v_first):
    package, chunk, gating, beta_of_b = ENGINES[name]
    rec = engine_stubs.install_fla_copy(monkeypatch, package, chunk, gating, v_first, beta_of_b)
    be = get_backend(name)
    assert be.available() == (True, "")
    case = DENSE.replace(h0_dtype="fp32")
    inp = make_inputs(case)
    res = be.run(inp)
    kw = rec["kwargs"]
    assert kw["q"].shape == (1, case.B * case.T, case.H, case.K)
    assert torch.equal(kw["cu_seqlens"], torch.arange(0, (case.B + 1) * case.T, case.T))
    assert torch.equal(kw["g"], inp.g.reshape(1, -1, case.HV))  # log space, as given
    want_h0 = inp.initial_state.transpose(-1, -2) if v_first else inp.initial_state
    assert torch.equal(kw["initial_state"], want_h0)
    o, ht = _expected(case)
    assert _rel(res.o, o) < 1e-2 and _rel(res.final_state, ht) < 1e-5
    assert res.impl == f"{package}/fla-copy"


@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_fla_copies_compute_in_kernel_gates_with_the_engines_gating(monkeypatch, hopper, name):
    package, chunk, gating, beta_of_b = ENGINES[name]
    rec = engine_stubs.install_fla_copy(monkeypatch, package, chunk, gating, False, beta_of_b)
    case = DENSE.replace(dist="qwen-gates-kernel")
    inp = make_inputs(case)
    res = get_backend(name).run(inp)
    assert rec["gating"]["a"].shape == (case.B * case.T, case.HV)
    assert rec["kwargs"]["beta"].dtype == (inp.beta.dtype if beta_of_b else torch.float32)
    assert _rel(res.o, _expected(case)[0]) < 2e-2


@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_fla_unavailable_without_the_package_and_fp32_unsupported(monkeypatch, hopper, name):
    import importlib.util

    package = ENGINES[name][0]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))
    ok, reason = get_backend(name).available()
    assert not ok and f"package {package} is not installed" in reason
    ok, reason = get_backend(name).supports(DENSE.replace(dtype="fp32"), CPU)
    assert not ok and "fp16/bf16" in reason


def test_cake_check_that_does_not_import_is_a_reason_not_a_crash(monkeypatch, hopper):
    import sys

    engine_stubs.install_flashinfer(monkeypatch)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.cake_gdn", None)  # import raises ImportError
    ok, reason = get_backend("flashinfer-cake").supports(DENSE, CPU)
    assert not ok and "does not import" in reason


def test_forward_benchmark_times_the_flashinfer_paths_that_run_here(monkeypatch, hopper):
    """bench_kernels_fwd's FlashInfer columns: the paths that run on this GPU (Cake and cuDNN skipped on SM90 with
    their reasons), checked through the adapter and timed through a call on inputs converted once."""
    from benchmarks import bench_kernels_fwd as bench

    rec = engine_stubs.install_flashinfer(monkeypatch)
    cols, why = bench.flashinfer_columns(CPU)
    assert list(cols) == ["flashinfer"]
    assert "SM100a/SM103a" in why["flashinfer-cake"] and "cuDNN" in why["cudnn"]
    inp = make_inputs(DENSE.replace(h0_dtype=None, B=1))
    call = cols["flashinfer"].prepared_call(bench.gdn_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta))
    o, ht = call()
    assert o.shape == (DENSE.T, DENSE.HV, DENSE.V) and ht.shape == (1, DENSE.HV, DENSE.V, DENSE.K)
    assert torch.equal(rec["kwargs"]["g"], torch.exp(inp.g.float()).reshape(DENSE.T, DENSE.HV))
    o2, ht2 = bench._outputs(cols["flashinfer"].run(bench.gdn_inputs(inp.q, inp.k, inp.v, inp.g, inp.beta)))
    assert torch.equal(o2.reshape(o.shape), o) and torch.equal(ht2.transpose(-1, -2), ht)
