"""Two result sets side by side, cell by cell: what a GPU model, a library version or a commit changed.

A cell is (case_id, backend, tensor) against fp64, judged on each side on its own by parity.verdicts (each side's
bounds come from its own baseline and rounding floor). Its state, asv-style:

  new failure     PASS in A, FAIL or ERROR in B
  fixed           FAIL or ERROR in A, PASS in B
  worse / better  PASS on both sides and rel_rmse B / A above ``factor`` (below 1 / ``factor``)
  same            everything else that can be compared (both pass within the factor, or both fail)
  not comparable  the cell is missing on one side, skipped (unsupported, unavailable) or unjudgeable on either,
                  or its case id does not denote the same inputs on both sides: another reference/input version in
                  the run headers, or another fp64 reference (its RMS or max |.| further apart than ``REF_RTOL``;
                  the same inputs on two machines agree to ~1e-7, two seeds differ by more than 4e-3)

plus, on every cell, whether NaN/Inf appeared in B or went away. As a CI gate it fails closed: the exit code is 1
on a new failure and also when B lacks cells that A has (a run that crashed or did nothing), unless
``allow_missing``. Changes of errors far below the rounding floor
(under ``NOISE`` x the floor, e.g. the fp64 ``ref-recurrent`` at ~1e-15) are noise and count as ``same``.

Cases and backends match by id and name only; the two environments may differ in anything (that is the point),
and the summary puts them side by side.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from parity.backends import BASELINE
from parity.markdown import md_rows, md_table
from parity.report import frame
from parity.results import FLOOR_BACKEND, ResultSet, load
from parity.verdicts import ERROR, FAIL, INVALID, NOREF, PASS, SKIP, judge_frame

NEW_FAILURE, FIXED, WORSE, BETTER, SAME, NOT_COMPARABLE = (
    "new failure", "fixed", "worse", "better", "same", "not comparable")
STATES = (NEW_FAILURE, FIXED, WORSE, BETTER, SAME, NOT_COMPARABLE)
NAN_APPEARED, NAN_GONE = "NaN appeared", "NaN gone"
DEFAULT_FACTOR = 1.5
NOISE = 0.01  # an error change with both values under NOISE x the rounding floor is noise
REF_RTOL = 1e-4  # fp64 references whose RMS or max |.| differ by more (relative) come from other inputs
MAX_TABLE_ROWS = 200
KEY = ["case_id", "backend", "tensor"]
_BAD = (FAIL, ERROR)


def resolve_path(path: str | os.PathLike) -> Path:
    """A result file, or a run folder holding results.jsonl (or results.jsonl.gz)."""
    p = Path(path)
    if p.is_dir():
        for name in ("results.jsonl", "results.jsonl.gz"):
            if (p / name).exists():
                return p / name
        raise ValueError(f"{p} is a folder without results.jsonl or results.jsonl.gz")
    if not p.exists():
        raise ValueError(f"{p}: no such result file")
    return p


def rows_of(rs: ResultSet) -> pd.DataFrame:
    """The rows of a result set as parity.report.frame has them, one per (case, backend, against, tensor): the
    last written wins (as in results.merge)."""
    df = frame(rs)
    return df if df.empty else df.drop_duplicates(["case_id", "backend", "against", "tensor"], keep="last")


def cells(rs: ResultSet, df: pd.DataFrame | None = None) -> pd.DataFrame:
    """The judged cells of one result set (parity.verdicts.judge_frame), with the reference version of the run
    part that wrote each row and, from the cell's fp64-rounded row, the rounding floor (its rel_rmse) and the fp64
    reference's RMS and max |.| (a fingerprint of the inputs). ``df``: rows_of(rs), if at hand."""
    df = rows_of(rs) if df is None else df
    cols = KEY + ["group_id", "status", "reason", "verdict", "v_message", "rel_rmse", "ref_version", "floor",
                  "ref_rms", "ref_max"]
    judged = judge_frame(df) if not df.empty else df
    if judged.empty:
        return pd.DataFrame(columns=cols)
    ref_version = {r.get("part"): r.get("ref_version") for r in rs.runs}
    judged["ref_version"] = judged["part"].map(ref_version)
    keys = list(zip(judged["case_id"], judged["tensor"]))
    for col, metric in (("floor", "rel_rmse"), ("ref_rms", "rms_ref"), ("ref_max", "max_ref")):
        of_floor = _metric_of(df, FLOOR_BACKEND, metric)
        judged[col] = [of_floor.get(k, math.nan) for k in keys]
    return judged[cols]


def _metric_of(df: pd.DataFrame, backend: str, metric: str = "rel_rmse") -> dict:
    """{(case_id, tensor): metric} of ``backend``'s clean rows against fp64."""
    sub = df[(df["against"] == "fp64") & (df["backend"] == backend) & (df["status"] == "ok")]
    values = sub[metric] if metric in sub else [math.nan] * len(sub)
    return dict(zip(zip(sub["case_id"], sub["tensor"]), values))


def _num(x) -> float:
    return math.nan if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _first_line(text) -> str:
    return text.splitlines()[0] if isinstance(text, str) and text else ""


def ratio(a, b) -> float:
    """rel_rmse B / A (inf when only A is exactly 0, 1 when both are; NaN when either is missing)."""
    a, b = _num(a), _num(b)
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if a == 0:
        return 1.0 if b == 0 else math.inf
    return b / a


def _missing_reason(side: str, other: str, row: dict, other_ids: dict) -> str:
    alike = sorted(other_ids.get((row["group_id"], row["backend"], row["tensor"]), ()))
    if alike:
        more = f" (+{len(alike) - 2} more)" if len(alike) > 2 else ""
        return (f"only in {side}; {other} ran the same configuration on other inputs "
                f"({', '.join(alike[:2])}{more})")
    return f"only in {side}"


def classify(a: dict, b: dict, factor: float = DEFAULT_FACTOR) -> tuple[str, str]:
    """(state, why) of one cell judged on both sides."""
    if a["ref_version"] != b["ref_version"]:
        return NOT_COMPARABLE, (f"the case id does not denote the same inputs: another reference/input version "
                                f"({a['ref_version']} in A, {b['ref_version']} in B)")
    for name, metric in (("RMS", "ref_rms"), ("max |.|", "ref_max")):
        ra, rb = _num(a[metric]), _num(b[metric])
        if not (math.isnan(ra) or math.isnan(rb)) and abs(ra - rb) > REF_RTOL * max(abs(ra), abs(rb)):
            return NOT_COMPARABLE, (f"the inputs of this case id differ (input generator or RNG changed): another "
                                    f"fp64 reference ({name} {ra:.6e} in A, {rb:.6e} in B)")
    for side, r in (("A", a), ("B", b)):
        if r["verdict"] == SKIP:
            return NOT_COMPARABLE, f"skipped in {side}: {_first_line(r['v_message'])[:200]}"
        if r["verdict"] == NOREF:
            return NOT_COMPARABLE, f"no baseline or rounding floor to judge by in {side}"
        if r["verdict"] == INVALID:
            return NOT_COMPARABLE, f"invalid in {side}: {_first_line(r['v_message'])[:200]}"
    va, vb = a["verdict"], b["verdict"]
    if va == PASS and vb in _BAD:
        return NEW_FAILURE, _first_line(b["v_message"]) or vb
    if va in _BAD and vb == PASS:
        return FIXED, _first_line(a["v_message"]) or va
    if va in _BAD:
        return SAME, f"{va} in A, {vb} in B"
    q = ratio(a["rel_rmse"], b["rel_rmse"])
    floor = _num(b["floor"]) if not math.isnan(_num(b["floor"])) else _num(a["floor"])
    if not math.isnan(floor) and max(_num(a["rel_rmse"]), _num(b["rel_rmse"])) < NOISE * floor:
        return SAME, f"both under {NOISE:g} x the rounding floor: noise"
    if q > factor:
        return WORSE, f"rel_rmse {q:.2f}x"
    if q < 1.0 / factor:
        return BETTER, f"rel_rmse {q:.2f}x"
    return SAME, ""


def _nan_change(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return ""
    was, now = a["status"] == "nan", b["status"] == "nan"
    return NAN_APPEARED if now and not was else (NAN_GONE if was and not now else "")


@dataclass
class Comparison:
    """Both result sets and one row per cell: key, each side's verdict and rel_rmse, ratio, state, why, nan."""

    a: ResultSet
    b: ResultSet
    table: pd.DataFrame
    factor: float
    baseline_drift: pd.DataFrame
    allow_missing: bool = False

    def missing_in_b(self) -> pd.DataFrame:
        """The cells of A that B has no row for."""
        return self.table[self.table["B verdict"] == "-"]

    def of(self, state: str) -> pd.DataFrame:
        return self.table[self.table["state"] == state]

    def counts(self) -> pd.DataFrame:
        """Cells per backend and state (plus the NaN changes)."""
        t = self.table
        out = pd.crosstab(t["backend"], t["state"]).reindex(columns=list(STATES), fill_value=0)
        for name in (NAN_APPEARED, NAN_GONE):
            out[name] = t[t["nan"] == name].groupby("backend").size().reindex(out.index, fill_value=0)
        return out

    @property
    def exit_code(self) -> int:
        """1 when any cell is a new failure, or B lacks cells of A (unless ``allow_missing``), else 0 (for CI)."""
        if (self.table["state"] == NEW_FAILURE).any():
            return 1
        return 1 if not self.allow_missing and not self.missing_in_b().empty else 0


def compare(a: ResultSet, b: ResultSet, factor: float = DEFAULT_FACTOR, allow_missing: bool = False) -> Comparison:
    """Classify every cell of A and B (see the module docstring)."""
    if not factor > 1.0:
        raise ValueError(f"--factor must be > 1, got {factor}")
    da, db = rows_of(a), rows_of(b)
    ca, cb = cells(a, da), cells(b, db)
    ia = {k: r for k, r in zip(map(tuple, ca[KEY].values), ca.to_dict("records"))}
    ib = {k: r for k, r in zip(map(tuple, cb[KEY].values), cb.to_dict("records"))}
    ids = {side: {} for side in ("A", "B")}
    for side, index in (("A", ia), ("B", ib)):
        for (case_id, backend, tensor), r in index.items():
            ids[side].setdefault((r["group_id"], backend, tensor), set()).add(case_id)
    rows = []
    for key in sorted(ia.keys() | ib.keys()):
        ra, rb = ia.get(key), ib.get(key)
        if ra is None:
            state, why = NOT_COMPARABLE, _missing_reason("B", "A", rb, ids["A"])
        elif rb is None:
            state, why = NOT_COMPARABLE, _missing_reason("A", "B", ra, ids["B"])
        else:
            state, why = classify(ra, rb, factor)
        rows.append({
            "case_id": key[0], "backend": key[1], "tensor": key[2],
            "A": _num(ra["rel_rmse"]) if ra else math.nan, "B": _num(rb["rel_rmse"]) if rb else math.nan,
            "ratio": ratio(ra["rel_rmse"], rb["rel_rmse"]) if ra and rb else math.nan,
            "A verdict": ra["verdict"] if ra else "-", "B verdict": rb["verdict"] if rb else "-",
            "state": state, "why": why, "nan": _nan_change(ra, rb),
        })
    table = pd.DataFrame(rows, columns=KEY + ["A", "B", "ratio", "A verdict", "B verdict", "state", "why", "nan"])
    return Comparison(a=a, b=b, table=table, factor=factor, baseline_drift=_baseline_drift(da, db, factor),
                      allow_missing=allow_missing)


def _baseline_drift(da: pd.DataFrame, db: pd.DataFrame, factor: float) -> pd.DataFrame:
    """Cells where the baseline every bound scales with (torch-emulated) moved by more than ``factor``."""
    ma = _metric_of(da, BASELINE) if not da.empty else {}
    mb = _metric_of(db, BASELINE) if not db.empty else {}
    rows = [{"case_id": c, "tensor": t, "A": ma[(c, t)], "B": mb[(c, t)], "ratio": ratio(ma[(c, t)], mb[(c, t)])}
            for (c, t) in sorted(ma.keys() & mb.keys())]
    df = pd.DataFrame(rows, columns=["case_id", "tensor", "A", "B", "ratio"])
    return df[(df["ratio"] > factor) | (df["ratio"] < 1.0 / factor)]


# ----------------------------------------------------------------------------------------------- markdown


def _distinct(values) -> str:
    seen = list(dict.fromkeys("-" if v is None or v == "" else str(v) for v in values))
    return " / ".join(seen) if seen else "-"


def _env_rows(rs: ResultSet) -> dict[str, str]:
    runs = rs.runs
    envs = [r.get("env") or {} for r in runs]
    out = {
        "file": str(rs.path),
        "run id": _distinct(r.get("run_id") for r in runs),
        "matrix": _distinct(r.get("matrix") for r in runs),
        "run parts": str(len(runs)),
        "GPU": _distinct(f"{e.get('gpu')} x{e.get('gpu_count')} (sm_{e.get('sm')})" if e.get("gpu") else "none (CPU)"
                         for e in envs),
        "driver": _distinct(e.get("driver") for e in envs),
        "CUDA": _distinct(e.get("cuda") for e in envs),
    }
    packages = list(dict.fromkeys(p for e in envs for p in (e.get("packages") or {})))
    for p in packages:
        out[p] = _distinct((e.get("packages") or {}).get(p) for e in envs)
    out.update({
        "python": _distinct(e.get("python") for e in envs),
        "host": _distinct(e.get("host") for e in envs),
        "commit": _distinct(f"{(e.get('git') or {}).get('commit') or 'unknown'}"
                            f"{' (dirty)' if (e.get('git') or {}).get('dirty') else ''}" for e in envs),
        "date": _distinct(e.get("date") for e in envs),
        "reference version": _distinct(r.get("ref_version") for r in runs),
        "backends": _distinct(", ".join(r.get("backends") or []) for r in runs),
        "rows": str(len(rs.rows)),
    })
    return out


def section_environments(a: ResultSet, b: ResultSet) -> str:
    ea, eb = _env_rows(a), _env_rows(b)
    rows = [(k, ea.get(k, "-"), eb.get(k, "-"), "" if ea.get(k, "-") == eb.get(k, "-") else "differs")
            for k in dict.fromkeys([*ea, *eb])]
    return "\n".join(["## Environments", "",
                      md_rows(rows, ["", "A", "B", ""]), ""])


def _cell_table(df: pd.DataFrame, why: str | None = None) -> str:
    cols = KEY + ["A", "B", "ratio", "A verdict", "B verdict"]
    shown = df[cols + ([why] if why else [])].head(MAX_TABLE_ROWS).copy()
    shown = shown.rename(columns={"A": "A rel_rmse", "B": "B rel_rmse"})
    shown["ratio"] = [f"{q:.2f}x" if math.isfinite(q) else ("inf" if q == math.inf else "-")
                      for q in shown["ratio"]]
    if why:
        shown[why] = shown[why].fillna("").str.replace("|", "/", regex=False).str[:300]
    more = len(df) - len(shown)
    return md_table(shown, {"A rel_rmse": "e", "B rel_rmse": "e"}) + (f"\n\n(+{more} more)" if more > 0 else "")


def render(cmp: Comparison) -> str:
    """The comparison as markdown."""
    t = cmp.table
    n = {s: int((t["state"] == s).sum()) for s in STATES}
    verdict = (f"**{n[NEW_FAILURE]} new failure(s)**" if n[NEW_FAILURE] else "no new failure")
    lost = len(cmp.missing_in_b())
    if lost:
        verdict += (f", **{lost} cell(s) of A missing in B**" + (" (allowed: --allow-missing)" if cmp.allow_missing
                                                                 else " (a failure: B did not run them)"))
    out = [f"# gdn-parity comparison: A = `{cmp.a.path}`, B = `{cmp.b.path}`", "",
           f"{len(t)} cells (case x backend x tensor against fp64): {verdict}, {n[FIXED]} fixed, {n[WORSE]} worse, "
           f"{n[BETTER]} better, {n[SAME]} same, {n[NOT_COMPARABLE]} not comparable.", "",
           f"Each side is judged on its own by the verdict rule of `parity/verdicts.py` (its bounds from its own "
           f"baseline and rounding floor). *new failure*: PASS in A, FAIL/ERROR in B; *fixed*: the reverse; "
           f"*worse* / *better*: both pass and rel_rmse B/A is beyond {cmp.factor:g}x; *same*: the rest that can be "
           f"compared (errors under {NOISE:g} x the rounding floor count as noise); *not comparable*: missing on one "
           f"side, skipped on either, or not the same inputs (another reference version, or another fp64 reference).", "",
           section_environments(cmp.a, cmp.b)]
    for side, rs in (("A", cmp.a), ("B", cmp.b)):
        if rs.problems:
            out += [f"**{side} is damaged**: {len(rs.problems)} line(s) skipped or replaced, e.g. "
                    f"{'; '.join(rs.problems[:3])}", ""]
    if t.empty:
        return "\n".join(out + ["No judged cells on either side.", ""])
    out += ["## Cells per backend and state", "", md_table(cmp.counts().reset_index()), ""]
    for state, title, why in ((NEW_FAILURE, "New failures (PASS in A, FAIL/ERROR in B)", "why"),
                              (FIXED, "Fixed (FAIL/ERROR in A, PASS in B)", "why"),
                              (WORSE, f"Worse (both pass, rel_rmse B/A > {cmp.factor:g})", None),
                              (BETTER, f"Better (both pass, rel_rmse B/A < 1/{cmp.factor:g})", None)):
        sub = cmp.of(state).sort_values("ratio", ascending=state == BETTER)
        if not sub.empty:
            out += [f"## {title}", "", _cell_table(sub, why), ""]
    nan = t[t["nan"] != ""]
    if not nan.empty:
        out += ["## NaN/Inf appeared or went away", "", _cell_table(nan.assign(change=nan["nan"]), "change"), ""]
    nc = cmp.of(NOT_COMPARABLE)
    if not nc.empty:
        groups = (nc.assign(reason=nc["why"].str.replace(r"\s*\([^()]*\)$", " (...)", regex=True).str[:200])
                  .groupby(["backend", "reason"])["case_id"].agg(["count", "first"]).reset_index()
                  .rename(columns={"count": "cells", "first": "e.g."}))
        out += ["## Not comparable", "", md_table(groups), ""]
    if not cmp.baseline_drift.empty:
        drift = cmp.baseline_drift.sort_values("ratio", ascending=False)
        out += [f"## Baseline drift ({BASELINE} moved by more than {cmp.factor:g}x)", "",
                f"Every bound scales with `{BASELINE}`; where it moved, a verdict can change without the backend "
                f"changing.", "", md_table(drift.head(MAX_TABLE_ROWS), {"A": "e", "B": "e", "ratio": "s"}), ""]
    return "\n".join(out)


def compare_files(a: str | os.PathLike, b: str | os.PathLike, factor: float = DEFAULT_FACTOR,
                  allow_missing: bool = False) -> Comparison:
    """Load two result files (or run folders) and compare them."""
    return compare(load(resolve_path(a)), load(resolve_path(b)), factor, allow_missing)
