"""Appends a benchmark's printed table to ``benchmarks/RESULTS.md``, keyed by commit, GPU and date.

Each call adds one section: a heading with the script, the short commit (as the result files record it, with
``+dirty`` when the tree has uncommitted changes), the GPU's name and the UTC date, then the table in a fenced
block exactly as printed.  The file is created when missing; nothing in it is rewritten.
"""

from __future__ import annotations

import datetime
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def commit() -> str:
    """The short commit, ``+dirty`` when tracked files differ from it; "unknown" outside git.  The same source as
    the result files' (parity.environment.git_info: GDN_PARITY_COMMIT wins on a GPU box whose tree copy may carry
    a stale .git)."""
    from parity.environment import git_info

    info = git_info()
    if not info["commit"]:
        return "unknown"
    return info["commit"][:7] + ("+dirty" if info["dirty"] else "")


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def interrupted(done: int, total: int) -> str:
    """The line a benchmark's summary and section end with when a SIGINT stopped it after ``done`` of ``total``
    shapes."""
    return f"interrupted after {done} of {total} shapes; the others not timed"


def append(script: str, lines: list[str], path: str = RESULTS, gpu: str | None = None,
           when: datetime.datetime | None = None) -> str:
    """Append ``lines`` (the printed table) as one section of ``path``; returns the section's heading."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    heading = f"## {script} - commit {commit()}, {gpu or gpu_name()}, {when:%Y-%m-%d %H:%M} UTC"
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nOne section per benchmark run, appended by the scripts "
                    "(``benchmarks/record.py``).\n")
        f.write(f"\n{heading}\n\n```\n" + "\n".join(lines) + "\n```\n")
    return heading
