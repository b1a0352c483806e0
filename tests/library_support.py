"""Cases and checks shared by the tests of the ``torch.library`` GDN ops (``kernels.library``) on the CPU and the
GPU: a case is a frozen value with a stable id; its inputs depend only on (case, device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests import kernel_support as tt


@dataclass(frozen=True)
class OpCase:
    """One call of ``kernels.chunk_gated_delta_rule``: dense ``[B, T]`` or varlen ``lens`` (B = 1), H q/k heads,
    HV value heads, head dim D; ``h0``: initial state scale (None: no initial state); ``final``: output_final_state;
    ``vf``: state_v_first; ``l2``: use_qk_l2norm_in_kernel."""
    id: str
    B: int = 1
    T: int = 100
    lens: tuple | None = None
    H: int = 1
    HV: int = 2
    D: int = 64
    h0: float | None = None
    final: bool = True
    vf: bool = False
    l2: bool = False

    def inputs(self, device):
        """((q, k, v, g, beta), do, dht or None, kwargs of the call) on ``device``."""
        xs, do, dht, kw = tt.bwd_inputs(self.B, self.T, self.H, self.HV, D=self.D,
                                        lens=None if self.lens is None else list(self.lens), h0=self.h0, vf=self.vf,
                                        l2=self.l2)
        move = lambda x: None if x is None else x.to(device)   # noqa: E731
        kw = {n: move(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        kw["output_final_state"] = self.final
        return [move(x) for x in xs], move(do), move(dht) if self.final else None, kw


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
