"""PASS / FAIL for every cell, by one rule (written out in the report), from result rows only.

For a backend's tensor on a case (its row against fp64) the rule is, in this order:
  0. the case's two fp64 references disagree (``ref-recurrent``'s o or ht over the fp64 rule)   -> INVALID
  1. status ``nan`` (any NaN/Inf in the output)                      -> FAIL
  2. status ``error``                                                -> ERROR (the message is kept)
  3. status ``unsupported`` / ``unavailable``                        -> SKIP (with the reason)
  4. a tensor returned in fp64: the fp64 rule (parity.tolerances.FP64_RTOL)   -> PASS, else FAIL
  5. the baseline ran but fails its sanity check (parity.tolerances.BASELINE_CHECKS)   -> NO-BASELINE
  6. rel_rmse <= bound(rel_rmse) and max_diff <= bound(max_diff)     -> PASS, else FAIL
with bound(metric) = max(base_factor x baseline error, floor_factor x rounding floor) from
parity.tolerances, measured on the same inputs: the baseline is the same-precision implementation
(``torch-emulated``) and the floor the fp64 reference rounded to the output dtype (``fp64-rounded``).
A cell over several seeds passes only if every seed passes. A row whose status is not one of
parity.results.STATUSES is refused with a ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from parity.backends import BASELINE
from parity.markdown import md_table
from parity.results import FLOOR_BACKEND, STATUSES
from parity.tolerances import FP64_RTOL, baseline_check, bounds, fp64_bounds, tolerance_for

PASS, FAIL, ERROR, SKIP, NOREF, INVALID = "PASS", "FAIL", "ERROR", "SKIP", "NO-BASELINE", "INVALID"
NOT_JUDGED = (FLOOR_BACKEND, BASELINE)
CHECK_BACKEND = "ref-recurrent"  # the second fp64 reference: its fp64 tensors cross-check the chunked one
FP64_NAMES = ("float64", "fp64")

RULE = (
    "A cell PASSES when its output has no NaN/Inf and both rel_rmse and max_diff against fp64 are within "
    "max(base factor x the error of `torch-emulated` (the same algorithm with input-dtype operands and fp32 "
    "accumulation), floor factor x the error of the fp64 reference rounded to the output dtype), measured on the "
    "same inputs; factors from `parity/tolerances.py` (bf16/fp16: rel_rmse 2x, max_diff 4x, FlashAttention's rule "
    "of 2x a plain same-precision implementation; fp32 inputs: 4x / 8x). NaN/Inf always FAILS; a configuration over several seeds passes "
    "only if every seed does. "
    f"A tensor returned in fp64 is held to the fp64 rule instead: rel_rmse <= {FP64_RTOL:g} and max_diff <= "
    f"{FP64_RTOL:g} x max|reference|. The two fp64 references check each other: where `{CHECK_BACKEND}` ran, its "
    "o and final state must meet the fp64 rule, otherwise the case is INVALID and every verdict on it is withheld. "
    f"`{BASELINE}` serves as a bound only after a sanity check (finite; rel_rmse and max_diff within the limits of "
    "`parity.tolerances.BASELINE_CHECKS` times the rounding floor; rel_rmse against fp64 under a cap): a cell whose "
    "baseline ran and failed the check is NO-BASELINE, never PASS (no fall-back to the floor alone); where the "
    "baseline did not run at all (unsupported, error) the bound is the floor's alone."
)


@dataclass(frozen=True)
class Verdict:
    """status (PASS/FAIL/ERROR/SKIP/NO-BASELINE/INVALID); the metric that decided it, its value and bound; a
    message in the project's one failure pattern."""

    status: str
    metric: str | None = None
    value: float | None = None
    bound: float | None = None
    message: str = ""


def _num(x) -> float:
    return float("nan") if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _nonfinite(row: dict) -> str:
    """'N NaN and M Inf' of a row of status nan."""
    return f"{int(_num(row.get('nan_count')) or 0)} NaN and {int(_num(row.get('inf_count')) or 0)} Inf"


def _is_fp64(row: dict) -> bool:
    """Was the tensor returned in fp64? (``out_dtype``; rows written without it: an fp64 case.)"""
    out = row.get("out_dtype")
    if isinstance(out, str) and out:
        return out in FP64_NAMES
    return row.get("dtype") in FP64_NAMES


def check_status(row: dict) -> str:
    """The row's status; ValueError naming the row when it is not one of parity.results.STATUSES."""
    status = row.get("status")
    if status not in STATUSES:
        raise ValueError(f"row of case {row.get('case_id')!r}, backend {row.get('backend')!r}, tensor "
                         f"{row.get('tensor')!r} has status {status!r}; a row's status is one of {', '.join(STATUSES)}")
    return status


def fp64_excess(row: dict) -> tuple[str, float, float] | None:
    """(metric, value, bound) of the first metric of an fp64 row over the fp64 rule (NaN counts as over), or None."""
    b = fp64_bounds(_num(row.get("max_ref")))
    for metric in ("rel_rmse", "max_diff"):
        value = _num(row.get(metric))
        if not value <= b[metric]:
            return metric, value, b[metric]
    return None


def cross_check(rows: list[dict]) -> str | None:
    """Why a case is INVALID, or None: ``rows`` are the case's rows against fp64; the fp64 tensors of CHECK_BACKEND
    (the recurrent fp64 reference) must meet the fp64 rule against the chunked fp64 reference."""
    for r in rows:
        if r.get("backend") != CHECK_BACKEND or r.get("against", "fp64") != "fp64" or not _is_fp64(r):
            continue
        status = check_status(r)
        if status == "nan":
            return (f"case {r['case_id']}: the two fp64 references disagree: {CHECK_BACKEND} {r['tensor']} has "
                    f"{_nonfinite(r)}")
        if status != "ok":
            continue
        over = fp64_excess(r)
        if over is not None:
            metric, value, bound = over
            return (f"case {r['case_id']}: the two fp64 references disagree: {CHECK_BACKEND} vs the chunked fp64 "
                    f"reference, {r['tensor']} {metric} {value:.3e} > {bound:.3e} (fp64 rule, {FP64_RTOL:g} "
                    f"relative); every verdict on the case is withheld | rerun: "
                    f"{rerun_command(r['case_id'], CHECK_BACKEND)}")
    return None


def _widened(row: dict, floor: dict | None) -> bool:
    """Is the tensor returned in a wider dtype than the inputs (fp32 state of bf16 inputs)?"""
    out = (floor or {}).get("out_dtype") or row.get("out_dtype")
    if isinstance(out, str) and out:
        from cases.dtypes import to_torch

        try:
            return out != str(to_torch(row["dtype"])).replace("torch.", "")
        except ValueError:
            pass
    return row.get("dtype") != "fp32" and row.get("tensor") not in ("o", "dq", "dk", "dv")


def baseline_problem(row: dict, base: dict, floor: dict | None) -> str | None:
    """Why the baseline's row may not serve as a bound (parity.tolerances.BASELINE_CHECKS), or None."""
    lim = baseline_check(row["tensor"], row["dtype"], _widened(row, floor))
    name = f"{BASELINE} on {row['tensor']}"
    for metric in ("rel_rmse", "max_diff"):
        b = _num(base.get(metric))
        if not math.isfinite(b):
            return f"{name}: {metric} {b} is not finite"
        f = _num((floor or {}).get(metric))
        if math.isfinite(f) and f > 0 and not lim.min_ratio * f <= b <= lim.max_ratio * f:
            return (f"{name}: {metric} {b:.3e} is {b / f:.3g}x the rounding floor {f:.3e} (allowed "
                    f"{lim.min_ratio:g}x - {lim.max_ratio:g}x)")
    rr = _num(base.get("rel_rmse"))
    if not rr <= lim.max_rel_rmse:
        return f"{name}: rel_rmse {rr:.3e} against fp64 > {lim.max_rel_rmse:g}"
    return None


def judge(row: dict, base: dict | None, floor: dict | None, invalid: str | None = None) -> Verdict:
    """The verdict of one row (a backend's tensor against fp64), given the baseline's and the floor's rows and,
    when the case's fp64 references disagree, why (``invalid``, from cross_check)."""
    status = check_status(row)
    for other in (base, floor):
        if other is not None:
            check_status(other)
    if invalid:
        return Verdict(INVALID, message=invalid)
    where = _where(row)
    if status == "nan":
        return Verdict(FAIL, "nan_count", _num(row.get("nan_count")), 0.0,
                       failure_message(row, "nan/inf", _nonfinite(row), "0", where))
    if status == "error":
        return Verdict(ERROR, message=(row.get("reason") or "").split("\n")[0])
    if status in ("unsupported", "unavailable"):
        return Verdict(SKIP, message=row.get("reason") or status)
    if _is_fp64(row):
        over = fp64_excess(row)
        bound = fp64_bounds(_num(row.get("max_ref")))
        if over is None:
            return Verdict(PASS, "rel_rmse", _num(row.get("rel_rmse")), bound["rel_rmse"])
        metric, value, b = over
        return Verdict(FAIL, metric, value, b, failure_message(
            row, metric, f"{value:.3e}", f"{b:.3e} (fp64 rule: {FP64_RTOL:g} relative)", where))
    tol, reasons = tolerance_for(row["backend"], row["tensor"], row["dtype"], row.get("case_id", "*"))
    ok_base = base if base is not None and base.get("status") == "ok" else None
    ok_floor = floor if floor is not None and floor.get("status") == "ok" else None
    if ok_base is None and ok_floor is None:
        return Verdict(NOREF, message="neither the same-precision baseline nor the rounding floor ran on this case")
    if base is not None and base.get("status") in ("ok", "nan"):
        problem = baseline_problem(row, base, ok_floor)
        if problem is not None:
            return Verdict(NOREF, message=f"the baseline failed its sanity check, no bound: {problem} | case "
                                          f"{row['case_id']} | backend {row['backend']}")
    b = bounds(tol, ok_base, ok_floor)
    for metric in ("rel_rmse", "max_diff"):
        value = _num(row.get(metric))
        if not value <= b[metric]:
            basis = _basis(tol, metric, ok_base, ok_floor)
            extra = f" [loosened: {'; '.join(reasons)}]" if reasons else ""
            return Verdict(FAIL, metric, value, b[metric],
                           failure_message(row, metric, f"{value:.3e}", f"{b[metric]:.3e} ({basis}){extra}", where))
    return Verdict(PASS, "rel_rmse", _num(row.get("rel_rmse")), b["rel_rmse"])


def _basis(tol, metric, base, floor) -> str:
    bf = tol.base_rel_rmse if metric == "rel_rmse" else tol.base_max_diff
    ff = tol.floor_rel_rmse if metric == "rel_rmse" else tol.floor_max_diff
    parts = []
    if base is not None:
        parts.append(f"{bf:g} x {BASELINE} {_num(base.get(metric)):.3e}")
    if floor is not None:
        parts.append(f"{ff:g} x rounding floor {_num(floor.get(metric)):.3e}")
    return "max of " + ", ".join(parts) if len(parts) > 1 else parts[0]


def _where(row: dict) -> str:
    seq = row.get("where_seq")
    if seq is None or (isinstance(seq, float) and math.isnan(seq)):
        return "-"
    tok = row.get("where_token")
    tok_s = "final state" if tok is None or (isinstance(tok, float) and math.isnan(tok)) else f"token {int(tok)}"
    return f"sequence {int(seq)}, {tok_s}, head {int(row.get('where_head'))}, channel {row.get('where_channel')}"


def rerun_command(case_id: str, backend: str) -> str:
    """The command that reruns exactly one cell."""
    if case_id.startswith("replay:"):  # captured inputs: the capture file is named in the report's capture section
        return f"python -m parity replay <the {case_id.split(':')[1]} capture file> --backends {backend}"
    return (f"python -m parity run --case {case_id} --backends {backend} --workers 0 --cache none  |  "
            f"pytest tests/test_matrix.py --case {case_id} --backend {backend}")


def failure_message(row: dict, metric: str, value: str, bound: str, where: str) -> str:
    """The one failure-message pattern: tensor, metric, value > bound, case id, backend, where, and a rerun."""
    return (f"{row['tensor']} {metric} {value} > {bound} | case {row['case_id']} | backend {row['backend']} "
            f"({row.get('impl')}) | worst at {where} | rerun: {rerun_command(row['case_id'], row['backend'])}")


def judge_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Rows against fp64 of judged backends, with verdict, metric, value, bound and message columns (every row of
    a case whose fp64 references disagree is INVALID)."""
    rows = df[df["against"] == "fp64"]
    records = rows.to_dict("records")
    index = {(r["case_id"], r["backend"], r["tensor"]): r for r in records}
    of_case: dict[str, list[dict]] = {}
    for r in records:
        of_case.setdefault(r["case_id"], []).append(r)
    invalid = {c: cross_check(rs) for c, rs in of_case.items()}
    out = []
    for r in records:
        if r["backend"] in NOT_JUDGED:
            continue
        key_base = (r["case_id"], BASELINE, r["tensor"])
        key_floor = (r["case_id"], FLOOR_BACKEND, r["tensor"])
        v = judge(r, index.get(key_base), index.get(key_floor), invalid[r["case_id"]])
        out.append({**r, "verdict": v.status, "v_metric": v.metric, "v_value": v.value, "v_bound": v.bound,
                    "v_message": v.message})
    return pd.DataFrame(out)


def by_configuration(judged: pd.DataFrame) -> pd.DataFrame:
    """One verdict per (configuration, backend, tensor) over its seeds: FAIL if any seed fails, ERROR if any errs,
    SKIP if all skip (INVALID before all of them); with the worst and the median rel_rmse over seeds."""
    order = {INVALID: 0, FAIL: 1, ERROR: 2, NOREF: 3, PASS: 4, SKIP: 5}
    rows = []
    for (gid, backend, tensor), g in judged.groupby(["group_id", "backend", "tensor"]):
        worst = min(g["verdict"], key=lambda s: order[s])
        first_bad = g[g["verdict"] == worst].iloc[0]
        rows.append({"group_id": gid, "backend": backend, "tensor": tensor, "verdict": worst, "seeds": len(g),
                     "worst_rel_rmse": g["rel_rmse"].max(), "median_rel_rmse": g["rel_rmse"].median(),
                     "message": first_bad["v_message"], "dist": first_bad["dist"], "dtype": first_bad["dtype"],
                     "g_dtype": first_bad["g_dtype"], "T": first_bad["T"], "layout": first_bad["layout"]})
    return pd.DataFrame(rows)


def section(df: pd.DataFrame) -> str:
    """The report's verdict section: the rule, counts per backend, every failing configuration."""
    judged = judge_frame(df)
    if judged.empty:
        return ""
    conf = by_configuration(judged)
    counts = conf.pivot_table(index="backend", columns="verdict", values="group_id", aggfunc="count", fill_value=0)
    counts = counts.reindex(columns=[c for c in (PASS, FAIL, ERROR, NOREF, INVALID, SKIP) if c in counts.columns])
    out = ["## Verdicts", "", RULE, "", "Configurations (all seeds, all tensors) per backend:", "",
           md_table(counts.reset_index()), ""]
    if "ref_source" in df.columns:
        redone = df[df["ref_source"].astype(str).str.startswith("recomputed")].drop_duplicates("case_id")
        if not redone.empty:
            out += [f"fp64 references recomputed because their cache entry did not match ({len(redone)}); the "
                    f"first: case {redone['case_id'].iloc[0]}: {redone['ref_source'].iloc[0]}", ""]
    invalid = judged[judged["verdict"] == INVALID].drop_duplicates("case_id")
    if not invalid.empty:
        out += [f"Invalid cases ({len(invalid)}): the two fp64 references disagree, so no verdict is given on them:",
                ""] + [f"- {m}" for m in invalid["v_message"]] + [""]
    nobase = judged[judged["verdict"] == NOREF]
    if not nobase.empty:
        out += [f"Cells without a usable baseline ({len(nobase)}); the first:", "",
                f"- {nobase['v_message'].iloc[0]}", ""]
    bad = conf[conf["verdict"].isin([FAIL, ERROR])].sort_values(["backend", "verdict", "group_id"])
    if bad.empty:
        unjudged = conf["verdict"].isin([INVALID, NOREF]).any()
        out += ["No configuration failed" + (" (INVALID and NO-BASELINE ones were not judged: above)." if unjudged
                                             else "."), ""]
    else:
        out += ["Failing configurations:", ""]
        show = bad[["backend", "tensor", "verdict", "seeds", "worst_rel_rmse", "message"]].copy()
        show["message"] = show["message"].str.replace("|", "/", regex=False).str[:400]
        out += [md_table(show, {"worst_rel_rmse": "e"}), ""]
    return "\n".join(out)
