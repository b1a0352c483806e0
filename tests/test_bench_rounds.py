"""``benchmarks.rounds``: interleaved timing rounds (alternating column order, one failing column left out, the
others kept) and the per-round paired ratios that the kernel benchmarks print."""

from __future__ import annotations

import pytest

from benchmarks import bench_kernels_bwd as bench_bwd
from benchmarks.rounds import host_cell, interleave, median_of, paired_ratio, paired_table, spread


def test_rounds_alternate_the_column_order_and_drop_a_failing_column():
    calls = []

    def col(name, fail_on=None):
        def f():
            calls.append(name)
            if len([c for c in calls if c == name]) == fail_on:
                raise RuntimeError(f"{name} broke")
            return (float(len(calls)),)
        return f

    errors = []
    got = interleave({"a": col("a"), "b": col("b", fail_on=2), "c": col("c")}, 3,
                     on_error=lambda c, e: errors.append((c, str(e))))
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "c"]
    assert errors == [("b", "b broke")]
    assert [len(got[c]) for c in "abc"] == [3, 1, 3]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleave({"a": col("a")}, 0)


def test_paired_ratio_cancels_a_drift_that_the_ratio_of_medians_keeps():
    # the machine slows by 2x in the last two rounds; the column is 10% slower than ours in every round
    ours = [(1.0,), (1.0,), (1.0,), (2.0,), (2.0,)]
    col = [(1.1,), (1.1,), (1.1,), (2.2,), (2.2,)]
    med, lo, hi = paired_ratio(col, ours, 0)
    assert med == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    skewed = [(1.1,), (2.2,), (2.2,), (2.2,), (2.2,)]
    assert median_of(skewed, 0) / median_of(ours, 0) == pytest.approx(2.2)
    assert paired_ratio(skewed, ours, 0)[0] == pytest.approx(1.1)
    assert spread(ours, 0) == pytest.approx(1.0) and spread(ours[:1], 0) is None
    assert paired_ratio([], ours, 0) is None and median_of([], 0) is None


def test_bwd_benchmark_prints_the_paired_ratios_of_its_rounds(capsys, tmp_path):
    assert bench_bwd.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--ab", "ours-ks1",
                           "--rounds", "2", "--rep", "1", "--warmup", "0",
                           "--results", str(tmp_path / "R.md")]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("== summary"):]
    assert "median of 2 interleaved rounds" in (tmp_path / "R.md").read_text()       # the recorded title
    lines = summary.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("column / ours"))
    row = lines[head + 2].split()
    assert row[0] == "B1_T8192_H4_HV8" and float(row[1]) > 0 and row[2].startswith("[")
    assert "rounds 2, spread" in out
    # the backward alone of each of our columns, timed in the same rounds (the emulation's on a dry run)
    i = next(i for i, x in enumerate(lines) if x.startswith("the backward alone"))
    assert lines[i + 1].split() == ["shape", "ours", "ours-ks1"]
    assert lines[i + 2].split()[0] == "B1_T8192_H4_HV8" and all(float(x) > 0 for x in lines[i + 2].split()[1:])
    j = next(i for i, x in enumerate(lines) if x.startswith("column / ours, the backward alone"))
    assert lines[j + 2].split()[0] == "B1_T8192_H4_HV8" and lines[j + 2].split()[2].startswith("[")


def test_paired_table_divides_each_round_by_the_base_columns_same_round():
    per = {"S": {"default": [(2.0,), (4.0,), (2.0,)], "ws": [(1.0,), (2.0,), (1.5,)], "FLA": [], "x": [(3.0,)]}}
    lines = paired_table(per, ["default", "ws", "FLA", "x"], "default")
    assert lines[2].split() == ["shape", "ws", "x", "spread"]
    row = lines[3].split()
    assert row[0] == "S" and row[1:4] == ["0.500", "[0.500,", "0.750]"] and row[4:7] == ["1.500", "[1.500,", "1.500]"]
    assert row[7] == "100%"
    assert paired_table(per, ["default"], "default") == []


def test_host_cell_marks_a_host_bound_median():
    """A host time at or above 0.9 of the median is marked: the median is then the host's."""
    assert host_cell(0.5, 2.0) == "0.500"
    assert host_cell(1.8, 2.0) == "1.800*"
    assert host_cell(2.5, 2.0) == "2.500*"
    assert host_cell(0.5, None) == "0.500"
    assert host_cell(None, 2.0) == "-"
