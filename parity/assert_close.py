"""``parity.assert_close``: check a kernel's tensor against an fp64 reference with a run's recommended tolerances.

    from parity import assert_close

    assert_close(o, o_ref, case, tolerances="reports/<run>/tolerances.json")       # case: a cases.Case or its id
    assert_close(o, o_ref, tolerances=doc, dtype="bf16", gate_dtype="fp32", dist="qwen-gates")   # T from o's shape
    assert_close(ht, ht_ref, case, tensor="ht", tolerances=path, backend="my-kernel")

The tolerance is the entry of ``tolerances.json`` (written next to report.md by ``python -m parity report``; see
parity.recommend) for the group (input dtype, gate dtype, T range, distribution family, tensor). Fields come from
the keywords, else from ``case``; without either, ``dtype`` defaults to ``out``'s dtype for o/dq/dk/dv and ``T``
to ``out.shape[1]`` for token tensors (the total for a varlen pack), and ``gate_dtype`` and ``dist`` (a
distribution or a family name) are required. ``tolerances`` is a path or an already loaded document; when it is
None the path in $GDN_PARITY_TOLERANCES is used. There is deliberately no built-in default: a tolerance is
measured on a machine and a set of kernels, so the caller names which run's numbers it tests against.

It raises AssertionError in the project's one failure pattern (parity.verdicts.failure_message): NaN/Inf in
``out`` first, then rel_rmse, then max_diff over their recommended bound; on success it returns the Metrics.
A group the document does not cover, or one where no backend passed, raises KeyError / ValueError (never a pass).
So do inputs that leave nothing to compare: an empty ``out`` or ``ref``, a ``ref`` with NaN/Inf, and an all-zero
``ref`` (relative error is undefined there, and a kernel returning zeros would pass): ValueError naming it.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch

from parity import metrics, recommend, verdicts

ENV = "GDN_PARITY_TOLERANCES"
TOKEN_TENSORS = ("o", "dq", "dk", "dv", "dg", "dbeta")
INPUT_DTYPE_TENSORS = ("o", "dq", "dk", "dv")  # returned in the input dtype: dtype can be read off the output
_CACHE: dict[tuple[str, float], dict] = {}


def _document(tolerances) -> tuple[dict, str]:
    if tolerances is None:
        tolerances = os.environ.get(ENV)
        if not tolerances:
            here = Path(__file__).resolve().parent.parent / "reports"
            found = sorted(str(p) for p in here.glob("*/tolerances.json")) if here.is_dir() else []
            raise ValueError(f"assert_close needs tolerances= (a tolerances.json path or its loaded dict) or ${ENV}; "
                             f"`python -m parity report <results>` writes one next to report.md"
                             + (f" (this checkout has: {', '.join(found)})" if found else ""))
    if isinstance(tolerances, dict):
        return recommend.load_tolerances(tolerances), "the given tolerances"
    path = Path(tolerances)
    key = (str(path.resolve()), path.stat().st_mtime)
    if key not in _CACHE:
        _CACHE[key] = recommend.load_tolerances(path)
    return _CACHE[key], str(path)


def _case(case):
    if case is None or not isinstance(case, str):
        return case
    from cases.case import Case

    return Case.from_id(case)


def _fields(out: torch.Tensor, case, tensor: str, dtype, gate_dtype, T, dist) -> dict:
    from cases.dtypes import name_of

    if dtype is None:
        dtype = case.dtype if case is not None else (name_of(out.dtype) if tensor in INPUT_DTYPE_TENSORS else None)
    if gate_dtype is None and case is not None:
        gate_dtype = case.g_dtype
    if T is None:
        T = case.T if case is not None else (int(out.shape[1]) if tensor in TOKEN_TENSORS and out.dim() > 1 else None)
    if dist is None and case is not None:
        dist = case.dist
    fields = {"dtype": dtype, "g_dtype": gate_dtype, "T": T, "dist": dist}
    missing = [("gate_dtype" if k == "g_dtype" else k) for k, v in fields.items() if v is None]
    if missing:
        need = ", ".join(k + "=" for k in missing)
        raise ValueError(f"assert_close cannot tell the tolerance group: pass case= or {need}")
    return fields


def _check_operands(out, ref, tensor: str) -> None:
    """ValueError naming the argument when ``out``/``ref`` leave nothing meaningful to compare."""
    for name, x in (("out", out), ("ref", ref)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"assert_close: {name} ({tensor}) must be a torch.Tensor, got {type(x).__name__}")
        if x.numel() == 0:
            raise ValueError(f"assert_close: {name} ({tensor}) is empty (shape {tuple(x.shape)}): nothing to compare")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"assert_close: out ({tensor}) has shape {tuple(out.shape)}, ref {tuple(ref.shape)}")
    finite = torch.isfinite(ref)
    if not bool(finite.all()):
        raise ValueError(f"assert_close: ref ({tensor}) holds {int((~finite).sum())} NaN/Inf values: the reference "
                         f"is broken, not the kernel")
    if not bool((ref != 0).any()):
        raise ValueError(f"assert_close: ref ({tensor}) is all zeros ({ref.numel()} elements): rel_rmse is undefined "
                         f"and an all-zero output would pass without testing anything; check the reference")


def _fail(tensor, metric, value, bound, case, backend, where) -> AssertionError:
    row = {"tensor": tensor, "case_id": case.id if case is not None else "-", "backend": backend or "-",
           "impl": "assert_close"}
    msg = verdicts.failure_message(row, metric, value, bound, where)
    if case is None or backend is None:  # no cell of the harness to rerun
        msg = msg.split(" | rerun: ")[0] + " | rerun: the calling test (pass case= and backend= for a parity command)"
    return AssertionError(msg)


def assert_close(out: torch.Tensor, ref: torch.Tensor, case=None, *, tensor: str = "o", tolerances=None,
                 dtype: str | None = None, gate_dtype: str | None = None, T: int | None = None,
                 dist: str | None = None, backend: str | None = None, cu_seqlens=None) -> metrics.Metrics:
    """Raise AssertionError unless ``out`` is within the recommended rel_rmse and max_diff of ``ref`` (module doc).
    ``backend`` only labels the message; ``cu_seqlens`` only maps the worst element to (sequence, token)."""
    _check_operands(out, ref, tensor)
    case = _case(case)
    doc, source = _document(tolerances)
    f = _fields(out, case, tensor, dtype, gate_dtype, T, dist)
    entry = recommend.lookup(doc, dtype=f["dtype"], g_dtype=f["g_dtype"], T=int(f["T"]), dist=f["dist"],
                             tensor=tensor)
    group = "/".join(str(entry[k]) for k in recommend.KEY_FIELDS)
    kind = metrics.STATE_KIND if tensor in ("ht", "dh0") else metrics.TOKEN_KIND
    if cu_seqlens is None and case is not None and kind == metrics.TOKEN_KIND and case.layout.startswith("varlen"):
        from cases.inputs import make_inputs  # the case's packing, for the location only

        cu_seqlens = make_inputs(case).cu_seqlens
    m = metrics.compare(out, ref.to(out.device) if ref.device != out.device else ref, kind=kind,
                        cu_seqlens=cu_seqlens)
    where = str(m.where) if m.where is not None else "-"
    if not m.finite:
        raise _fail(tensor, "nan/inf", f"{m.nan_count} NaN and {m.inf_count} Inf", "0", case, backend, where)
    for metric in ("rel_rmse", "max_diff"):
        bound = entry.get(metric)
        if bound is None:
            raise ValueError(f"{source}: no backend passed on group {group}, so it recommends no {metric} "
                             f"(excluded: {', '.join(entry.get('excluded') or []) or '-'})")
        value = getattr(m, metric)
        if not value <= bound:
            raise _fail(tensor, metric, f"{value:.3e}",
                        f"{bound:.3e} (recommended for {group} by {source})", case, backend, where)
    return m


class _CallableModule(types.ModuleType):
    """``import parity.assert_close`` binds this module as the attribute ``parity.assert_close``, shadowing the
    function that ``parity.__getattr__`` exports; calling the module calls the function, so both work."""

    def __call__(self, *args, **kwargs):
        return assert_close(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
