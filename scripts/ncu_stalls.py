#!/usr/bin/env python3
"""Where one kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

    ncu -i REPORT.ncu-rep -k KERNEL --page source --csv --print-source sass > k.csv
    python3 scripts/ncu_stalls.py k.csv [--min 0.5] [--ranges 0:296=prologue,296:304=load-wait,...]

(the report needs ``--section SourceCounters``; ``scripts/gpu_steps.sh profile-source`` writes one CSV per kernel and
runs this on each.)  Prints the warp-state samples' shares by stall reason, every instruction holding at least
``--min`` % of the samples (its index in the listing, share, cumulative share, SASS text, its two largest reasons),
and with ``--ranges`` the share of each named range of instruction indices ``[a, b)``.  Samples are taken from
every resident warp whether it issues or waits, so a share is that of the warps' time, not of one critical path.
"""

from __future__ import annotations

import argparse
import io
import sys

import pandas as pd

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(text: str) -> pd.DataFrame:
    """The instruction rows (columns ``Source``, the sample count ``s`` and every ``stall_*`` count) of one kernel's
    source page; the listing's first line names the kernel and is skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address","Source"')), None)
    if start is None:
        raise ValueError('no source-page header ("Address","Source",...) found: was it written with '
                         "--page source --csv --print-source sass from a report with --section SourceCounters?")
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])), dtype=str)
    if SAMPLES not in df.columns:
        raise ValueError(f"the source page lacks {SAMPLES!r}: profile with --section SourceCounters")
    out = pd.DataFrame({"Source": df["Source"].fillna("").str.strip()})
    out["s"] = pd.to_numeric(df[SAMPLES], errors="coerce").fillna(0)
    for c in stall_columns(df):
        out[c] = pd.to_numeric(df[c], errors="coerce").fillna(0)
    return out


def stall_columns(df: pd.DataFrame) -> list[str]:
    """The per-reason sample columns (``stall_long_sb`` ...), without their "(Not Issued)" twins."""
    return [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]


def reasons(df: pd.DataFrame) -> pd.Series:
    """Each stall reason's share of all samples, in %, largest first."""
    sums = df[stall_columns(df)].sum()
    r = sums * (100 / tot) if (tot := df["s"].sum()) > 0 else sums * float("nan")
    return r.rename(lambda c: c.removeprefix("stall_")).sort_values(ascending=False)


def hot(df: pd.DataFrame, min_share: float) -> list[tuple]:
    """(index, share %, cumulative share %, SASS text, [(reason, % of the instruction's samples)] x 2) of every
    instruction with at least ``min_share`` % of the samples, in listing order."""
    tot = df["s"].sum()
    if tot <= 0:
        return []
    cols = stall_columns(df)
    cum = df["s"].cumsum() / tot * 100
    out = []
    for i, r in df.iterrows():
        share = r["s"] / tot * 100
        if share >= min_share:
            top = sorted(((r[c], c.removeprefix("stall_")) for c in cols), reverse=True)[:2]
            out.append((i, share, cum[i], r["Source"], [(n, v / r["s"] * 100) for v, n in top if v > 0]))
    return out


def parse_ranges(spec: str, n: int) -> list[tuple[str, int, int]]:
    """``"a:b=name,..."`` -> [(name, a, b)]; an empty ``b`` is the listing's end (``n``)."""
    out = []
    for part in filter(None, spec.split(",")):
        span, sep, name = part.partition("=")
        a, colon, b = span.partition(":")
        if not sep or not colon or not name:
            raise ValueError(f"range {part!r}: want START:END=NAME")
        lo, hi = int(a or 0), int(b) if b else n
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"range {part!r}: outside the listing's {n} instructions")
        out.append((name, lo, hi))
    return out


def range_shares(df: pd.DataFrame, ranges: list[tuple[str, int, int]]) -> list[tuple[str, float]]:
    tot = df["s"].sum()
    return [(name, df["s"].iloc[a:b].sum() / tot * 100 if tot > 0 else float("nan")) for name, a, b in ranges]


def render(df: pd.DataFrame, min_share: float, ranges: list[tuple[str, int, int]] | None = None) -> str:
    out = [f"{int(df['s'].sum())} samples over {len(df)} instructions", "stall reasons, % of the samples:"]
    out += [f"  {name:<20} {v:5.1f}" for name, v in reasons(df).items() if v >= 0.05]
    out.append(f"instructions with at least {min_share} % of the samples (index, %, cumulative %):")
    for i, share, cum, src, top in hot(df, min_share):
        why = " ".join(f"{n}:{v:.0f}%" for n, v in top)
        out.append(f"  {i:6d} {share:5.1f} {cum:6.1f}  {src[:72]:<72} {why}")
    if ranges:
        out.append("ranges of instructions, % of the samples:")
        out += [f"  {name:<32} {v:5.1f}" for name, v in range_shares(df, ranges)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--min", type=float, default=0.5, help="the smallest share (%%) of an instruction listed")
    ap.add_argument("--ranges", default="", help="START:END=NAME,... ranges of instruction indices to sum")
    args = ap.parse_args(argv)
    with open(args.csv, errors="replace") as f:
        text = f.read()
    try:
        df = read(text)
        ranges = parse_ranges(args.ranges, len(df))
    except ValueError as e:
        print(f"error: {args.csv}: {e}", file=sys.stderr)
        return 2
    print(render(df, args.min, ranges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
