"""A backend's backward runs inside its ``backward_context`` (autograd calls it after ``_forward`` returned, so a
context opened in ``_forward`` does not cover it: FLA's backward dispatches its sub-kernels at call time), and what
the context notes is recorded in the run's ``impl``."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from cases import Case
from cases.inputs import make_inputs
from parity.backends.reference import TorchEmulated
from parity.refs import grad_outputs


class _Probe(torch.autograd.Function):
    """Identity; its backward records whether the backend's backward context was open."""

    @staticmethod
    def forward(ctx, x, backend):
        ctx.backend = backend
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.backend.seen.append(ctx.backend.inside)
        return g, None


class Probing(TorchEmulated):
    name = "fake-probing"
    has_backward = True

    def __init__(self, note_impl=None):
        self.inside, self.seen, self.note_impl = False, [], note_impl

    def _forward(self, inputs):
        o, ht, impl = super()._forward(inputs)
        return _Probe.apply(o, self), ht, impl

    @contextlib.contextmanager
    def backward_context(self):
        self.inside = True
        note = {}
        try:
            yield note
        finally:
            self.inside = False
        if self.note_impl:
            note["impl"] = self.note_impl


CASE = Case(T=65, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates", grad=True)


def test_the_backward_runs_inside_the_backends_backward_context_and_its_note_is_recorded():
    inputs = make_inputs(CASE)
    plain = TorchEmulated().run(inputs, grad_outputs(CASE, inputs))
    b = Probing("fake/bwd")
    res = b.run(inputs, grad_outputs(CASE, inputs))
    assert b.seen == [True] and not b.inside
    assert res.impl == f"{plain.impl}; backward: fake/bwd"
    for name, grad in plain.grads.items():
        assert torch.equal(res.grads[name], grad), name
    b = Probing(None)                                   # nothing noted: the forward's impl alone
    assert b.run(inputs, grad_outputs(CASE, inputs)).impl == plain.impl and b.seen == [True]
    assert b.run(inputs).grads is None and b.seen == [True]        # no grad outputs: no backward


def _common_tilelang_backend():
    pytest.importorskip("fla")
    import fla.ops.gated_delta_rule  # noqa: F401  (registers FLA's dispatch backends)
    from parity.backends.fla_common import _registered_backends

    found = [b for op, bt, b in _registered_backends() if (op, bt) == ("common", "tilelang")]
    if not found:
        pytest.skip("this fla-core registers no common TileLang backend")
    return found[0]


def test_triton_backward_switches_everything_off_where_fla_runs_its_triton_dqkwg(monkeypatch):
    backend = _common_tilelang_backend()
    import fla.utils

    from parity.backends import fla_common

    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", False)
    assert fla_common.triton_refuses_gated_dqkwg() is None
    with fla_common.triton_backward() as note:
        assert os.environ["FLA_TILELANG"] == "0" and os.environ["FLA_FLASH_QLA"] == "0"
        assert backend.get_implementation("chunk_bwd_dqkwg") is None
    assert note == {}


def test_triton_backward_lets_only_the_tilelang_dqkwg_through_where_fla_refuses_its_triton_one(monkeypatch):
    """Hopper with Triton in [3.4, 3.7.1): FLA raises instead of running its Triton gated chunk_bwd_dqkwg, so that
    sub-kernel, and nothing else, goes to FLA's TileLang kernel, and the note names it."""
    backend = _common_tilelang_backend()
    import fla.utils

    from parity.backends import fla_common

    for flag, val in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        monkeypatch.setattr(fla.utils, flag, val)
    why = fla_common.triton_refuses_gated_dqkwg()
    assert why and "#640" in why
    monkeypatch.setattr(type(backend), "chunk_bwd_dqkwg", lambda self, *a, **k: "tilelang-ran", raising=False)
    monkeypatch.setattr(type(backend), "chunk_fwd_o", lambda self, *a, **k: "must-not-run", raising=False)
    before = dict(os.environ)
    with fla_common.triton_backward() as note:
        assert os.environ["FLA_TILELANG"] == "1" and os.environ["FLA_FLASH_QLA"] == "0"
        assert backend.get_implementation("chunk_fwd_o") is None
        assert backend.get_implementation("chunk_bwd_dqkwg")() == "tilelang-ran"
    assert note["impl"] == f"fla/triton + common.chunk_bwd_dqkwg->tilelang ({why})"
    assert {k: os.environ.get(k) for k in before} == before and set(os.environ) == set(before)


def test_tilelang_records_the_fused_backward_where_it_is_dispatched():
    """The ``tilelang`` backend's gradient runs record ``backward: gdn-parity/tilelang fused one-term fp16`` where
    the call's backward is the fused plan (bf16, K = 128, 128 or more (value head, sequence) pairs), nothing beside
    the forward's impl elsewhere (CPU tensors: the Function runs the emulations, which follow the same dispatch)."""
    from kernels.plan import FUSED_MIN_CTAS
    from parity.backends.tilelang import FUSED_IMPL, TileLangKernels

    fused = Case(B=FUSED_MIN_CTAS // 32, T=16, H=16, HV=32, dtype="bf16", grad=True)
    split = Case(B=1, T=16, H=16, HV=32, dtype="bf16", grad=True)
    b = TileLangKernels()
    impls = []
    for case in (fused, split):
        inputs = make_inputs(case)
        res = b.run(inputs, grad_outputs(case, inputs))
        assert all(torch.isfinite(g).all() for g in res.grads.values()), case.id
        impls.append(res.impl)
    assert impls == [f"gdn-parity/tilelang; backward: {FUSED_IMPL}", "gdn-parity/tilelang"]
