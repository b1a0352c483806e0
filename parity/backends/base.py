"""The one interface every implementation is run through.

A backend has a name, says whether it is available here (with the reason when not: no GPU, package
missing, wrong architecture), says whether it supports a case (``(ok, reason)``, so an unsupported
cell is recorded as such, never a crash), and runs a case's inputs, returning the output, the final
state, which implementation actually executed and, when asked, the gradients. GPU packages are
imported inside methods only: importing the harness never imports them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Callable

import torch

from cases.case import Case
from cases.inputs import GDNInputs

GRAD_TENSORS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}


@dataclass
class RunResult:
    """o [B, T, HV, V]; final_state [N, HV, K, V] (or V-first); grads: {'dq': .., 'dk': .., ...} or None;
    impl: the implementation that actually ran (e.g. 'fla/triton', 'fla/flash_qla'); extras: anything else
    (e.g. per-chunk states for attribution)."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    impl: str
    grads: dict[str, torch.Tensor] | None = None
    extras: dict = field(default_factory=dict)


class Backend:
    """Base class. Subclasses set ``name``, ``description``, ``has_backward`` and implement ``_forward``."""

    name: str = "base"
    description: str = ""
    conversion: str = ""  # how the adapter converts the case's inputs for the kernel (shown in the report)
    has_backward: bool = False
    needs_gpu: bool = False  # only ever runs on a GPU (others may also run on a CPU)
    packages: tuple[str, ...] = ()  # distributions whose versions the run records

    def available(self) -> tuple[bool, str]:
        """(True, note) when it can run on this machine, else (False, reason). Must not raise."""
        return True, ""

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        """(True, '') when it implements this configuration on ``device``, else (False, reason)."""
        return True, ""

    def _forward(self, inputs: GDNInputs) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """Run the forward pass; return (o, final_state, impl). Inputs are already on the run device."""
        raise NotImplementedError

    def run(self, inputs: GDNInputs, grad_outputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> RunResult:
        """Forward, and backward from (do, dht) when ``grad_outputs`` is given and the backend has one."""
        if grad_outputs is None:
            with torch.no_grad():
                o, ht, impl = self._forward(inputs)
            return RunResult(o=o, final_state=ht, impl=impl)
        if not self.has_backward:
            raise NotImplementedError(f"{self.name} has no backward")
        return run_with_grads(self._forward, inputs, grad_outputs, self.backward_context)

    @contextlib.contextmanager
    def backward_context(self):
        """The context ``torch.autograd.backward`` runs in (autograd calls the backward after ``_forward`` has
        returned, so a context ``_forward`` opens does not cover it).  Yields a dict; an ``"impl"`` the backend
        puts there is recorded after the forward's (``'<forward impl>; backward: <impl>'``).  Default: nothing."""
        yield {}

    def chunk_states(self, inputs: GDNInputs) -> tuple[torch.Tensor, str] | None:
        """The state at the start of every chunk of 64 as the implementation computes it ([B, NT, HV, K, V], dense
        inputs), and how it was obtained; None when the implementation does not expose it (the default)."""
        return None

    def versions(self) -> dict[str, str]:
        """Installed versions of ``packages`` (from package metadata; nothing is imported)."""
        return {p: package_version(p) for p in self.packages}


def package_version(dist: str) -> str:
    """The installed version of a distribution, or 'missing'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def run_with_grads(forward: Callable, inputs: GDNInputs, grad_outputs, backward_context=None) -> RunResult:
    """Make the differentiable inputs leaves, run ``forward``, backprop (do, dht) inside ``backward_context()``
    (``Backend.backward_context``; none when None) and collect dq, dk, dv, dg, dbeta (and dh0 when there is an
    initial state)."""
    do, dht = grad_outputs
    leaves = {n: getattr(inputs, n).detach().clone().requires_grad_(True) for n in inputs.grad_names}
    import dataclasses

    with torch.enable_grad():
        o, ht, impl = forward(dataclasses.replace(inputs, **leaves))
        outs, grads_in = [o], [do.to(o.dtype)]
        if ht is not None:
            outs.append(ht)
            grads_in.append(dht.to(ht.dtype))
        with backward_context() if backward_context else contextlib.nullcontext({}) as note:
            torch.autograd.backward(outs, grads_in)
    if note.get("impl") and note["impl"] != impl:
        impl = f"{impl}; backward: {note['impl']}"
    grads = {}
    for n, leaf in leaves.items():
        grads[GRAD_TENSORS[n]] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return RunResult(o=o.detach(), final_state=None if ht is None else ht.detach(), impl=impl, grads=grads)


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def unpadded(case: Case, who: str) -> tuple[bool, str]:
    """(False, reason) when the case leaves tokens past cu_seqlens[-1] (a padded varlen layout) and ``who`` gives
    no defined output there, else (True, '')."""
    from cases.layouts import get_layout
    if get_layout(case.layout).padded:
        return False, f"padded varlen (cu_seqlens[-1] < T): o and the gradients past the last sequence are not " \
                      f"defined by {who}"
    return True, ""


def all_float(case: Case, dtype: str) -> bool:
    """Every floating input of the case (q/k/v, g, beta, h0) is ``dtype``."""
    return all(d in (None, dtype) for d in (case.dtype, case.g_dtype, case.beta_dtype, case.h0_dtype))
