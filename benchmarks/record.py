"""Appends a benchmark's printed table to ``benchmarks/RESULTS.md``, keyed by commit, GPU and date.

Each call adds one section: a heading with the script, the short commit (``git rev-parse --short HEAD``, with
``+dirty`` when the tree has uncommitted changes), the GPU's name and the UTC date, then the table in a fenced
block exactly as printed.  The file is created when missing; nothing in it is rewritten.
"""

from __future__ import annotations

import datetime
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it; "unknown" outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


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
