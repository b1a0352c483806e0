"""The fp64 ground truth of a case: computed once with the chunked fp64 reference on the run device and
cached on disk (safetensors), keyed by the case id and REF_VERSION, so reruns and later backends reuse it.

Gradient cases also get deterministic output gradients (do, dht), drawn from the case like its
inputs, and the reference gradients through fp64 autograd.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import reference
from cases.case import Case
from cases.dtypes import to_torch
from cases.inputs import GDNInputs, draw_seed
from parity.backends.base import GRAD_TENSORS

# Bump when reference/, cases/inputs.py or the distributions change what a case id means.
REF_VERSION = "chunk-fp64-v1"
DEFAULT_CACHE = Path(os.environ.get("GDN_PARITY_CACHE", Path.home() / ".cache" / "gdn-parity" / "ref"))
MAX_ENTRY_BYTES = int(os.environ.get("GDN_PARITY_CACHE_MAX_ENTRY", 1 << 30))


@dataclass
class Reference:
    """tensors: {'o', 'ht', 'dq', ...} in fp64 on the run device; seconds: time to compute or load; source."""

    tensors: dict[str, torch.Tensor]
    seconds: float
    source: str


def tensor_names(case: Case, inputs: GDNInputs | None = None) -> list[str]:
    """The tensors a case is judged on: o and the final state ht, plus the gradients for grad cases."""
    names = ["o", "ht"]
    if case.grad:
        names += ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if case.h0_dtype is not None else [])
    return names


def output_dtype(case: Case, tensor: str) -> torch.dtype:
    """The dtype a kernel returns ``tensor`` in: o and dq/dk/dv in the input dtype, the final state in fp32,
    dg/dbeta/dh0 in their input's dtype. The rounding floor rounds the fp64 reference to it."""
    return {
        "o": to_torch(case.dtype), "ht": torch.float32, "dq": to_torch(case.dtype), "dk": to_torch(case.dtype),
        "dv": to_torch(case.dtype), "dg": to_torch(case.g_dtype), "dbeta": to_torch(case.beta_dtype),
        "dh0": to_torch(case.h0_dtype or "fp32"),
    }[tensor]


def grad_outputs(case: Case, inputs: GDNInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(do [B, T, HV, V] in the input dtype, dht like the state in fp32), drawn from the case, on the inputs' device."""
    gen = torch.Generator().manual_seed(draw_seed(case) ^ 0x5EED)
    do = torch.randn(tuple(inputs.v.shape), generator=gen).to(to_torch(case.dtype))
    N = len(inputs.seq_lens)
    shape = (N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V)
    dht = torch.randn(shape, generator=gen)
    return do.to(inputs.q.device), dht.to(inputs.q.device)


def compute(case: Case, inputs: GDNInputs) -> dict[str, torch.Tensor]:
    """The fp64 chunked reference (and fp64 autograd gradients for grad cases) on the inputs' device."""
    kw = inputs.reference_kwargs()
    if not case.grad:
        with torch.no_grad():
            o, ht = reference.chunk_gated_delta_rule(**kw)
        return {"o": o, "ht": ht}
    leaves = {n: getattr(inputs, n).detach().to(torch.float64).requires_grad_(True) for n in inputs.grad_names}
    kw.update(leaves)
    with torch.enable_grad():
        o, ht = reference.chunk_gated_delta_rule(**kw)
        do, dht = grad_outputs(case, inputs)
        torch.autograd.backward([o, ht], [do.to(torch.float64), dht.to(torch.float64)])
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({GRAD_TENSORS[n]: leaf.grad for n, leaf in leaves.items()})
    return out


class RefCache:
    """Reference tensors on disk, one safetensors file per case. Entries over ``max_entry_bytes`` are not stored."""

    def __init__(self, root: str | os.PathLike | None = DEFAULT_CACHE, max_entry_bytes: int = MAX_ENTRY_BYTES):
        self.root = Path(root) if root is not None else None
        self.max_entry_bytes = max_entry_bytes

    def path(self, case: Case) -> Path:
        key = hashlib.sha256(f"{REF_VERSION}|{case.id}".encode()).hexdigest()[:16]
        return self.root / REF_VERSION / f"{case.id[:150]}-{key}.safetensors"

    def load(self, case: Case, device) -> dict[str, torch.Tensor] | None:
        if self.root is None:
            return None
        p = self.path(case)
        if not p.exists():
            return None
        from safetensors.torch import load_file

        try:
            return load_file(str(p), device=str(device))
        except Exception:  # a damaged entry is recomputed, never trusted
            p.unlink(missing_ok=True)
            return None

    def store(self, case: Case, tensors: dict[str, torch.Tensor]) -> bool:
        if self.root is None:
            return False
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.max_entry_bytes:
            return False
        from safetensors.torch import save_file

        p = self.path(case)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")    # one per process: pytest-xdist workers share the cache
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, p)
        return True


def get_reference(case: Case, inputs: GDNInputs, cache: RefCache | None) -> Reference:
    """From the cache when present, else computed (and stored). Times the whole thing, synchronised."""
    device = inputs.q.device
    t0 = time.perf_counter()
    tensors = cache.load(case, device) if cache is not None else None
    source = "cache"
    if tensors is None:
        tensors = compute(case, inputs)
        source = "computed"
        if cache is not None:
            cache.store(case, tensors)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Reference(tensors=tensors, seconds=time.perf_counter() - t0, source=source)
