#!/usr/bin/env python3
"""One line per profiled kernel from Nsight Compute's CSV (``ncu --csv --page details ...``).

    python3 scripts/ncu_summary.py ncu.csv [--markdown]

Columns: launch id, kernel, grid, block, duration (us), SM and memory throughput (% of peak), DRAM throughput,
registers per thread, dynamic shared memory per block (KB), theoretical / achieved occupancy (%), the occupancy
limiter (the smallest "Block Limit ..."), warp cycles per issued instruction, Mem Busy (%) and
the shared-memory bank conflicts of loads and stores (thousands, when collected); then the total time per kernel
name. A metric a section did not collect shows as "-". Lines ncu prints before the CSV (``==PROF==`` ...) and
the program's own output are skipped.
"""

from __future__ import annotations

import argparse
import io
import sys

import pandas as pd

METRICS = {  # column -> ncu metric name (details page)
    "us": "Duration",
    "sm%": "Compute (SM) Throughput",
    "mem%": "Memory Throughput",
    "dram%": "DRAM Throughput",
    "regs": "Registers Per Thread",
    "smem_kb": "Dynamic Shared Memory Per Block",
    "occ_th%": "Theoretical Occupancy",
    "occ%": "Achieved Occupancy",
    "cpi": "Warp Cycles Per Issued Instruction",
    "membusy%": "Mem Busy",                                                     # MemoryWorkloadAnalysis
    "bank_ld_k": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",   # --metrics (thousands)
    "bank_st_k": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
}
TIME_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,   # older ncu
           "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}                          # ncu 2025 (H200 box)
BYTES_KB = {"byte": 1 / 1024, "Kbyte": 1000 / 1024, "KB": 1.0, "Mbyte": 1e6 / 1024, "MB": 1024.0}


def read(text: str) -> pd.DataFrame:
    """The CSV rows of ncu's details page (everything from the '"ID",' header line on)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError("no ncu CSV header ('\"ID\",...') found: was ncu run with --csv --page details?")
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])), dtype=str)
    need = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(df.columns):
        raise ValueError(f"ncu CSV lacks columns {sorted(need - set(df.columns))}")
    return df


def _number(value: str, unit: str, column: str) -> float:
    x = float(str(value).replace(",", ""))
    unit = str(unit).split("/")[0]  # "Kbyte/block" -> "Kbyte"
    if column == "us":
        return x * TIME_US.get(unit, float("nan"))
    if column == "smem_kb":
        return x * BYTES_KB.get(unit, float("nan"))
    if column.endswith("_k"):
        return x / 1e3
    return x


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per launch (ID), in launch order, with the METRICS columns and the occupancy limiter."""
    rows = []
    for kid, g in df.groupby(df["ID"].astype(int), sort=True):
        first = g.iloc[0]
        row = {"id": kid, "kernel": first["Kernel Name"].split("(")[0].split("<")[0].removeprefix("void "),
               "grid": first.get("Grid Size", "-"), "block": first.get("Block Size", "-")}
        # rule rows (ncu's advice lines) have no metric name: pandas reads it as NaN
        # the first row of a name wins: "Memory Throughput" is a % in SpeedOfLight and a rate in
        # MemoryWorkloadAnalysis, which comes later
        by_name = {}
        for _, r in g.iterrows():
            if isinstance(r["Metric Name"], str):
                by_name.setdefault(r["Metric Name"], r)
        for col, name in METRICS.items():
            r = by_name.get(name)
            try:
                row[col] = _number(r["Metric Value"], r["Metric Unit"], col) if r is not None else float("nan")
            except ValueError:
                row[col] = float("nan")
        limits = {n.replace("Block Limit ", ""): float(str(r["Metric Value"]).replace(",", ""))
                  for n, r in by_name.items() if n.startswith("Block Limit ")}
        row["limiter"] = min(limits, key=limits.get) if limits else "-"
        rows.append(row)
    return pd.DataFrame(rows)


def render(s: pd.DataFrame, markdown: bool = False) -> str:
    from tabulate import tabulate

    fmt = "github" if markdown else "simple"
    shown = s.copy()
    for c in METRICS:
        shown[c] = shown[c].map(lambda x: "-" if pd.isna(x) else f"{x:.1f}")
    out = [tabulate(shown, headers="keys", tablefmt=fmt, showindex=False)]
    tot = s.groupby("kernel", sort=False)["us"].agg(["count", "sum"]).sort_values("sum", ascending=False)
    total = s["us"].sum()
    tot["share%"] = 100 * tot["sum"] / total if total > 0 else float("nan")
    out += ["", f"time per kernel (total {total:.1f} us):",
            tabulate(tot.reset_index(), headers=["kernel", "launches", "us", "share %"], tablefmt=fmt,
                     showindex=False, floatfmt=".1f")]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    with open(args.csv, errors="replace") as f:
        text = f.read()
    try:
        s = summarize(read(text))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(s, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
