"""One case through every backend: inputs, the fp64 reference, the rounding floor, each backend's run and
its metrics, the pairwise comparisons between backends, and a rerun for determinism.

Every backend cell ends as rows with a status; an exception becomes an ``error`` row (the message kept)
and never stops the other backends. After an error on a GPU the CUDA context is checked; if it is
poisoned (an illegal memory access), ``ContextPoisoned`` is raised after the rows are reported, so the
worker process can be replaced.
"""

from __future__ import annotations

import itertools
import time
import traceback
from typing import Callable

import torch

from cases.case import Case
from cases.inputs import GDNInputs, make_inputs
from parity import metrics, positional
from parity.backends.base import Backend, RunResult
from parity.refs import RefCache, Reference, get_reference, grad_outputs, output_dtype, tensor_names
from parity.results import FLOOR_BACKEND, case_fields

FP64 = "fp64"
STATE_TENSORS = {"ht", "dh0"}
MAX_REASON = 2000


class ContextPoisoned(RuntimeError):
    """The CUDA context no longer works after a backend failed; the process must be replaced. ``rows`` are the
    failed cell's error rows (with the backend's own message), which run_case emits before re-raising."""

    def __init__(self, msg: str, rows: list[dict] | None = None):
        super().__init__(msg)
        self.rows = list(rows or [])


def describe_error(err: BaseException) -> str:
    """'Type: message' of an exception; when the message is empty (some kernels raise a bare RuntimeError), where
    it was raised instead: 'Type (no message), raised in func at file.py:line'."""
    text = str(err).strip()
    if text:
        return f"{type(err).__name__}: {text}"
    tb = traceback.extract_tb(err.__traceback__)
    where = f", raised in {tb[-1].name} at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(err).__name__} (no message){where}"

def _kind(tensor: str) -> str:
    return metrics.STATE_KIND if tensor in STATE_TENSORS else metrics.TOKEN_KIND


def base_row(case: Case, backend: str, tensor: str, against: str = FP64) -> dict:
    """The identifying columns of a row."""
    return {"case_id": case.id, "group_id": case.group_id, "seed": case.seed, **case_fields(case),
            "backend": backend, "against": against, "tensor": tensor}


def status_rows(case: Case, backend: str, status: str, reason: str, impl: str | None = None,
                tensors: list[str] | None = None) -> list[dict]:
    """Rows without metrics (unsupported, unavailable, error) for every tensor of the case."""
    return [{**base_row(case, backend, t), "impl": impl, "status": status, "reason": reason[:MAX_REASON]}
            for t in (tensors or tensor_names(case))]


def _metric_row(case, backend, tensor, out, ref, cu, against=FP64, impl=None, extra=None) -> dict:
    row = {**base_row(case, backend, tensor, against), "impl": impl}
    if tuple(out.shape) != tuple(ref.shape):
        return {**row, "status": "error",
                "reason": f"{tensor} has shape {tuple(out.shape)}, the reference {tuple(ref.shape)}"}
    m = metrics.compare(out.to(ref.device), ref, kind=_kind(tensor), cu_seqlens=cu)
    row.update(status="ok" if m.finite else "nan", reason="" if m.finite else
               f"{m.nan_count} NaN and {m.inf_count} Inf in {tensor} (first at {m.where})", **m.as_row())
    row["out_dtype"] = str(out.dtype).replace("torch.", "")
    if against == FP64:  # error by token position and by head (parity.positional); pairwise rows skip it
        row.update(positional.row_columns(tensor, out.to(ref.device), ref, cu))
    row.update(extra or {})
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill ``nbytes`` of the CUDA caching allocator's memory with NaN and free it, so buffers a backend allocates
    next start as NaN: an element it never writes shows up as NaN instead of as a plausible zero."""
    if device.type != "cuda" or nbytes <= 0:
        return
    buf = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=device)
    del buf


def cuda_healthy(device: torch.device) -> bool:
    """Does a trivial kernel still run and synchronise?"""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return float(torch.ones(1, device=device).add_(1).item()) == 2.0
    except Exception:
        return False


def _timed_run(backend: Backend, inputs: GDNInputs, grads, device) -> tuple[RunResult, float, int]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    _sync(device)
    t0 = time.perf_counter()
    res = backend.run(inputs, grad_outputs=grads)
    _sync(device)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return res, wall, peak


def _result_tensors(res: RunResult) -> dict[str, torch.Tensor]:
    out = {"o": res.o, "ht": res.final_state}
    out.update(res.grads or {})
    return {k: v for k, v in out.items() if v is not None}


def _bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when bitwise equal (NaN payloads included), else max |a - b| in fp64 (NaN if a NaN moved)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("nan")
    if torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return 0.0
    return float((a.double() - b.double()).abs().max())


def run_backend(case: Case, backend: Backend, inputs: GDNInputs, ref: Reference, device: torch.device,
                repeat: bool = True) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
    """Rows for one (case, backend) cell and the backend's tensors (None unless it ran)."""
    names = tensor_names(case)
    for ask, status in (("available", "unavailable"), ("supports", "unsupported")):
        try:
            ok, reason = backend.available() if ask == "available" else backend.supports(case, device)
        except Exception as err:  # noqa: BLE001 - a broken check costs this cell only
            tb = traceback.format_exc(limit=-4)
            return status_rows(case, backend.name, "error", f"{ask}() raised {describe_error(err)}\n{tb}"), None
        if not ok:
            return status_rows(case, backend.name, status, reason), None
    want_grads = case.grad and backend.has_backward
    grads = grad_outputs(case, inputs) if want_grads else None
    out_bytes = sum(t.numel() * t.element_size() for t in ref.tensors.values()) // 2
    try:
        poison_allocator(device, out_bytes)
        res, wall, peak = _timed_run(backend, inputs, grads, device)
        rerun_diff, wall2 = {}, None
        if repeat:
            poison_allocator(device, out_bytes)
            res2, wall2, _ = _timed_run(backend, inputs, grads, device)
            first, second = _result_tensors(res), _result_tensors(res2)
            rerun_diff = {t: _bitwise_diff(first[t], second[t]) for t in first if t in second}
            del res2, second
    except Exception as err:  # noqa: BLE001 - every failure is data
        msg = describe_error(err)
        tb = traceback.format_exc(limit=-8)  # the innermost frames: where it was raised
        rows = status_rows(case, backend.name, "error", f"{msg}\n{tb}")
        if not cuda_healthy(device):
            raise ContextPoisoned(msg, rows) from err
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return rows, None
    got = _result_tensors(res)
    cu = inputs.cu_seqlens
    rows = []
    for t in names:
        if t not in got:
            why = "no backward" if t.startswith("d") and not backend.has_backward else f"returned no {t}"
            status = "unsupported" if why == "no backward" else "error"
            rows += status_rows(case, backend.name, status, f"{backend.name} {why}", impl=res.impl, tensors=[t])
            continue
        extra = {"wall_s": wall, "wall2_s": wall2, "peak_mem_bytes": peak, "rerun_max_diff": rerun_diff.get(t)}
        rows.append(_metric_row(case, backend.name, t, got[t], ref.tensors[t], cu, impl=res.impl, extra=extra))
    return rows, got


def floor_rows(case: Case, ref: Reference, cu) -> list[dict]:
    """The rounding floor: the fp64 reference rounded to each tensor's output dtype, against itself."""
    rows = []
    for t, r in ref.tensors.items():
        dt = output_dtype(case, t)
        rows.append(_metric_row(case, FLOOR_BACKEND, t, r.to(dt), r, cu, impl=f"round-to-{str(dt)[6:]}"))
    return rows


def pairwise_rows(case: Case, outputs: dict[str, dict[str, torch.Tensor]], cu) -> list[dict]:
    """Every pair of backends that ran, each against the other (A's tensor vs B's tensor upcast to fp64)."""
    rows = []
    for a, b in itertools.combinations(sorted(outputs), 2):
        for t in outputs[a]:
            if t in outputs[b] and outputs[a][t].shape == outputs[b][t].shape:
                ref_b = outputs[b][t].to(torch.float64)
                rows.append(_metric_row(case, a, t, outputs[a][t], ref_b, cu, against=b))
                del ref_b
    return rows


def run_case(case: Case, backends: list[Backend], device: torch.device, cache: RefCache | None,
             emit: Callable[[str, list[dict]], None], begin: Callable[[str], None] = lambda name: None,
             repeat: bool = True, pairwise: bool = True, floor: bool = True, attribution: bool = True,
             inputs: GDNInputs | None = None) -> float:
    """Run ``case`` on every backend, calling ``emit(backend_name, rows)`` after each cell (and for the floor and
    the pairwise rows; the floor only when ``floor``). ``begin(name)`` is called before each backend runs. Returns the reference's seconds.
    Raises ContextPoisoned after emitting the failed cell's rows if the GPU context broke. ``inputs`` default to
    make_inputs(case) (given for captured calls, see parity.replay)."""
    inputs = (make_inputs(case) if inputs is None else inputs).to(device)
    begin(FLOOR_BACKEND)
    try:
        ref = get_reference(case, inputs, cache)
    except Exception as err:  # noqa: BLE001
        msg = f"the fp64 reference failed: {describe_error(err)}"
        for b in backends:
            emit(b.name, status_rows(case, b.name, "error", msg))
        if floor:
            emit(FLOOR_BACKEND, status_rows(case, FLOOR_BACKEND, "error", msg))
        return 0.0
    cu = inputs.cu_seqlens
    if floor:
        frows = floor_rows(case, ref, cu)
        for r in frows:
            r["ref_s"] = ref.seconds
            r["ref_source"] = ref.source
        emit(FLOOR_BACKEND, frows)
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    for b in backends:
        begin(b.name)
        try:
            rows, got = run_backend(case, b, inputs, ref, device, repeat=repeat)
        except ContextPoisoned as err:
            emit(b.name, err.rows)
            raise
        emit(b.name, rows)
        if got is not None and all(r["status"] == "ok" for r in rows):
            outputs[b.name] = got
    if pairwise and len(outputs) > 1:
        emit("pairwise", pairwise_rows(case, outputs, cu))
    if attribution:
        from parity.attribution import attribution_rows

        ran = [b for b in backends if b.name in outputs]
        rows = attribution_rows(case, ran, inputs, base_row)
        if rows:
            emit("attribution", rows)
    return ref.seconds


def availability(b: Backend) -> dict:
    """{"available", "reason"} of ``b``; an ``available()`` that raises is unavailable with the error."""
    try:
        ok, reason = b.available()
    except Exception as err:  # noqa: BLE001 - its cells record the error (parity.execute.run_backend)
        ok, reason = False, f"available() raised {describe_error(err)}"
    return {"available": ok, "reason": reason}


def versions(b: Backend) -> dict:
    """``b.versions()``; one that raises gives {"error": ...}."""
    try:
        return b.versions()
    except Exception as err:  # noqa: BLE001
        return {"error": f"versions() raised {describe_error(err)}"}
