"""PASS / FAIL for every cell, by one rule (written out in the report), from result rows only.

For a backend's tensor on a case (its row against fp64) the rule is, in this order:
  1. status ``nan`` (any NaN/Inf in the output)                      -> FAIL
  2. status ``error``                                                -> ERROR (the message is kept)
  3. status ``unsupported`` / ``unavailable``                        -> SKIP (with the reason)
  4. rel_rmse <= bound(rel_rmse) and max_diff <= bound(max_diff)     -> PASS, else FAIL
with bound(metric) = max(base_factor x baseline error, floor_factor x rounding floor) from
parity.tolerances, measured on the same inputs: the baseline is the same-precision implementation
(``torch-emulated``) and the floor the fp64 reference rounded to the output dtype (``fp64-rounded``).
A cell over several seeds passes only if every seed passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from parity.backends import BASELINE
from parity.markdown import md_table
from parity.results import FLOOR_BACKEND
from parity.tolerances import bounds, tolerance_for

PASS, FAIL, ERROR, SKIP, NOREF = "PASS", "FAIL", "ERROR", "SKIP", "NO-BASELINE"
NOT_JUDGED = (FLOOR_BACKEND, BASELINE)

RULE = (
    "A cell PASSES when its output has no NaN/Inf and both rel_rmse and max_diff against fp64 are within "
    "max(base factor x the error of `torch-emulated` (the same algorithm with input-dtype operands and fp32 "
    "accumulation), floor factor x the error of the fp64 reference rounded to the output dtype), measured on the "
    "same inputs; factors from `parity/tolerances.py` (bf16/fp16: rel_rmse 2x, max_diff 4x, FlashAttention's rule "
    "of 2x a plain same-precision implementation; fp32 inputs: 4x / 8x). NaN/Inf always FAILS; a configuration over several seeds passes "
    "only if every seed does."
)


@dataclass(frozen=True)
class Verdict:
    """status (PASS/FAIL/ERROR/SKIP/NO-BASELINE); the metric that decided it, its value and bound; a message in the
    project's one failure pattern."""

    status: str
    metric: str | None = None
    value: float | None = None
    bound: float | None = None
    message: str = ""


def _num(x) -> float:
    return float("nan") if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def judge(row: dict, base: dict | None, floor: dict | None) -> Verdict:
    """The verdict of one row (a backend's tensor against fp64), given the baseline's and the floor's rows."""
    status = row.get("status")
    where = _where(row)
    if status == "nan":
        return Verdict(FAIL, "nan_count", _num(row.get("nan_count")), 0.0,
                       failure_message(row, "nan/inf", f"{int(_num(row.get('nan_count')) or 0)} NaN and "
                                       f"{int(_num(row.get('inf_count')) or 0)} Inf", "0", where))
    if status == "error":
        return Verdict(ERROR, message=(row.get("reason") or "").split("\n")[0])
    if status in ("unsupported", "unavailable"):
        return Verdict(SKIP, message=row.get("reason") or status)
    tol, reasons = tolerance_for(row["backend"], row["tensor"], row["dtype"], row.get("case_id", "*"))
    ok_base = base if base is not None and base.get("status") == "ok" else None
    ok_floor = floor if floor is not None and floor.get("status") == "ok" else None
    if ok_base is None and ok_floor is None:
        return Verdict(NOREF, message="neither the same-precision baseline nor the rounding floor ran on this case")
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
    """Rows against fp64 of judged backends, with verdict, metric, value, bound and message columns."""
    rows = df[df["against"] == "fp64"]
    index = {(r["case_id"], r["backend"], r["tensor"]): r for r in rows.to_dict("records")}
    out = []
    for r in rows.to_dict("records"):
        if r["backend"] in NOT_JUDGED:
            continue
        key_base = (r["case_id"], BASELINE, r["tensor"])
        key_floor = (r["case_id"], FLOOR_BACKEND, r["tensor"])
        v = judge(r, index.get(key_base), index.get(key_floor))
        out.append({**r, "verdict": v.status, "v_metric": v.metric, "v_value": v.value, "v_bound": v.bound,
                    "v_message": v.message})
    return pd.DataFrame(out)


def by_configuration(judged: pd.DataFrame) -> pd.DataFrame:
    """One verdict per (configuration, backend, tensor) over its seeds: FAIL if any seed fails, ERROR if any errs,
    SKIP if all skip; with the worst and the median rel_rmse over seeds."""
    order = {FAIL: 0, ERROR: 1, NOREF: 2, PASS: 3, SKIP: 4}
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
    counts = counts.reindex(columns=[c for c in (PASS, FAIL, ERROR, NOREF, SKIP) if c in counts.columns])
    out = ["## Verdicts", "", RULE, "", "Configurations (all seeds, all tensors) per backend:", "",
           md_table(counts.reset_index()), ""]
    bad = conf[conf["verdict"].isin([FAIL, ERROR])].sort_values(["backend", "verdict", "group_id"])
    if bad.empty:
        out += ["No configuration failed.", ""]
    else:
        out += ["Failing configurations:", ""]
        show = bad[["backend", "tensor", "verdict", "seeds", "worst_rel_rmse", "message"]].copy()
        show["message"] = show["message"].str.replace("|", "/", regex=False).str[:400]
        out += [md_table(show, {"worst_rel_rmse": "e"}), ""]
    return "\n".join(out)
