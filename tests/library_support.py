"""Cases and checks shared by the tests of the ``torch.library`` GDN ops (``kernels.library``) on the CPU and the
GPU: a case is a frozen value with a stable id; its inputs depend only on (case, device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cases.case import Case
from cases.distributions import get_distribution
from cases.layouts import get_layout
from tests import kernel_support as tt


@dataclass(frozen=True)
class OpCase:
    """One call of ``kernels.chunk_gated_delta_rule``: the inputs of the ``cases.Case`` ``case`` (with its output
    gradients, ``tests.kernel_support.bwd_args``); ``final``: output_final_state; ``empty``: every sequence cut to
    zero tokens (cu_seqlens all 0, T = 0), an input no layout draws."""
    id: str
    case: Case
    final: bool = True
    empty: bool = False

    @property
    def varlen(self) -> bool:
        return get_layout(self.case.layout).varlen

    B = property(lambda self: self.case.B)
    T = property(lambda self: 0 if self.empty else self.case.T)
    HV = property(lambda self: self.case.HV)
    vf = property(lambda self: self.case.state_v_first)
    l2 = property(lambda self: get_distribution(self.case.dist).qk_l2norm_in_kernel)
    h0 = property(lambda self: self.case.h0_dtype)

    def inputs(self, device):
        """((q, k, v, g, beta), do, dht or None, kwargs of the call) on ``device``."""
        xs, kw, do, dht = tt.bwd_args(self.case, device)
        xs, kw = list(xs), dict(kw, output_final_state=self.final)
        if self.empty:
            xs, do = [x[:, :0].contiguous() for x in xs], do[:, :0].contiguous()
            kw["cu_seqlens"] = torch.zeros_like(kw["cu_seqlens"])
        return xs, do, dht if self.final else None, kw

    def chunks(self, cu_seqlens) -> int:
        """Chunks of 64 tokens of the call (per sequence for varlen input)."""
        if cu_seqlens is None:
            return self.B * -(-self.T // 64)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return sum(-(-n // 64) for n in lens)


def results(fn, case: OpCase, device, *, grad: bool = True) -> dict:
    """{name: tensor}: o (and the final state) of ``fn`` (the public signature) on the case's inputs and, with
    ``grad``, the gradients of every input (and of the initial state) for the case's ``do`` / ``dht``."""
    xs, do, dht, kw = case.inputs(device)
    leaves = [x.detach().clone().requires_grad_(grad) for x in xs]
    h0 = kw["initial_state"]
    if h0 is not None:
        kw["initial_state"] = h0 = h0.detach().clone().requires_grad_(grad)
    o, ht = fn(*leaves, **kw)
    out = {"o": o} if ht is None else {"o": o, "final_state": ht}
    if grad:
        wrt = leaves + ([h0] if h0 is not None else [])
        outs, gouts = (o,) if ht is None else (o, ht), (do,) if ht is None else (do, dht)
        names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 is not None else [])
        out.update(zip(names, torch.autograd.grad(outs, wrt, gouts)))
    return out


def assert_same(got: dict, want: dict, case: OpCase, where: str, rerun: str):
    """Every tensor of ``want`` is in ``got`` with the same shape and dtype and bitwise the same values."""
    assert got.keys() == want.keys(), f"outputs {sorted(got)} != {sorted(want)} | case {case.id} | {where}"
    for name, w in want.items():
        a = got[name]
        assert a.shape == w.shape and a.dtype == w.dtype, \
            f"{name}: {tuple(a.shape)} {a.dtype} != {tuple(w.shape)} {w.dtype} | case {case.id} | {where} | {rerun}"
        if not torch.equal(a, w):
            d = (a.double() - w.double()).abs().nan_to_num(float("inf")).max().item()
            raise AssertionError(f"{name}: max|diff| {d:.3e} > 0 | case {case.id} | {where} | rerun: {rerun}")
