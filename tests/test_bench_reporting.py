"""What the kernel benchmarks report (on a CPU, ``--dry-run``): the forward's ratios against every reference
column and the fastest of them, and the shapes done before a SIGINT (a timeout) still summarised and recorded."""

from __future__ import annotations

import pytest

from benchmarks import bench_kernels_bwd as bench_bwd
from benchmarks import bench_kernels_fwd as bench_fwd


def test_ratio_table_divides_each_reference_by_ours_and_names_the_fastest():
    rows = {"A": {"default": 2.0, "FLA": 4.0, "FlashQLA": 1.0, "flashinfer": 0.5},
            "B": {"default": 1.0, "FLA": 3.0, "FlashQLA": None, "flashinfer": 1.5},
            "C": {"default": None, "FLA": 1.0, "FlashQLA": 1.0, "flashinfer": 1.0}}
    lines = bench_fwd.ratio_table(rows, ["FLA", "FlashQLA", "flashinfer"])
    a = next(x for x in lines if x.startswith("A ")).split()
    assert a[1:4] == ["2.00", "0.50", "0.25"] and a[4:6] == ["0.25", "(flashinfer"]
    b = next(x for x in lines if x.startswith("B ")).split()
    assert b[1:4] == ["3.00", "-", "1.50"] and b[4:6] == ["1.50", "(flashinfer"]
    assert next(x for x in lines if x.startswith("C ")).split()[1:] == ["-", "-", "-"]
    assert bench_fwd.ratio_table(rows, []) == []


def _interrupt_second_shape(monkeypatch, module, name):
    real, calls = getattr(module, name), []

    def make(*a, **kw):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(module, name, make)


@pytest.mark.parametrize("bench", [bench_fwd, bench_bwd], ids=["fwd", "bwd"])
def test_an_interrupt_keeps_the_shapes_already_timed(bench, monkeypatch, capsys, tmp_path):
    _interrupt_second_shape(monkeypatch, bench, "make")
    out_md = tmp_path / "RESULTS.md"
    extra = ["--variants", "default"] if bench is bench_fwd else []
    assert bench.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8,B1_T65536_H2_HV4", "--rep", "1",
                       "--warmup", "0", "--results", str(out_md), *extra]) == 0
    summary = capsys.readouterr().out.split("== summary")[1]
    assert "interrupted after 1 of 2 shapes" in summary
    timed = [x for x in summary.splitlines() if x.startswith("B1_T")]
    assert timed and all(x.startswith("B1_T8192_H4_HV8") for x in timed)
    text = out_md.read_text()
    assert "interrupted after 1 of 2 shapes" in text and timed[0] in text
