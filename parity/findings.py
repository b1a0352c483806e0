"""The answer first: the report's opening "Findings" section, from result rows only.

Which backends fail (verdict FAIL or ERROR, parity.verdicts; or are withheld: NO-BASELINE, INVALID) on which
configurations, by how much over the rounding floor (worst rel_rmse / the floor's rel_rmse on the same case and tensor), with the known cause and link from
tests/known_failures.json where an entry names the cell; then what the serving engines run (parity.engines).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from parity import known_failures
from parity.backends import BASELINE
from parity.results import FLOOR_BACKEND, REFERENCE_BACKENDS

MAX_ROWS = 25


def _errors(df: pd.DataFrame, backend: str) -> pd.Series:
    """rel_rmse against fp64 of ``backend``'s clean rows, indexed by (case_id, tensor)."""
    ok = df[(df["against"] == "fp64") & (df["status"] == "ok") & (df["backend"] == backend)]
    return ok.set_index(["case_id", "tensor"])["rel_rmse"]


def _ratio(value, over) -> float:
    return value / over if pd.notna(value) and over is not None and pd.notna(over) and over > 0 else float("nan")


def worst_over_floor(df: pd.DataFrame, tensor: str = "o") -> pd.DataFrame:
    """Worst rel_rmse / rounding floor of ``tensor`` per backend (rows) and gate dtype (columns), over the cases
    that ran; the floor, the baseline and the fp64 references are left out."""

    ok = df[(df["against"] == "fp64") & (df["status"] == "ok") & (df["tensor"] == tensor)
            & ~df["backend"].isin([FLOOR_BACKEND, BASELINE, *REFERENCE_BACKENDS])]
    if ok.empty:
        return pd.DataFrame()
    floor = _errors(df, FLOOR_BACKEND)
    ratio = [_ratio(r, floor.get((c, tensor))) for r, c in zip(ok["rel_rmse"], ok["case_id"])]
    piv = ok.assign(ratio=ratio).pivot_table(index="backend", columns="g_dtype", values="ratio", aggfunc="max")
    return piv.rename(columns=lambda g: f"gates {g}").reset_index()


def failing(df: pd.DataFrame, known: list[dict]) -> pd.DataFrame:
    """One row per failing or withheld (backend, configuration, tensor): verdict, seeds that fail, worst rel_rmse, x floor and
    the known cause; sorted by backend, then by x floor (worst first)."""
    from parity import verdicts

    judged = verdicts.judge_frame(df)
    if judged.empty:
        return pd.DataFrame()
    bad = judged[judged["verdict"].isin([verdicts.FAIL, verdicts.ERROR, verdicts.NOREF, verdicts.INVALID])]
    if bad.empty:
        return pd.DataFrame()
    floor, base = _errors(df, FLOOR_BACKEND), _errors(df, BASELINE)
    rows = []
    for (backend, gid, tensor), g in bad.groupby(["backend", "group_id", "tensor"]):
        worst = g.loc[g["rel_rmse"].idxmax()] if g["rel_rmse"].notna().any() else g.iloc[0]
        key = (worst["case_id"], tensor)
        causes = [c for c in (known_failures.cause(known, cid, backend) for cid in g["case_id"]) if c]
        rows.append({"backend": backend, "configuration": gid, "tensor": tensor,
                     "verdict": ",".join(sorted(set(g["verdict"]))), "seeds": len(g),
                     "rel_rmse": worst["rel_rmse"], "x floor": _ratio(worst["rel_rmse"], floor.get(key)),
                     "x baseline": _ratio(worst["rel_rmse"], base.get(key)),
                     "cause": causes[0] if causes else (worst["v_message"].split("|")[0].strip()
                                                        if worst["verdict"] == verdicts.FAIL else worst["v_message"])})
    out = pd.DataFrame(rows)
    return out.sort_values(["backend", "x floor"], ascending=[True, False], na_position="first")


def section(rs, df: pd.DataFrame, known_path: str | Path = known_failures.PATH) -> str:
    """The markdown section: failing configurations (at most MAX_ROWS, the worst per backend first), the backends
    with none, and the engine view's summary."""
    from parity import engines
    from parity.markdown import md_table

    out = ["## Findings", ""]
    try:
        known = known_failures.load(known_path)
        note = ""
    except ValueError as err:
        known, note = [], f"Known causes not read: {err}."
    fails = failing(df, known)

    judged_backends = sorted(set(df.loc[(df["against"] == "fp64") & (df["status"] == "ok"), "backend"])
                             - {FLOOR_BACKEND, BASELINE, *REFERENCE_BACKENDS})
    if fails.empty:
        out += ["No backend failed a verdict in this run.", ""]
    else:
        per = fails.groupby("backend").size()
        out += ["Failing configurations per backend: " + ", ".join(f"`{b}` {n}" for b, n in per.items())
                + ". Worst first; `x floor` = rel_rmse / the rounding floor's rel_rmse on the same case and tensor "
                f"(the final state's floor is fp32 rounding), `x baseline` = rel_rmse / `{BASELINE}`'s; `cause` from "
                "tests/known_failures.json where an entry names the cell, else the verdict's message.", ""]
        shown = fails.groupby("backend", group_keys=False).head(max(1, MAX_ROWS // max(1, len(per))))
        shown = shown.assign(cause=shown["cause"].str.replace("|", "/", regex=False).str[:300])
        out += [md_table(shown, {"rel_rmse": "e", "x floor": "s", "x baseline": "s"}), ""]
        if len(shown) < len(fails):
            out += [f"({len(fails) - len(shown)} more failing rows in the verdict section.)", ""]
    clean = [b for b in judged_backends if fails.empty or b not in set(fails["backend"])]
    if clean:
        out += ["No failure: " + ", ".join(f"`{b}`" for b in clean) + ".", ""]
    if note:
        out += [note, ""]
    worst = worst_over_floor(df)
    if not worst.empty:
        out += ["Worst rel_rmse of the output over its rounding floor, per backend and gate dtype (every case that "
                "ran):", "", md_table(worst, {c: "s" for c in worst.columns if c != "backend"}), ""]
    out += ["What the serving engines run here:", "", *engines.summary_lines(rs, df), ""]
    return "\n".join(out)
