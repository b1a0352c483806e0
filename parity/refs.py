"""The fp64 ground truth of a case: computed once with the chunked fp64 reference on the run device and
cached on disk (safetensors) so reruns and later backends reuse it.

A cache entry is keyed and verified by ``input_key``: a sha256 of REF_VERSION, every input tensor's name, dtype,
shape and bytes, the flags of the call (scale, initial state, l2norm, in-kernel gate and beta, state layout,
cu_seqlens) and, for gradient cases, the output gradients. The entry's metadata holds that key and a sha256 of its
own tensors; an entry whose key, version, tensor names, shapes or bytes do not match (another input, another
reference version, a truncated or damaged file) is never used: the reference is recomputed and the Reference's
``source`` says why (``recomputed: ...``), which the run records in the floor rows' ``ref_source``.

Gradient cases also get deterministic output gradients (do, dht), drawn from the case like its
inputs, and the reference gradients through fp64 autograd.
"""

from __future__ import annotations

import hashlib
import json
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

# Bump when reference/ changes what the fp64 reference computes from the same inputs (result files of another
# version are not compared, parity.compare).
REF_VERSION = "chunk-fp64-v1"
ENTRY_FORMAT = "gdn-parity-ref"
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


def digest(tensors: dict[str, torch.Tensor | None], settings: dict) -> str:
    """sha256 over the settings (JSON) and every tensor's name, dtype, shape and bytes (None: the name only)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name]
        if t is None:
            h.update(f"|{name}|none|".encode())
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def input_key(case: Case, inputs: GDNInputs) -> str:
    """The cache key of the reference of ``inputs``: REF_VERSION, the input tensors, the flags and, for gradient
    cases, the output gradients and the tensor names."""
    tensors = dict(inputs._tensors())
    if case.grad:
        tensors["grad_do"], tensors["grad_dht"] = grad_outputs(case, inputs)
    flags = {k: v for k, v in inputs.kwargs().items() if not isinstance(v, torch.Tensor) and v is not None}
    settings = {"ref_version": REF_VERSION, "scale": inputs.scale, "names": tensor_names(case, inputs), **flags}
    return digest(tensors, settings)


def expected_shapes(case: Case, inputs: GDNInputs) -> dict[str, tuple[int, ...]]:
    """The shape of every reference tensor of ``case`` on ``inputs``."""
    v = inputs.v
    N = len(inputs.seq_lens)
    state = (N, v.shape[2], v.shape[3], inputs.q.shape[3]) if inputs.state_v_first else \
        (N, v.shape[2], inputs.q.shape[3], v.shape[3])
    shapes = {"o": tuple(v.shape), "ht": state}
    for t, n in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ("q", "k", "v", "g", "beta", "initial_state")):
        if getattr(inputs, n) is not None:
            shapes[t] = tuple(getattr(inputs, n).shape)
    return {t: shapes[t] for t in tensor_names(case, inputs)}


class RefCache:
    """Reference tensors on disk, one safetensors file per (case, input key). Entries over ``max_entry_bytes`` are
    not stored. ``load`` returns (tensors or None, why not); a mismatching entry is never returned."""

    def __init__(self, root: str | os.PathLike | None = DEFAULT_CACHE, max_entry_bytes: int = MAX_ENTRY_BYTES):
        self.root = Path(root) if root is not None else None
        self.max_entry_bytes = max_entry_bytes

    def path(self, case: Case, key: str) -> Path:
        """The entry of ``case`` with input key ``key`` (input_key)."""
        return self.root / REF_VERSION / f"{case.id[:150]}-{key[:24]}.safetensors"

    def load(self, case: Case, inputs: GDNInputs, device, key: str | None = None
             ) -> tuple[dict[str, torch.Tensor] | None, str]:
        """(tensors, "") from a verified entry, or (None, why): "absent", or what did not match."""
        if self.root is None:
            return None, "no cache"
        key = key or input_key(case, inputs)
        p = self.path(case, key)
        if not p.exists():
            return None, "absent"
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as err:  # noqa: BLE001 - a damaged entry is recomputed, never trusted
            return None, f"unreadable entry {p.name} ({type(err).__name__})"
        why = self._mismatch(meta, tensors, key, expected_shapes(case, inputs))
        if why:
            return None, f"entry {p.name}: {why}"
        return {k: t.to(device) for k, t in tensors.items()}, ""

    @staticmethod
    def _mismatch(meta: dict, tensors: dict, key: str, shapes: dict) -> str:
        if meta.get("format") != ENTRY_FORMAT or meta.get("ref_version") != REF_VERSION:
            return (f"reference version {meta.get('ref_version')!r} ({meta.get('format')!r}), this harness "
                    f"computes {REF_VERSION!r}")
        if meta.get("input_key") != key:
            return "computed from other inputs or flags (input key differs)"
        if set(tensors) != set(shapes):
            return f"holds {sorted(tensors)}, the case needs {sorted(shapes)}"
        bad = [t for t in shapes if tuple(tensors[t].shape) != shapes[t] or tensors[t].dtype != torch.float64]
        if bad:
            return f"{bad[0]} is {tuple(tensors[bad[0]].shape)} {tensors[bad[0]].dtype}, expected {shapes[bad[0]]}"
        if meta.get("tensors_sha256") != digest(tensors, {}):
            return "its tensors do not match their checksum (damaged)"
        return ""

    def store(self, case: Case, inputs: GDNInputs, tensors: dict[str, torch.Tensor], key: str | None = None) -> bool:
        """Write the entry (atomically); False when there is no cache or it is over ``max_entry_bytes``."""
        if self.root is None:
            return False
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if nbytes > self.max_entry_bytes:
            return False
        from safetensors.torch import save_file

        key = key or input_key(case, inputs)
        cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        meta = {"format": ENTRY_FORMAT, "ref_version": REF_VERSION, "input_key": key, "case_id": case.id,
                "tensors_sha256": digest(cpu, {})}
        p = self.path(case, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")    # one per process: pytest-xdist workers share the cache
        save_file(cpu, str(tmp), metadata=meta)
        os.replace(tmp, p)
        return True


def get_reference(case: Case, inputs: GDNInputs, cache: RefCache | None) -> Reference:
    """From a verified cache entry when there is one, else computed (and stored). ``source`` is "cache",
    "computed" or "recomputed: <why the entry was not used>". Times the whole thing, synchronised."""
    device = inputs.q.device
    t0 = time.perf_counter()
    tensors, why, key = None, "absent", None
    if cache is not None and cache.root is not None:
        key = input_key(case, inputs)
        tensors, why = cache.load(case, inputs, device, key)
    source = "cache"
    if tensors is None:
        tensors = compute(case, inputs)
        source = "computed" if why in ("absent", "no cache") else f"recomputed: {why}"
        if cache is not None:
            cache.store(case, inputs, tensors, key)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Reference(tensors=tensors, seconds=time.perf_counter() - t0, source=source)
