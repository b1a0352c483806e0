"""Markdown for reports: number formatting and pipe tables (GitHub and terminal readable).

The one place the report, the verdict and recommendation sections, compare and replay get their tables from;
it imports nothing of parity, so any module can use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pandas as pd
from tabulate import tabulate

__all__ = ["fmt", "md_table", "md_rows"]


def fmt(x, kind: str = "e") -> str:
    """3 significant digits (scientific) for errors; 8 decimals for cos_sim; '-' for missing; 'nan' kept."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan" if isinstance(x, float) else "-"
    if isinstance(x, str):
        return x
    if kind == "cos":
        return f"{x:.8f}"
    if kind == "s":
        return f"{x:.2f}"
    return f"{x:.2e}"


def md_table(df: pd.DataFrame, formats: dict[str, str] | None = None) -> str:
    """A pipe table of a frame's columns; columns in ``formats`` are formatted ('e', 'cos' or 's')."""
    formats = formats or {}
    shown = df.copy()
    for col, kind in formats.items():
        if col in shown:
            shown[col] = [fmt(v, kind) for v in shown[col]]
    return tabulate(shown, headers="keys", tablefmt="pipe", showindex=False, disable_numparse=True)


def md_rows(rows: Iterable[Sequence], headers: Sequence[str]) -> str:
    """A pipe table of rows (tuples of cells, shown as given: no number parsing)."""
    return tabulate(list(rows), headers=list(headers), tablefmt="pipe", disable_numparse=True)
