"""The markdown report, rendered only from result files (parity.results).

Sections: environment and backend availability; a summary (backend x distribution x dtype, worst cell
each); per-T tables of every metric for the output and the final state against fp64; the pairwise
view (each backend against each other, next to each side's error against fp64); the worst cells with
where their max_diff sits; every unsupported or failed cell with its reason; the run's wall time and
the share spent on the fp64 reference. Readable in a terminal and on GitHub (pipe tables).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from tabulate import tabulate

from cases.case import CONFIG_FIELDS
from parity.markdown import fmt, md_table
from parity.results import FLOOR_BACKEND, REFERENCE_BACKENDS, ResultSet, load

CASE_COLS = list(CONFIG_FIELDS)
METRICS = ["max_diff", "mean_diff", "cos_sim", "max_ref", "rel_rmse"]
WORST = {"max_diff": "max", "mean_diff": "max", "rel_rmse": "max", "cos_sim": "min", "max_ref": "max"}


def _dtypes(row) -> str:
    h0 = "" if row["h0_dtype"] in (None, "none") or pd.isna(row["h0_dtype"]) else f"/h0 {row['h0_dtype']}"
    return f"{row['dtype']} g {row['g_dtype']} beta {row['beta_dtype']}{h0}"


def frame(rs: ResultSet) -> pd.DataFrame:
    df = rs.frame()
    if df.empty:
        return df
    for col in CASE_COLS + ["group_id", "seed", "part", "impl", "reason"]:  # absent from damaged rows
        if col not in df:
            df[col] = None
    if "against" in df:
        df["against"] = df["against"].fillna("fp64")
    df["h0_dtype"] = df["h0_dtype"].where(df["h0_dtype"].notna(), "none")
    df["dtypes"] = df.apply(_dtypes, axis=1)
    for m in METRICS + ["where_seq", "where_token", "where_head", "wall_s", "wall2_s", "ref_s", "rerun_max_diff"]:
        if m not in df:
            df[m] = float("nan")
    if "against" not in df:
        df["against"] = "fp64"
    return df


def _env_items(run: dict) -> list[tuple[str, str]]:
    env = run.get("env", {})
    git = env.get("git", {}) or {}
    pk = env.get("packages", {}) or {}
    dirty = " (dirty)" if git.get("dirty") else ""
    return [
        ("GPU", f"{env.get('gpu') or 'none'} x{env.get('gpu_count')} (sm_{env.get('sm')}), driver {env.get('driver')}, "
                f"CUDA {env.get('cuda')}"),
        ("host", f"{env.get('host')}, {env.get('platform')}, Python {env.get('python')}"),
        ("packages", ", ".join(f"{k} {v}" for k, v in pk.items())),
        ("commit", f"{git.get('commit') or 'unknown'}{dirty}"),
        ("reference", f"{run.get('ref_version')} (chunked fp64, checked against the recurrent fp64 loop where cheap: "
                      f"backend ref-recurrent)"),
    ]


def section_environment(rs: ResultSet) -> str:
    """The run's parts (a resumed run has several), the machine (once when every part shares it) and the backends."""
    lines = ["## Environment", ""]
    ends = {e.get("part"): e for e in rs.ends}
    parts = [(r.get("part"), (r.get("env") or {}).get("date"), r.get("matrix"), r.get("shard") or "-",
              ", ".join(r.get("backends", [])), r.get("tasks"),
              fmt(ends[r.get("part")].get("wall_s"), "s") if r.get("part") in ends else "unfinished")
             for r in rs.runs]
    lines += [tabulate(parts, headers=["part", "date", "matrix", "shard", "backends", "cases to run",
                                       "wall s"], tablefmt="pipe", disable_numparse=True), ""]
    envs = []
    for run in rs.runs:
        items = _env_items(run)
        if items not in [e for _, e in envs]:
            envs.append((run.get("part"), items))
    for part, items in envs:
        title = "" if len(envs) == 1 else f"Part {part}:\n\n"
        lines += [title + tabulate(items, headers=["", ""], tablefmt="pipe", disable_numparse=True), ""]
    avail, versions = {}, {}
    for run in rs.runs:
        avail.update(run.get("availability", {}))
        versions.update(run.get("versions", {}))
    if avail:
        rows = [(b, "yes" if a.get("available") else "no", a.get("reason") or "",
                 ", ".join(f"{k} {v}" for k, v in versions.get(b, {}).items()), a.get("conversion") or "")
                for b, a in avail.items()]
        lines += [tabulate(rows, headers=["backend", "available", "note", "versions", "input conversion"],
                           tablefmt="pipe", disable_numparse=True), ""]
    return "\n".join(lines)


def _vs_fp64(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["against"] == "fp64") & (df["status"] == "ok")]


def section_summary(df: pd.DataFrame) -> str:
    """Worst rel_rmse of o (and of the final state) per backend x distribution x dtype, next to the floor."""
    ok = _vs_fp64(df)
    out = ["## Summary: worst cell per backend x distribution x dtype", "",
           "Worst rel_rmse = RMS(out - ref) / RMS(ref) against the fp64 reference over all T, layouts and seeds of "
           "that distribution and dtype. `fp64-rounded` is the rounding floor: the fp64 reference rounded to the "
           "output dtype.", ""]
    titles = {"o": "output o", "ht": "final state", "dq": "gradient dq", "dk": "gradient dk", "dv": "gradient dv",
              "dg": "gradient dg", "dbeta": "gradient dbeta", "dh0": "gradient dh0", "h": "chunk-start states h"}
    for tensor, title in titles.items():
        sub = ok[ok["tensor"] == tensor]
        if sub.empty:
            continue
        piv = sub.pivot_table(index=["dist", "dtypes"], columns="backend", values="rel_rmse", aggfunc="max")
        nan = df[(df["against"] == "fp64") & (df["status"] == "nan") & (df["tensor"] == tensor)]
        cols = [FLOOR_BACKEND] + sorted((set(piv.columns) | set(nan["backend"])) - {FLOOR_BACKEND})
        piv = piv.reindex(columns=cols).astype(object)
        for (dist, dtypes, backend) in nan[["dist", "dtypes", "backend"]].itertuples(index=False):
            piv.loc[(dist, dtypes), backend] = "NaN/Inf"
        piv = piv.reset_index()
        shown = piv.copy()
        for c in cols:
            shown[c] = [v if isinstance(v, str) else ("-" if pd.isna(v) else fmt(v)) for v in piv[c]]
        out += [f"### {title}", "", md_table(shown), ""]
    return "\n".join(out)


def section_per_T(df: pd.DataFrame) -> str:
    """Per-T tables for every configuration that was run at several T (worst over seeds)."""
    ok = _vs_fp64(df)
    shape_cols = [c for c in CASE_COLS if c != "T"]
    out = ["## Error against fp64 by T", "",
           "Worst over seeds: max of max_diff, mean_diff, rel_rmse and max_ref, min of cos_sim; `median rel_rmse` is "
           "the median over seeds.", ""]
    groups = ok.groupby(shape_cols, dropna=False)
    for key, g in groups:
        if g["T"].nunique() < 2:
            continue
        cfg = dict(zip(shape_cols, key))
        title = (f"{cfg['dist']}, {cfg['layout']} B={cfg['B']}, H={cfg['H']} HV={cfg['HV']} K={cfg['K']} "
                 f"V={cfg['V']}, {_dtypes(cfg)}{', V-first' if cfg['state_v_first'] else ''}"
                 f"{', with gradients' if cfg['grad'] else ''}")
        out += [f"### {title}", ""]
        for tensor in ("o", "ht"):
            sub = g[g["tensor"] == tensor]
            if sub.empty:
                continue
            agg = sub.groupby(["T", "backend"]).agg(**{m: (m, WORST[m]) for m in METRICS},
                                                    **{"median rel_rmse": ("rel_rmse", "median")}).reset_index()
            agg["seeds"] = sub.groupby(["T", "backend"]).size().values
            agg = agg.sort_values(["T", "backend"])
            out += [f"`{tensor}`:", "", md_table(agg, {**{m: "e" for m in METRICS}, "cos_sim": "cos",
                                                     "median rel_rmse": "e"}), ""]
    return "\n".join(out)


def section_pairwise(df: pd.DataFrame) -> str:
    """Each pair of backends against each other, with each side's own error against fp64 on the same cell."""
    pw = df[(df["against"] != "fp64") & (df["status"] == "ok") & (df["tensor"] == "o")
            & ~df["backend"].isin(REFERENCE_BACKENDS) & ~df["against"].isin(REFERENCE_BACKENDS)]
    if pw.empty:
        return "## Backend against backend\n\nNo case had two backends that both ran.\n"
    own = _vs_fp64(df)
    own = own[own["tensor"] == "o"].set_index(["case_id", "backend"])["rel_rmse"]
    rows = []
    for (a, b), g in pw.groupby(["backend", "against"]):
        worst = g.loc[g["rel_rmse"].idxmax()]
        rows.append({
            "A": a, "B": b, "cells": len(g), "worst A vs B rel_rmse": worst["rel_rmse"],
            "A vs fp64": own.get((worst["case_id"], a), float("nan")),
            "B vs fp64": own.get((worst["case_id"], b), float("nan")),
            "A vs B max_diff": worst["max_diff"], "median A vs B": g["rel_rmse"].median(),
            "worst case": worst["case_id"],
        })
    tab = pd.DataFrame(rows)
    fm = {c: "e" for c in tab.columns if c not in ("A", "B", "cells", "worst case")}
    text = ["## Backend against backend (output o)", "",
            "How far two implementations are from each other, next to how far each is from fp64 on the same cell: "
            "when A vs B is large, the side with the larger error against fp64 is the one that is off.", "",
            md_table(tab, fm), ""]
    main = pw[(pw["layout"] == "dense") & (pw["B"] == 1) & (pw["dist"] == "qwen-gates") & (pw["h0_dtype"] == "none")
              & (~pw["grad"].astype(bool)) & (~pw["state_v_first"].astype(bool))]
    if not main.empty:
        per_t = []
        for (T, dtypes, a, b), g in main.groupby(["T", "dtypes", "backend", "against"]):
            worst = g.loc[g["rel_rmse"].idxmax()]
            per_t.append({"T": T, "dtypes": dtypes, "A": a, "B": b, "A vs B rel_rmse": worst["rel_rmse"],
                          "A vs fp64": own.get((worst["case_id"], a), float("nan")),
                          "B vs fp64": own.get((worst["case_id"], b), float("nan"))})
        tab = pd.DataFrame(per_t).sort_values(["dtypes", "T", "A", "B"])
        text += ["### By T (qwen-gates, dense B=1; worst over seeds)", "",
                 md_table(tab, {c: "e" for c in ("A vs B rel_rmse", "A vs fp64", "B vs fp64")}), ""]
    return "\n".join(text)


def section_worst(df: pd.DataFrame, n: int = 15) -> str:
    """The cells furthest above their rounding floor, with where max_diff sits."""
    ok = _vs_fp64(df)
    floor = ok[ok["backend"] == FLOOR_BACKEND].set_index(["case_id", "tensor"])["rel_rmse"]
    cand = ok[ok["backend"] != FLOOR_BACKEND].copy()
    if cand.empty:
        return ""
    cand["floor"] = [floor.get((c, t), float("nan")) for c, t in zip(cand["case_id"], cand["tensor"])]
    cand["x floor"] = cand["rel_rmse"] / cand["floor"].where(cand["floor"] > 0)
    cand = cand.sort_values("x floor", ascending=False, na_position="last").head(n)
    cand["where"] = [
        f"seq {int(s)}, " + ("final" if (t is None or pd.isna(t)) else f"tok {int(t)}") + f", head {int(h)}, ch {c}"
        if not pd.isna(s) else "-"
        for s, t, h, c in zip(cand["where_seq"], cand["where_token"], cand["where_head"], cand["where_channel"])]
    tab = cand[["backend", "tensor", "rel_rmse", "floor", "x floor", "max_diff", "max_ref", "where", "case_id"]]
    return "\n".join(["## Worst cells (rel_rmse over the rounding floor)", "",
                      md_table(tab, {"rel_rmse": "e", "floor": "e", "x floor": "s", "max_diff": "e",
                                     "max_ref": "e"}), ""])


def section_attribution(df: pd.DataFrame) -> str:
    """Chunk-start states (tensor h) against the fp64 reference's: where the error enters (parity.attribution)."""
    ok = _vs_fp64(df)
    h = ok[ok["tensor"] == "h"]
    if h.empty or "chunk_rel_rmse" not in h:
        return ""
    longest = h.loc[h.groupby(["dist", "dtypes", "backend"])["T"].idxmax()]
    own = ok.set_index(["case_id", "backend", "tensor"])["rel_rmse"]
    rows = []
    for r in longest.sort_values(["dist", "dtypes", "backend"]).to_dict("records"):
        prof = r["chunk_rel_rmse"] if isinstance(r["chunk_rel_rmse"], list) else []
        picks = {"chunk 0": 0, "25%": len(prof) // 4, "50%": len(prof) // 2, "last": len(prof) - 1} if prof else {}
        rows.append({"dist": r["dist"], "dtypes": r["dtypes"], "T": r["T"], "backend": r["backend"],
                     **{k: prof[i] for k, i in picks.items()}, "h (all chunks)": r["rel_rmse"],
                     "final state": own.get((r["case_id"], r["backend"], "ht"), float("nan")),
                     "o": own.get((r["case_id"], r["backend"], "o"), float("nan"))})
    tab = pd.DataFrame(rows)
    num = [c for c in tab.columns if c not in ("dist", "dtypes", "T", "backend")]
    return "\n".join([
        "## Attribution: where the error enters", "",
        "rel_rmse of each backend's chunk-start states (FLA's `h`) against the fp64 reference's, at the first chunk, a "
        "quarter, half way and the last chunk (binned), then over all chunks, next to the final state and the output "
        "(the longest T of each configuration, one seed). Large already at chunk 0 points at the intra-chunk stage or "
        "the stored state's rounding; growth with the chunk index at the state recurrence; small states with a large "
        "output error at the output stage.", "",
        md_table(tab, {c: "e" for c in num}), ""])


def section_growth(df: pd.DataFrame, out_dir: str | Path | None) -> str:
    """Error growth and location: rel_rmse by token position and by head (parity.positional) at the longest T of
    every T sweep, and the figures (parity.plots): rel_rmse vs T, error by position, per-head bars."""
    import statistics

    from parity import plots
    from parity.positional import N_BINS, decode

    out = ["## Error growth and location", "",
           f"Columns `pos_rel_rmse` / `head_rel_rmse` of each row against fp64: rel_rmse in {N_BINS} bins of token "
           f"position within each sequence (bin i: position p of a sequence of length L with "
           f"floor({N_BINS} p / L) = i; a dense row is one sequence of T tokens) and per head. Table: the output o "
           f"at the longest T of every T sweep, worst over seeds per bin and per head.", ""]
    sws = plots.sweeps(df)
    rows = []
    for sw in sws:
        at = sw.rows[(sw.rows["T"] == sw.T_max) & (sw.rows["tensor"] == "o")]
        for b, g in at.groupby("backend"):
            pos = [p for p in (decode(v) for v in g.get("pos_rel_rmse", [])) if p is not None]
            heads = [h for h in (decode(v) for v in g.get("head_rel_rmse", [])) if h is not None and h]
            if not pos or not heads:
                continue
            first = max((p[0] for p in pos if not math.isnan(p[0])), default=float("nan"))
            last = max((p[-1] for p in pos if not math.isnan(p[-1])), default=float("nan"))
            per_head = [max(h[j] for h in heads) for j in range(min(len(h) for h in heads))]
            worst_h = max(range(len(per_head)), key=lambda j: per_head[j])
            med = statistics.median(per_head)
            rows.append({"sweep": sw.title, "T": sw.T_max, "backend": b, "first 1/16": first, "last 1/16": last,
                         "last / first": last / first if first > 0 else float("nan"),
                         "worst head": f"{worst_h}: {fmt(per_head[worst_h])}",
                         "worst / median head": per_head[worst_h] / med if med > 0 else float("nan")})
    if rows:
        out += [md_table(pd.DataFrame(rows), {"first 1/16": "e", "last 1/16": "e", "last / first": "s",
                                              "worst / median head": "s"}), ""]
    elif sws:
        out += ["The rows carry no per-position or per-head columns (written before `parity/positional.py` existed): "
                "no position table and no position or per-head figures.", ""]
    else:
        out += ["No configuration was run at more than one T.", ""]
    if out_dir is None:
        return "\n".join(out + ["Figures not drawn: rendered without an output folder (`python -m parity report` "
                                "draws them).", ""])
    figs = plots.render(df, out_dir)
    if figs.note:
        return "\n".join(out + [f"Figures not drawn: {figs.note}.", ""])
    if figs.sweeps:
        out += ["### By T and by position", "",
                "For each T sweep: rel_rmse against T (log-log), worst over seeds solid, median dashed, with the "
                "rounding floor `fp64-rounded` and the same-precision baseline `torch-emulated` (`ref-recurrent`, "
                "fp64, is left out); then rel_rmse by position at the longest T, worst over seeds per bin.", ""]
        for sw, a, b in figs.sweeps:
            out += [f"#### {sw.title}", "", f"![rel_rmse vs T: {sw.title}]({a})"
                    + (f" ![rel_rmse by position at T={sw.T_max}: {sw.title}]({b})" if b else ""), ""]
    if figs.heads:
        out += ["### Per head: the worst cells", "",
                "The cell with the highest rel_rmse over the rounding floor of each backend and tensor (the worst "
                f"{len(figs.heads)}), per head, next to `torch-emulated` and `fp64-rounded` on the same case.", ""]
        out += [f"![{title}]({path})\n" for title, path in figs.heads]
    if figs.skipped:
        out += [f"Not drawn: {'; '.join(figs.skipped)}.", ""]
    if not figs.sweeps and not figs.heads:
        out += ["No figures: no T sweep and no per-head columns in these rows.", ""]
    return "\n".join(out)


def section_recommended(rs: ResultSet, df: pd.DataFrame, out_dir: str | Path | None) -> str:
    """Recommended tolerances per (dtype, gate dtype, T range, distribution family, tensor) (parity.recommend);
    written to ``out_dir``/tolerances.json when an output folder is given."""
    from parity import recommend

    entries = recommend.recommend(df)
    if out_dir is not None and entries:
        recommend.write_tolerances(recommend.document(rs, entries), Path(out_dir) / "tolerances.json")
    return recommend.section(entries, json_name="tolerances.json" if out_dir is not None else None)


def section_failures(df: pd.DataFrame) -> str:
    bad = df[(df["status"] != "ok") & (df["against"] == "fp64")]
    out = ["## Unsupported, unavailable and failed cells", ""]
    if bad.empty:
        return "\n".join(out + ["None: every backend ran every case.", ""])
    bad = bad.assign(first_line=bad["reason"].fillna("").str.split("\n").str[0].str[:240])
    rows = []
    for (backend, status, reason), g in bad.groupby(["backend", "status", "first_line"]):
        ids = sorted(g["case_id"].unique())
        rows.append({"backend": backend, "status": status, "cells": len(ids), "reason": reason,
                     "e.g.": ids[0] + (f" (+{len(ids) - 1} more)" if len(ids) > 1 else "")})
    tab = pd.DataFrame(rows).sort_values(["status", "backend"])
    return "\n".join(out + [md_table(tab), ""])


def section_determinism(df: pd.DataFrame) -> str:
    ok = _vs_fp64(df)
    ok = ok[(ok["backend"] != FLOOR_BACKEND) & ok["rerun_max_diff"].notna()]
    if ok.empty:
        return ""
    rows = []
    for b, g in ok.groupby("backend"):
        diffs = g["rerun_max_diff"].astype(float)
        rows.append({"backend": b, "cells": len(g), "bitwise equal": int((diffs == 0).sum()),
                     "worst run-to-run max diff": diffs.max()})
    return "\n".join(["## Determinism (each backend run twice on the same inputs)", "",
                      md_table(pd.DataFrame(rows), {"worst run-to-run max diff": "e"}), ""])


def section_footer(rs: ResultSet, df: pd.DataFrame) -> str:
    wall = sum(e.get("wall_s", 0.0) for e in rs.ends)
    ref = sum(e.get("ref_s", 0.0) for e in rs.ends)
    ended = {e.get("part") for e in rs.ends}
    spans = []
    if "at" in df and not df.empty:
        for part, g in df[~df["part"].isin(ended)].groupby("part"):
            if g["at"].notna().any():
                spans.append(f"part {part} unfinished, rows written over {g['at'].max() - g['at'].min():.0f} s")
    n_cases = df["case_id"].nunique() if not df.empty else 0
    restarts = sum(e.get("worker_restarts", 0) for e in rs.ends)
    warm = [e["warmup"] for e in rs.ends if e.get("warmup")]
    warm_s = sum(w.get("seconds", 0.0) for w in warm)
    warm_desc = (f"{warm_s:.1f} s ({sum(w.get('signatures', 0) for w in warm)} compile signatures)" if warm
                 else "none")
    slowest = sorted((t for w in warm for t in w.get("slowest", [])), reverse=True)[:3]
    if slowest:  # recorded since the warm-up's task scheduler (older files have none)
        busy = sum(w.get("busy_s", 0.0) for w in warm)
        warm_desc += (f" with {busy:.0f} s of compile work, the slowest " +
                      ", ".join(f"{b} {t:.0f} s" for t, b, _ in slowest))
    share = f"{100 * ref / wall:.0f}%" if wall > 0 else "-"
    unfinished = len(rs.runs) - len(rs.ends)
    if rs.ends:
        timing = (f"wall time {wall:.1f} s over {len(rs.ends)} finished part(s)"
                  f"{f' ({unfinished} unfinished)' if unfinished > 0 else ''}, of which the fp64 reference {ref:.1f} s "
                  f"({share}), and the compile warm-up {warm_desc}; {restarts} worker restart(s).")
    else:
        timing = f"wall time unknown: none of the {len(rs.runs)} part(s) finished."
    lines = ["---", "",
             f"{n_cases} cases, {len(df)} rows; {timing}" + (f" ({'; '.join(spans)}.)" if spans else "")
             + f" Rendered from `{rs.path}` by `python -m parity report`."]
    return "\n".join(lines) + "\n"


def render(rs: ResultSet, out_dir: str | Path | None = None) -> str:
    """The whole report as markdown. With ``out_dir`` (the report's folder) the figures are drawn into
    ``out_dir``/plots and the recommended tolerances written to ``out_dir``/tolerances.json."""
    df = frame(rs)
    run = rs.runs[0] if rs.runs else {}
    env = run.get("env", {})
    head = [f"# gdn-parity report: {run.get('run_id', '?')}", "",
            f"Matrix `{run.get('matrix')}` on {env.get('gpu') or 'CPU (no GPU)'}; every backend against the fp64 "
            f"reference (chunked WY form in float64).", ""]
    if df.empty:
        return "\n".join(head + [section_problems(rs), "No rows yet.", ""])
    from parity import engines, findings

    parts = [*head, section_problems(rs), _guarded(findings.section, rs, df), _guarded(section_environment, rs)]
    try:
        from parity import verdicts
    except ImportError:
        verdicts = None
    if verdicts is not None:
        parts.append(_guarded(verdicts.section, df))
    parts.append(_guarded(engines.section, rs, df))
    parts += [_guarded(section_summary, df), _guarded(section_per_T, df), _guarded(section_growth, df, out_dir),
              _guarded(section_pairwise, df), _guarded(section_worst, df),
              _guarded(section_attribution, df), _guarded(section_recommended, rs, df, out_dir),
              _guarded(section_determinism, df), _guarded(section_failures, df), _guarded(section_footer, rs, df)]
    return "\n\n".join(p.strip("\n") for p in parts if p) + "\n"


def _guarded(section, *args) -> str:
    """``section(*args)``, or a note naming the section and the error when it cannot be rendered from these rows
    (a damaged or partial file): one section never costs the others."""
    try:
        return section(*args)
    except Exception as err:  # noqa: BLE001
        return (f"**{section.__name__} could not be rendered from these rows**: {type(err).__name__}: "
                f"{str(err)[:300]}\n")


def section_problems(rs: ResultSet, shown: int = 20) -> str:
    """What loading skipped or replaced (parity.results.load's problems), with file and line."""
    if not rs.problems:
        return ""
    lines = [f"- {p}" for p in rs.problems[:shown]]
    if len(rs.problems) > shown:
        lines.append(f"- ... and {len(rs.problems) - shown} more")
    return "\n".join(["## Damaged or partial result file", "",
                      f"{len(rs.problems)} line(s) of the result file were skipped or replaced; the report is "
                      f"rendered from the readable rows.", "", *lines, ""])


def write_report(results: list[str | Path], out: str | Path | None = None) -> Path:
    """Render the report of ``results`` to ``out`` (default: report.md next to the first file), with its figures
    in plots/ and tolerances.json next to it."""
    rs = load(*results)
    out = Path(out) if out else Path(results[0]).parent / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rs, out_dir=out.parent))
    return out
