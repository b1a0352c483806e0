"""``benchmarks/bench_kernels_bwd.py`` on a CPU (``--dry-run``: the emulations stand in for the kernels): its A/B
columns (``--ab``: our backward with one of its private switches off) and the switches behind them."""

from __future__ import annotations

import pytest

from benchmarks import bench_kernels_bwd as bench
from kernels.backward import api


def _switches(col):
    """Column ``col``'s (module, name, value) switches: one, or a list of several."""
    return bench.AB[col] if isinstance(bench.AB[col], list) else [bench.AB[col]]


def _state():
    """The value of every AB switch now."""
    import importlib
    return {f: getattr(importlib.import_module(f"kernels.backward.{m}"), f)
            for col in bench.AB for m, f, _ in _switches(col)}


@pytest.mark.parametrize("col", list(bench.AB))
def test_ab_column_sets_its_switch_inside_and_restores_it(col):
    want = {flag: value for _, flag, value in _switches(col)}
    before = _state()
    assert all(before[f] != v for f, v in want.items())        # the column differs from the default
    with bench.backward_context(col):
        inside = _state()
        assert all(inside[f] == v for f, v in want.items())
        assert all(v == before[f] for f, v in inside.items() if f not in want)
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
