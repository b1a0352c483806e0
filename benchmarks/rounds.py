"""Interleaved timing rounds: every column of a shape is timed once per round, the column order reversed every
other round, so that a machine whose speed drifts during a run (clocks, other tenants, the host) moves every column
alike.  A column's figure is the median of its rounds; a ratio of two columns is the median of their per-round
ratios (paired), with the rounds' smallest and largest beside it.
"""

from __future__ import annotations

import statistics
from typing import Callable

__all__ = ["HOST_BOUND", "host_cell", "interleave", "median_of", "paired_ratio", "paired_table", "spread"]

HOST_BOUND = 0.9    # host time a call over its median from which the median is taken to be the host's


def interleave(fns: dict[str, Callable[[], tuple]], rounds: int,
               on_error: Callable[[str, BaseException], None] | None = None) -> dict[str, list[tuple]]:
    """Call every ``fns[col]()`` (one timing, a tuple of floats) once per round; rounds 1, 3, ... go in reverse
    column order.  A column that raises is reported to ``on_error`` once and left out of later rounds; the others
    go on.  Returns {col: [timing of round 0, round 1, ...]} (an empty list for a column that failed at once)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out = {c: [] for c in fns}
    failed = set()
    order = list(fns)
    for r in range(rounds):
        for col in (order if r % 2 == 0 else order[::-1]):
            if col in failed:
                continue
            try:
                out[col].append(tuple(fns[col]()))
            except Exception as e:          # one column's failure never stops the others
                failed.add(col)
                if on_error is not None:
                    on_error(col, e)
    return out


def median_of(samples: list[tuple], i: int) -> float | None:
    """Median over the rounds of component ``i``; None without rounds."""
    return statistics.median(s[i] for s in samples) if samples else None


def paired_ratio(num: list[tuple], den: list[tuple], i: int) -> tuple[float, float, float] | None:
    """(median, min, max) over the rounds both columns completed of num[r][i] / den[r][i]; None without any."""
    rs = [a[i] / b[i] for a, b in zip(num, den) if b[i] > 0]
    return (statistics.median(rs), min(rs), max(rs)) if rs else None


def spread(samples: list[tuple], i: int) -> float | None:
    """(largest - smallest) / median of component ``i`` over the rounds: how far the machine moved; None below two
    rounds."""
    if len(samples) < 2:
        return None
    xs = [s[i] for s in samples]
    return (max(xs) - min(xs)) / statistics.median(xs)


def paired_table(rounds_of: dict, cols: list, ours: str, i: int = 0, what: str = "") -> list[str]:
    """Lines of column / ``ours`` per round on component ``i``: median [smallest, largest] per shape and column
    (< 1: the column is faster), and the spread of ``ours`` over the rounds.  ``rounds_of``: {shape: {column:
    [timing tuple of each round]}}; ``what`` names the component in the heading."""
    others = [c for c in cols if c != ours and any(r.get(c) for r in rounds_of.values())]
    if not others:
        return []
    out = ["", f"column / {ours}{', ' + what if what else ''}, per round: median [smallest, largest] (< 1: the "
               f"column is faster); spread of {ours} over the rounds",
           f"{'shape':<26}" + "".join(f"{c:>26}" for c in others) + f"{'spread':>10}"]
    for name, per in rounds_of.items():
        mine = per.get(ours)
        line = f"{name:<26}"
        for c in others:
            pr = paired_ratio(per[c], mine, i) if (mine and per.get(c)) else None
            line += f"{('%.3f [%.3f, %.3f]' % pr) if pr else '-':>26}"
        sp = spread(mine, i) if mine else None
        out.append(line + f"{('%.0f%%' % (100 * sp)) if sp is not None else '-':>10}")
    return out


def host_cell(host_ms: float | None, median_ms: float | None) -> str:
    """``host_ms`` (the host time of one call) formatted for a table, ``*`` after it where it reaches
    ``HOST_BOUND`` of the call's median ``median_ms``: there the GPU waited for the host and the median is the
    host's; ``-`` where not measured."""
    if host_ms is None:
        return "-"
    bound = median_ms is not None and host_ms >= HOST_BOUND * median_ms
    return f"{host_ms:.3f}" + ("*" if bound else "")
