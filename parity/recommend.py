"""Recommended tolerances: what error a downstream test should allow, derived from a run's result rows.

Rows against fp64 are grouped by (input dtype, gate dtype, T range, distribution family, tensor):

- T range: ``<=2k`` (T <= 2048), ``<=16k`` (T <= 16384), ``>16k``; T is the case's T (tokens per row, or in
  total for a varlen pack).
- family: FAMILIES below (gauss-l2/qwen-style; gate extremes; value/state outliers; in-kernel transforms); a
  distribution that is in none is its own family.
- tensor: o, the final state ht, and the gradients when the run has them.

In each group every backend gets its worst observed rel_rmse and max_diff (over all cases, layouts, shapes and
seeds of the group) and a verdict (parity.verdicts, combined over the group: FAIL if any cell fails, ERROR if any
errs, PASS if every cell it ran passes). The RULE:

    recommended(metric) = round_up_2sig(SAFETY (1.5) x the worst metric among the passing backends)

where the passing backends are those whose verdict on the group is PASS plus the same-precision baseline
``torch-emulated`` (unjudged: it defines the bound, which allows 2x its error). FAILing, ERRORing and
NO-BASELINE backends are excluded from the number and listed. rel_rmse and max_diff are taken separately (the
worst of each may come from different backends). round_up_2sig rounds up to 2 significant digits (decimal,
so 1.5e-3 stays 1.5e-3 and 1.501e-3 becomes 1.6e-3). The rounding floor ``fp64-rounded`` is shown, never used.

The result is written next to report.md as ``tolerances.json`` (FORMAT, VERSION; the runs and commits it came
from; the rule; one entry per group) and read back by ``load_tolerances`` and ``parity.assert_close``.
"""

from __future__ import annotations

import json
import math
import os
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import TYPE_CHECKING

from parity import verdicts
from parity.backends import BASELINE
from parity.markdown import fmt, md_table
from parity.results import FLOOR_BACKEND, ResultSet

if TYPE_CHECKING:
    import pandas as pd

FORMAT = "gdn-parity-tolerances"
VERSION = 1
SAFETY = 1.5
DIGITS = 2
T_RANGES = (("<=2k", 2048), ("<=16k", 16384), (">16k", None))
FAMILIES = {
    "gauss-l2/qwen-style": ("gauss-l2", "qwen-gates"),
    "gate-extremes": ("slow-decay", "strong-decay", "mixed-heads", "gate-mask"),
    "value/state-outliers": ("heavy-tail-v", "large-h0"),
    "in-kernel-transforms": ("raw-qk-l2", "qwen-gates-kernel", "beta-edges"),
}
KEY_FIELDS = ("dtype", "g_dtype", "T_range", "family", "tensor")
TENSOR_ORDER = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
PASSING = "PASS"
EXCLUDED = ("INVALID", "FAIL", "ERROR", "NO-BASELINE")
RULE = (
    f"recommended(metric) = {SAFETY:g} x the worst value of that metric (rel_rmse and max_diff separately) over "
    f"every cell of the group (dtype, gate dtype, T range, distribution family, tensor) among the backends whose "
    f"verdict on the whole group is PASS, together with the same-precision baseline `{BASELINE}` (which the "
    f"verdict rule allows 2x), rounded up to {DIGITS} significant digits. Backends that FAIL, ERROR or could not "
    f"be judged on the group are excluded from the number and listed; the rounding floor `{FLOOR_BACKEND}` is "
    f"shown for scale only."
)


def t_range(T: int) -> str:
    """The T-range label of a T."""
    for name, top in T_RANGES:
        if top is None or T <= top:
            return name
    raise AssertionError("unreachable")


def family(dist: str) -> str:
    """The family of a distribution (a family name is returned as is; an unknown distribution is its own)."""
    if dist in FAMILIES:
        return dist
    for name, members in FAMILIES.items():
        if dist in members:
            return name
    return dist


def round_up(x: float, digits: int = DIGITS) -> float:
    """x rounded up (towards +inf) to ``digits`` significant digits, in decimal: 1.5e-3 -> 1.5e-3, 1.501e-3 ->
    1.6e-3, 0.0123456 -> 0.013."""
    if x is None or not math.isfinite(x) or x <= 0:
        return x
    d = Decimal(f"{float(x):.12g}")  # 12 digits drop binary noise: 1.5 * 4e-3 = 0.006000000000000001 -> 6e-3
    exp = d.adjusted() - digits + 1
    return float(d.quantize(Decimal(1).scaleb(exp), rounding=ROUND_CEILING))


def _num(x) -> float:
    try:
        return float("nan") if x is None else float(x)
    except (TypeError, ValueError):
        return float("nan")


def _group_verdict(verdicts: list[str]) -> str:
    order = ("INVALID", "FAIL", "ERROR", "NO-BASELINE", "PASS")
    ran = [v for v in verdicts if v != "SKIP"]
    if not ran:
        return "SKIP"
    return min(ran, key=lambda v: order.index(v) if v in order else len(order))


def _frame(data) -> pd.DataFrame:
    df = data.frame() if isinstance(data, ResultSet) else data
    if df.empty:
        return df
    if "against" not in df:
        df = df.assign(against="fp64")
    return df[df["against"] == "fp64"]


def recommend(data: ResultSet | pd.DataFrame) -> list[dict]:
    """One entry per group (KEY_FIELDS) with the worst value per backend, the verdicts and the recommendation."""
    df = _frame(data)
    if df.empty:
        return []
    judged = verdicts.judge_frame(df)
    verdict_of = {} if judged.empty else {
        (c, b, t): v for c, b, t, v in zip(judged["case_id"], judged["backend"], judged["tensor"], judged["verdict"])}
    rows = df.to_dict("records")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["dtype"], r["g_dtype"], t_range(int(r["T"])), family(r["dist"]), r["tensor"])
        groups.setdefault(key, []).append(r)
    entries = []
    for key, grows in groups.items():
        observed = {}
        for backend in sorted({r["backend"] for r in grows}):
            brows = [r for r in grows if r["backend"] == backend]
            ok = [r for r in brows if r.get("status") == "ok"]
            if backend == FLOOR_BACKEND:
                verdict = "FLOOR"
            elif backend == BASELINE:  # unjudged; passing unless it produced NaN/Inf in the group
                verdict = "FAIL" if any(r.get("status") == "nan" for r in brows) else "BASELINE"
            else:
                verdict = _group_verdict([verdict_of.get((r["case_id"], backend, r["tensor"]), "SKIP") for r in brows])
            observed[backend] = {
                "verdict": verdict, "cells": len(ok),
                "nan_cells": sum(r.get("status") == "nan" for r in brows),
                "rel_rmse": max((_num(r.get("rel_rmse")) for r in ok), default=math.nan),
                "max_diff": max((_num(r.get("max_diff")) for r in ok), default=math.nan),
            }
        passing = [b for b, o in observed.items() if o["verdict"] in (PASSING, "BASELINE") and o["cells"]]
        rec, by = {}, {}
        for metric in ("rel_rmse", "max_diff"):
            vals = [(observed[b][metric], b) for b in passing if math.isfinite(observed[b][metric])]
            if vals:
                worst, who = max(vals)
                rec[metric], by[metric] = round_up(SAFETY * worst), who
            else:
                rec[metric], by[metric] = None, None
        ts = sorted({int(r["T"]) for r in grows})
        entries.append({
            **dict(zip(KEY_FIELDS, key)),
            "rel_rmse": rec["rel_rmse"], "max_diff": rec["max_diff"], "set_by": by,
            "passing": passing, "excluded": sorted(b for b, o in observed.items() if o["verdict"] in EXCLUDED),
            "cases": len({r["case_id"] for r in grows}), "T_seen": [ts[0], ts[-1]],
            "dists": sorted({r["dist"] for r in grows}), "observed": observed,
        })
    trank = {name: i for i, (name, _) in enumerate(T_RANGES)}
    frank = {name: i for i, name in enumerate(FAMILIES)}
    entries.sort(key=lambda e: (e["dtype"], e["g_dtype"], TENSOR_ORDER.index(e["tensor"]) if e["tensor"] in
                                TENSOR_ORDER else 99, e["tensor"], trank[e["T_range"]], frank.get(e["family"], 99),
                                e["family"]))
    return entries


def _sources(rs: ResultSet | None) -> list[dict]:
    if rs is None:
        return []
    out = []
    for run in rs.runs:
        env = run.get("env") or {}
        git = env.get("git") or {}
        out.append({"run_id": run.get("run_id"), "part": run.get("part"), "matrix": run.get("matrix"),
                    "commit": git.get("commit") or "unknown", "dirty": bool(git.get("dirty")),
                    "gpu": env.get("gpu"), "date": env.get("date"), "file": run.get("source") or rs.path})
    return out


def document(rs: ResultSet, entries: list[dict] | None = None) -> dict:
    """The tolerances.json document of a result set."""
    return {
        "format": FORMAT, "version": VERSION, "rule": RULE, "safety_factor": SAFETY, "significant_digits": DIGITS,
        "key_fields": list(KEY_FIELDS),
        "t_ranges": [{"name": n, "max_T": top} for n, top in T_RANGES],
        "families": {k: list(v) for k, v in FAMILIES.items()},
        "sources": _sources(rs),
        "entries": recommend(rs) if entries is None else entries,
    }


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_tolerances(doc: dict, path: str | os.PathLike) -> Path:
    """Write ``doc`` as strict JSON (NaN -> null), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def load_tolerances(source: str | os.PathLike | dict) -> dict:
    """A tolerances document from a path or an already loaded dict; ValueError for another format or a newer
    version."""
    where = "the given tolerances" if isinstance(source, dict) else str(source)
    if isinstance(source, dict):
        doc = source
    else:
        try:
            doc = json.loads(Path(source).read_text())
        except OSError as err:
            raise ValueError(f"{where}: cannot read the tolerances file ({err.strerror or err})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{where}: not valid JSON, truncated or damaged ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where}: not a {FORMAT} document (format={found!r})")
    try:
        version = int(doc.get("version", 0))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: version {doc.get('version')!r} is not an integer") from None
    if version > VERSION:
        raise ValueError(f"{where}: tolerances version {doc['version']} is newer than this harness reads ({VERSION})")
    entries = doc.get("entries", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}: 'entries' must be a list of objects")
    missing = [e for e in entries if any(k not in e for k in KEY_FIELDS)]
    if missing:
        raise ValueError(f"{where}: tolerance entries lack key fields {list(KEY_FIELDS)}: {missing[0]}")
    return doc


def lookup(doc: dict, *, dtype: str, g_dtype: str, T: int, dist: str, tensor: str) -> dict:
    """The entry of the group (dtype, g_dtype, T range of T, family of dist, tensor); KeyError naming the groups
    the document has when there is none."""
    key = {"dtype": dtype, "g_dtype": g_dtype, "T_range": t_range(T), "family": family(dist), "tensor": tensor}
    for e in doc.get("entries", []):
        if all(e.get(k) == v for k, v in key.items()):
            return e
    have = sorted({"/".join(str(e.get(k)) for k in KEY_FIELDS) for e in doc.get("entries", [])})
    raise KeyError(f"no recommended tolerance for {'/'.join(str(key[k]) for k in KEY_FIELDS)} ("
                   f"{'/'.join(KEY_FIELDS)}); the document has: {', '.join(have[:20]) or 'nothing'}"
                   f"{' ...' if len(have) > 20 else ''}")


# --------------------------------------------------------------------------------------------------- report


def _cell(o: dict | None) -> str:
    if o is None:
        return "-"
    if not o["cells"]:
        return "NaN/Inf" if o["nan_cells"] else "-"
    text = f"{o['rel_rmse']:.2e} / {o['max_diff']:.2e}"
    if o["verdict"] in EXCLUDED:
        text = f"{o['verdict']} {text}"
    return text + (f" (+{o['nan_cells']} NaN/Inf)" if o["nan_cells"] else "")


def section(entries: list[dict], json_name: str | None = "tolerances.json") -> str:
    """The report's markdown: the rule and one table per (dtype, gate dtype)."""
    import pandas as pd

    if not entries:
        return ""
    out = ["## Recommended tolerances", "", RULE, "",
           "Cells: worst rel_rmse / worst max_diff of each backend over the group (FAIL, ERROR or NO-BASELINE in front "
           "when the backend is excluded). `set by`: the backend whose worst rel_rmse set the recommendation."]
    if json_name:
        out += ["", f"Machine-readable: [`{json_name}`]({json_name}) next to this report (format `{FORMAT}` "
                    f"v{VERSION}); `parity.assert_close(out, ref, case, tolerances=...)` checks a tensor against it."]
    out.append("")
    by_dtypes: dict[tuple, list[dict]] = {}
    for e in entries:
        by_dtypes.setdefault((e["dtype"], e["g_dtype"]), []).append(e)
    for (dtype, g_dtype), es in by_dtypes.items():
        backends = sorted({b for e in es for b in e["observed"]})
        first = [b for b in (FLOOR_BACKEND, BASELINE) if b in backends]
        backends = first + [b for b in backends if b not in first]
        rows = []
        for e in es:
            row = {"T range": e["T_range"], "family": e["family"], "tensor": e["tensor"], "cases": e["cases"]}
            row.update({b: _cell(e["observed"].get(b)) for b in backends})
            row.update({"tol rel_rmse": fmt(e["rel_rmse"]) if e["rel_rmse"] is not None else "none passing",
                        "tol max_diff": fmt(e["max_diff"]) if e["max_diff"] is not None else "none passing",
                        "set by": e["set_by"]["rel_rmse"] or "-", "excluded": ", ".join(e["excluded"]) or "-"})
            rows.append(row)
        out += [f"### q/k/v {dtype}, gate {g_dtype}", "", md_table(pd.DataFrame(rows)), ""]
    return "\n".join(out)
