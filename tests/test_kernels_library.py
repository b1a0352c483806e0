"""The GDN ops registered through ``torch.library`` (``kernels.library``) on the CPU, where they run the torch
emulations of the kernels: ``torch.compile(fullgraph=True)`` of a function calling ``kernels.chunk_gated_delta_rule``
traces without a graph break and equals eager (outputs and gradients, bitwise) for dense and varlen input, with and
without initial and final state; ``torch.library.opcheck`` passes on both ops; the op runs under
``torch.inference_mode()`` and ``torch.no_grad()``; the fake implementation's kept-table sizes follow the backward's
rule.  ``aot_eager`` is the compile backend here (fake tensors, AOTAutograd, no C++ build); the GPU file uses
inductor."""

from __future__ import annotations

import types

import pytest
import torch

from cases.case import Case
from tests.library_support import OpCase, assert_same, results

CASES = [
    OpCase("dense_B2_h0_final", Case(B=2, T=70, H=1, HV=2, K=64, V=64, h0_dtype="fp32", grad=True)),
    OpCase("dense_no_h0_no_final", Case(T=100, H=1, HV=2, K=64, V=64, grad=True), final=False),
    OpCase("varlen_empty_h0_vfirst_final", Case(layout="varlen-empty", T=100, H=1, HV=2, K=64, V=64,
                                                h0_dtype="fp32", state_v_first=True, grad=True)),
    OpCase("varlen_l2_no_h0_no_final", Case(layout="varlen-boundary", T=100, H=2, HV=4, K=64, V=64,
                                            dist="raw-qk-l2", grad=True), final=False),
]
CPU = torch.device("cpu")


def _rerun(test: str, case: OpCase) -> str:
    return f"pytest tests/test_kernels_library.py::{test} -k {case.id}"


def _compiled():
    import kernels
    torch._dynamo.reset()
    return torch.compile(kernels.chunk_gated_delta_rule, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compile_fullgraph_equals_eager(case):
    """fullgraph=True raises on any graph break; the compiled outputs and gradients equal eager's bitwise, and
    eager equals the emulation's autograd Function (the CPU op runs the emulation)."""
    import kernels
    from kernels.autograd import apply

    eager = results(kernels.chunk_gated_delta_rule, case, CPU)
    assert_same(results(_compiled(), case, CPU), eager, case, "compiled (aot_eager) vs eager",
                _rerun("test_compile_fullgraph_equals_eager", case))
    assert_same(eager, results(lambda *a, **kw: apply(*a, **kw, impl="emulation"), case, CPU), case,
                "op vs autograd.apply(impl='emulation')", _rerun("test_compile_fullgraph_equals_eager", case))


def test_dynamo_explain_sees_one_graph_without_breaks():
    import kernels

    (q, k, v, g, beta), _, _, kw = CASES[2].inputs(CPU)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(kernels.chunk_gated_delta_rule)(q, k, v, g, beta, **kw)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, (ex.graph_break_count, ex.graph_count,
                                                               ex.break_reasons)
    ops = [n.target for gm in ex.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.gdn_parity.chunk_gdr_fwd.default in ops, ops


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_opcheck(case):
    """``torch.library.opcheck``: schema, autograd registration, fake vs real outputs (shapes, dtypes, strides),
    AOT dispatch with dynamic shapes, for the forward (keeping tables, inputs requiring grad) and the backward."""
    from kernels.library import chunk_gdr_bwd, chunk_gdr_fwd

    xs, do, dht, kw = case.inputs(CPU)
    xs = [x.requires_grad_() for x in xs]
    h0, cu = kw["initial_state"], kw["cu_seqlens"]
    flags = (case.final, case.l2, case.vf)
    fwd_args = (*xs, h0, cu, None, *flags, True)
    out = torch.library.opcheck(chunk_gdr_fwd, fwd_args)
    assert set(out.values()) == {"SUCCESS"}, out
    _, _, *tables = (t.detach() for t in chunk_gdr_fwd(*fwd_args))
    bwd_args = (*[x.detach() for x in xs], do, dht, h0, cu, *tables, 0.125, case.l2, case.vf)
    out = torch.library.opcheck(chunk_gdr_bwd, bwd_args)
    assert set(out.values()) == {"SUCCESS"}, out


def test_opcheck_strided_initial_state_without_tokens():
    """A call without tokens returns (a copy of) the initial state: contiguous like the fake's, also for a strided
    initial state."""
    from kernels.library import chunk_gdr_fwd

    case = OpCase("varlen_all_empty_strided_h0", Case(layout="varlen-ragged", T=100, H=1, HV=2, K=64, V=64,
                                                      h0_dtype="fp32", grad=True), empty=True)
    xs, _, _, kw = case.inputs(CPU)
    h0 = kw["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    out = torch.library.opcheck(chunk_gdr_fwd, (*[x.requires_grad_() for x in xs], h0, kw["cu_seqlens"], None, True,
                                                False, False, True))
    assert set(out.values()) == {"SUCCESS"}, out


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[CASES[0].id, CASES[2].id])
def test_inference_mode_and_no_grad(case):
    """Under inference_mode (inputs and cu_seqlens made there, as engines make them) and no_grad the op gives the
    grad-enabled eager outputs bitwise, and none requires grad."""
    import kernels

    want = results(kernels.chunk_gated_delta_rule, case, CPU, grad=False)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            xs, _, _, kw = case.inputs(CPU)
            got = results(kernels.chunk_gated_delta_rule, case, CPU, grad=False)
            o, _ = kernels.chunk_gated_delta_rule(*[x.requires_grad_() if mode is torch.no_grad else x for x in xs],
                                                  **kw)
        assert not o.requires_grad
        assert_same(got, want, case, f"under {mode.__name__}", _rerun("test_inference_mode_and_no_grad", case))


def test_bad_input_raises_valueerror_naming_the_argument():
    """Eager on the CPU: the ValueError of ``check_inputs``; compiled: the same message from the fake
    implementation (dynamo wraps it)."""
    import kernels

    (q, k, v, g, beta), _, _, _ = CASES[1].inputs(CPU)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV\]"):
        kernels.chunk_gated_delta_rule(q, k, v, g[:, :50], beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 64, 64))
    with pytest.raises(Exception, match=r"g must be \[B, T, HV\]"):
        _compiled()(q, k, v, g[:, :50], beta)
    with pytest.raises(ValueError, match="cu_seqlens must be a torch.Tensor or None, got list"):
        kernels.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, 100])
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got NoneType"):
        kernels.chunk_gated_delta_rule(None, k, v, g, beta)


def _like(shape, device, dtype=torch.bfloat16):
    return types.SimpleNamespace(shape=torch.Size(shape), device=torch.device(device), dtype=dtype,
                                 dim=lambda: len(shape))


def test_dense_kept_chunks_follows_the_backward(monkeypatch):
    """``dense_kept_chunks`` (the fake's table size for dense input, host arithmetic) agrees with
    ``backward.pipeline.reads_saved_tables`` (what the forward asks) on a sequential and a segmented layout."""
    from kernels.backward import dh_segmented
    from kernels.backward import pipeline as bapi
    from kernels.library import dense_kept_chunks

    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 132)
    B, T, H, HV = 1, 64 * 100, 1, 2
    q, v = torch.empty(B, T, H, 64, dtype=torch.bfloat16), torch.empty(B, T, HV, 64, dtype=torch.bfloat16)
    qc, vc = _like(q.shape, "cuda"), _like(v.shape, "cuda")
    for segmented in (False, True):
        if segmented:
            monkeypatch.setattr(dh_segmented, "MIN_CHUNKS", 1)
            monkeypatch.setattr(dh_segmented, "MIN_SEQ_CHUNKS", 1)
        assert bapi.reads_saved_tables(q)          # the sequential and the warm segmented pass
        assert dense_kept_chunks(qc, vc, True) == B * 100
    assert dense_kept_chunks(qc, vc, False) == 0                          # no gradient asked
    assert dense_kept_chunks(q, v, True) == 0                             # the CPU forward keeps none


def test_fake_gives_exact_shapes_on_cuda_tensors(monkeypatch):
    """Fake CUDA tensors (no GPU needed): final state in the caller's layout, kept tables [HV, n, 64, 64] with n
    the chunk count for dense input, an unbacked size for varlen input, and 0 when no gradient is asked."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kernels.backward import pipeline as bapi
    from kernels.library import chunk_gdr_fwd

    monkeypatch.setattr(bapi, "_sm_count", lambda dev: 132)

    with FakeTensorMode(shape_env=ShapeEnv()):
        q = torch.empty(1, 100, 1, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(1, 100, 2, 64, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(1, 100, 2, device="cuda")
        cu = torch.empty(4, device="cuda", dtype=torch.int32)
        h0 = torch.empty(3, 2, 64, 64, device="cuda")
        o, ht, *tables = chunk_gdr_fwd(q, q, v, g, g, h0, cu, None, True, False, True, True)
        assert o.shape == v.shape and o.dtype == torch.bfloat16
        assert ht.shape == (3, 2, 64, 64) and ht.dtype == torch.float32
        n = tables[0].shape[1]
        assert isinstance(n, torch.SymInt) and not isinstance(n.node.maybe_as_int(), int), n
        assert all(t.shape == (2, n, 64, 64) and t.dtype == torch.bfloat16 for t in tables)
        _, ht, *tables = chunk_gdr_fwd(q, q, v, g, g, None, cu, None, False, False, False, False)
        assert ht.shape == (0,) and all(t.shape == (2, 0, 64, 64) for t in tables)
        for keep, n in ((True, 2), (False, 0)):                                 # dense: 2 chunks of T = 100
            _, ht, *tables = chunk_gdr_fwd(q, q, v, g, g, None, None, None, True, False, False, keep)
            assert ht.shape == (1, 2, 64, 64) and all(t.shape == (2, n, 64, 64) for t in tables), (keep, tables)


def test_compile_with_data_dependent_table_size(monkeypatch):
    """The varlen forward's kept tables have an unbacked chunk count under torch.compile (on CUDA); here the fake
    says so on the CPU too (the CPU forward keeps 0 chunks, one value of that size): fullgraph compile of forward
    and backward still equals eager."""
    import kernels
    from kernels import library

    monkeypatch.setattr(library, "_KEEPS_TABLES", ("cuda", "cpu"))
    case = CASES[2]
    assert_same(results(_compiled(), case, CPU), results(kernels.chunk_gated_delta_rule, case, CPU), case,
                "compiled (aot_eager, unbacked table size) vs eager",
                "pytest tests/test_kernels_library.py::test_compile_with_data_dependent_table_size")


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """The ops' TileLang path (``_fwd_tilelang`` / ``_bwd_tilelang``) as their CPU kernels, the TileLang kernels
    replaced by their emulation stand-ins (``test_kernels_bwd_emulation._fake_kernels``), tables kept on the CPU."""
    from kernels import library
    from tests.test_kernels_bwd_emulation import _fake_kernels

    _fake_kernels(monkeypatch)
    monkeypatch.setattr(library, "_KEEPS_TABLES", ("cuda", "cpu"))
    library.chunk_gdr_fwd.register_kernel("cpu")(library._fwd_tilelang)
    library.chunk_gdr_bwd.register_kernel("cpu")(library._bwd_tilelang)
    try:
        yield library
    finally:
        library.chunk_gdr_fwd.register_kernel("cpu")(library._fwd_emulation)
        library.chunk_gdr_bwd.register_kernel("cpu")(library._bwd_emulation)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[CASES[0].id, CASES[2].id])
def test_kernel_path_keeps_tables_compiles_and_equals_the_function(kernel_path_on_cpu, case):
    """On the kernel path (stand-in kernels): the forward keeps its intra tables (dense: the count the fake
    predicts, which the op checks and opcheck compares; varlen: the sequences' chunks, a real non-zero value of the
    fake's unbacked size); eager equals the autograd Function on the same path, and fullgraph compile equals
    eager, outputs and gradients bitwise."""
    import kernels
    from kernels.autograd import apply

    library = kernel_path_on_cpu
    xs, _, _, kw = case.inputs(CPU)
    xs = [x.requires_grad_() for x in xs]
    args = (*xs, kw["initial_state"], kw["cu_seqlens"], None, case.final, case.l2, case.vf, True)
    _, _, *tables = library.chunk_gdr_fwd(*args)
    chunks = case.chunks(kw["cu_seqlens"])
    assert [tuple(t.shape) for t in tables] == [(case.HV, chunks, 64, 64)] * 3
    if not case.varlen:
        assert library.dense_kept_chunks(xs[0], xs[2], True) == chunks
        out = torch.library.opcheck(library.chunk_gdr_fwd, args, test_utils=("test_faketensor",))
        assert set(out.values()) == {"SUCCESS"}, out
    _, do, dht, _ = case.inputs(CPU)
    bwd_args = (*[x.detach() for x in xs], do, dht, kw["initial_state"], kw["cu_seqlens"],
                *[t.detach() for t in tables], 0.125, case.l2, case.vf)
    out = torch.library.opcheck(library.chunk_gdr_bwd, bwd_args, test_utils=("test_faketensor",))
    assert set(out.values()) == {"SUCCESS"}, out       # the gradients' strides are the fake's (head-dim padding)
    rerun = _rerun("test_kernel_path_keeps_tables_compiles_and_equals_the_function", case)
    eager = results(kernels.chunk_gated_delta_rule, case, CPU)
    assert_same(eager, results(apply, case, CPU), case, "op vs autograd.apply (stand-in kernels)", rerun)
    assert_same(results(_compiled(), case, CPU), eager, case, "compiled (aot_eager) vs eager (stand-in kernels)",
                rerun)


def test_compile_with_in_kernel_activations_and_padding_equals_eager():
    """FLA's in-kernel gate and beta sigmoid (plain torch before the op) and padded varlen (cu_seqlens[-1] < T)
    trace into the same single graph: compiled outputs and gradients, dA_log and ddt_bias included, equal eager's
    bitwise."""
    import kernels

    gen = torch.Generator().manual_seed(3)
    T, H, HV, D = 90, 1, 2, 64
    q, k = (torch.randn(1, T, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, D, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(1, T, HV, generator=gen), torch.randn(1, T, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen).log1p(), torch.randn(HV, generator=gen) * 0.1
    cu = torch.tensor([0, 30, 71], dtype=torch.int32)
    do = torch.randn(1, T, HV, D, generator=gen).to(torch.bfloat16)

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, a, b, A_log, dt_bias)]
        o, _ = fn(*leaves[:5], scale=0.125, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  A_log=leaves[5], dt_bias=leaves[6], use_beta_sigmoid_in_kernel=True)
        grads = torch.autograd.grad(o, leaves, do)
        return {"o": o, **dict(zip(["dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"], grads))}

    eager = run(kernels.chunk_gated_delta_rule)
    assert eager["o"][:, 71:].abs().max() == 0 and eager["dA_log"].abs().max() > 0
    got = run(_compiled())
    for name, want in eager.items():
        assert torch.equal(got[name], want), (
            f"{name}: compiled != eager | case padded-varlen in-kernel activations | "
            f"rerun: pytest tests/test_kernels_library.py -k in_kernel_activations")
