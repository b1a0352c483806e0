"""Attribution: at which stage, and after how many chunks, a backend's error enters.

Backends that expose their per-chunk states (FLA's chunked forward computes ``h``, the state at the start of
every chunk of 64; FlashQLA's low-level forward returns it; the emulated baseline keeps it) are compared with
the fp64 chunked reference's chunk-start states. A row with tensor ``h`` holds the usual metrics over all chunk
states plus ``chunk_rel_rmse``: rel_rmse per chunk, averaged into at most MAX_BINS equal bins of chunk index.
Flat and already large at chunk 0-1 means the error enters in the intra-chunk stage (or in the stored state's
rounding); growing with the chunk index means it accumulates in the state recurrence; small states with a large
output error put it in the output stage. Dense cases without gradients only.
"""

from __future__ import annotations

import torch

import reference
from cases.case import Case
from cases.inputs import GDNInputs
from parity import metrics
from parity.backends.base import Backend

TENSOR = "h"
MAX_BINS = 32


def eligible(case: Case) -> bool:
    return case.layout == "dense" and not case.grad


def reference_chunk_states(inputs: GDNInputs) -> torch.Tensor:
    """The fp64 chunk-start states [B, NT, HV, K, V] (V-first: [.., V, K]) on the inputs' device."""
    with torch.no_grad():
        return reference.chunk_gated_delta_rule(**inputs.reference_kwargs(), output_chunk_states=True)[2]


def chunk_profile(out: torch.Tensor, ref: torch.Tensor, max_bins: int = MAX_BINS) -> list[float]:
    """rel_rmse of each chunk's state ([B, NT, ...] tensors), averaged in equal bins of the chunk index (fp64, one
    chunk at a time)."""
    NT = out.shape[1]
    per_chunk = []
    for c in range(NT):
        x, r = out[:, c].to(torch.float64), ref[:, c]
        den = float((r * r).sum())
        num = float(((x - r) ** 2).sum())
        per_chunk.append((num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf")))
    if NT <= max_bins:
        return per_chunk
    edges = [round(i * NT / max_bins) for i in range(max_bins + 1)]
    return [sum(per_chunk[a:b]) / (b - a) for a, b in zip(edges[:-1], edges[1:])]


def attribution_rows(case: Case, backends: list[Backend], inputs: GDNInputs, base_row) -> list[dict]:
    """Rows (tensor ``h``, against fp64) for every backend that exposes its chunk states."""
    offered = [b for b in backends if type(b).chunk_states is not Backend.chunk_states]
    if not offered or not eligible(case):
        return []
    ref = reference_chunk_states(inputs)
    rows = []
    for b in offered:
        row = base_row(case, b.name, TENSOR)
        try:
            got = b.chunk_states(inputs)
        except Exception as err:  # noqa: BLE001 - recorded, never fatal
            rows.append({**row, "status": "error", "reason": f"chunk states: {type(err).__name__}: {err}"[:2000]})
            continue
        if got is None:
            continue
        h, how = got
        if tuple(h.shape) != tuple(ref.shape):
            rows.append({**row, "impl": how, "status": "error",
                         "reason": f"chunk states have shape {tuple(h.shape)}, the reference {tuple(ref.shape)}"})
            continue
        m = metrics.compare(h.to(ref.device), ref, kind=metrics.CHUNK_KIND)
        rows.append({**row, "impl": how, "status": "ok" if m.finite else "nan", "reason": "", **m.as_row(),
                     "out_dtype": str(h.dtype).replace("torch.", ""), "chunk_rel_rmse": chunk_profile(h, ref)})
    return rows
