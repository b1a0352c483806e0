"""``benchmarks/bench_kernels_bwd.py`` on a CPU (``--dry-run``: the emulations stand in for the kernels): its A/B
columns (``--ab``: our backward with one of its private switches off) and the switches behind them."""

from __future__ import annotations

import pytest

from benchmarks import bench_kernels_bwd as bench
from kernels.gdn_bwd import api


def _state():
    """The value of every AB switch now."""
    import importlib
    return {f: getattr(importlib.import_module(f"kernels.gdn_bwd.{m}"), f) for m, f, _ in bench.AB.values()}


@pytest.mark.parametrize("col", list(bench.AB))
def test_ab_column_sets_its_switch_inside_and_restores_it(col):
    mod, flag, value = bench.AB[col]
    before = _state()
    assert before[flag] != value        # the column differs from the default
    with bench.backward_context(col):
        inside = _state()
        assert inside[flag] == value
        assert all(v == before[f] for f, v in inside.items() if f != flag)
    assert _state() == before
    with pytest.raises(RuntimeError), bench.backward_context(col):
        raise RuntimeError("a failing cell")
    assert _state() == before
    with bench.backward_context("ours"):
        assert _state() == before
    assert api._FUSED_DQK is True


def test_dry_run_times_the_ab_columns(capsys):
    assert bench.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--tables", "split",
                       "--ab", ",".join(bench.AB), "--rep", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("== summary"):]
    row = next(line for line in summary.splitlines() if line.startswith("B1_T8192_H4_HV8"))
    assert all(c in summary for c in bench.AB) and row.count("(") == 1 + len(bench.AB)    # every column timed
