"""``benchmarks/bench_kernels_bwd.py`` on a CPU (``--dry-run``: the emulations stand in for the kernels): its A/B
column for the backward's stream order and the switch behind it."""

from __future__ import annotations

import pytest

from benchmarks import bench_kernels_bwd as bench
from kernels.gdn_bwd import api


def test_serial_column_switches_the_overlap_off_inside_and_restores_it():
    assert api._OVERLAP_RECOMPUTE is True
    with bench.backward_context(bench.SERIAL):
        assert api._OVERLAP_RECOMPUTE is False
    assert api._OVERLAP_RECOMPUTE is True
    with pytest.raises(RuntimeError), bench.backward_context(bench.SERIAL):
        raise RuntimeError("a failing cell")
    assert api._OVERLAP_RECOMPUTE is True
    with bench.backward_context("ours"):
        assert api._OVERLAP_RECOMPUTE is True


def test_dry_run_times_the_serial_column(capsys):
    assert bench.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--tables", "split",
                       "--serial-recompute", "--rep", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("== summary"):]
    row = next(line for line in summary.splitlines() if line.startswith("B1_T8192_H4_HV8"))
    assert "ours-serial" in summary and row.count("(") == 2       # both columns timed
