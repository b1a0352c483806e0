"""A backend's backward runs inside its ``backward_context`` (autograd calls it after ``_forward`` returned, so a
context opened in ``_forward`` does not cover it: FLA's backward dispatches its sub-kernels at call time), and what
the context notes is recorded in the run's ``impl``."""

from __future__ import annotations

import contextlib

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
