"""The profiling tools on a CPU: scripts/ncu_summary.py (Nsight Compute's CSV, details page, to one line per kernel)
on a synthetic file, and benchmarks/profile_kernels.py's dry run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("ncu_summary", Path(__file__).parent.parent / "scripts" / "ncu_summary.py")
ncu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu)

HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
       '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'


def _row(kid, kernel, section, name, unit, value, grid="(512, 2, 32)", block="(128, 1, 1)"):
    return (f'"{kid}","1","python3","h","{kernel}","1","7","{block}","{grid}","0","9.0","{section}","{name}",'
            f'"{unit}","{value}"')


CSV = "\n".join([
    "==PROF== Connected to process 1",
    "profiled forward + backward",
    HEAD,
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "GPU Speed Of Light Throughput", "Duration", "msecond",
         "13.06"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "GPU Speed Of Light Throughput",
         "Compute (SM) Throughput", "%", "21.5"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Launch Statistics", "Registers Per Thread",
         "register/thread", "253"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Launch Statistics", "Dynamic Shared Memory Per Block",
         "Kbyte/block", "149.50"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Occupancy", "Block Limit Registers", "block", "2"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Occupancy", "Block Limit Shared Mem", "block", "1"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Occupancy", "Achieved Occupancy", "%", "6.2"),
    _row(1, "gdn_bwd_dh_kernel", "GPU Speed Of Light Throughput", "Duration", "usecond", "3,707.00",
         grid="(2, 32, 1)"),
    _row(2, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "GPU Speed Of Light Throughput", "Duration", "usecond",
         "940"),
    # ncu 2025 (the H200 box) writes "ns", and rule rows (advice) with an empty metric name
    _row(3, "gdn_output_kernel", "GPU Speed Of Light Throughput", "Duration", "ns", "1,498,304"),
    _row(3, "gdn_output_kernel", "Occupancy", "", "", ""),
    # MemoryWorkloadAnalysis repeats "Memory Throughput" as a rate: the SpeedOfLight percentage (first) is kept
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "GPU Speed Of Light Throughput", "Memory Throughput", "%",
         "13.4"),
    _row(0, "gdn_bwd_dqk_inter_kernel(float const*, ...)", "Memory Workload Analysis", "Memory Throughput",
         "Gbyte/s", "532.20"),
    # a raw metric from --metrics (bank conflicts), shown in thousands
    _row(3, "gdn_output_kernel", "Command line profiler metrics",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", "", "2,048,000"),
])


def test_one_line_per_launch_with_units_converted():
    s = ncu.summarize(ncu.read(CSV))
    assert list(s["id"]) == [0, 1, 2, 3] and s.loc[0, "kernel"] == "gdn_bwd_dqk_inter_kernel"
    assert s.loc[0, "us"] == pytest.approx(13060.0) and s.loc[1, "us"] == pytest.approx(3707.0)
    assert s.loc[3, "us"] == pytest.approx(1498.304) and s.loc[3, "limiter"] == "-"
    assert s.loc[0, "mem%"] == pytest.approx(13.4)
    assert s.loc[0, "regs"] == 253 and s.loc[0, "smem_kb"] == pytest.approx(149.5 * 1000 / 1024)
    assert s.loc[0, "limiter"] == "Shared Mem" and s.loc[1, "limiter"] == "-"
    assert s.loc[1, "sm%"] != s.loc[1, "sm%"]  # not collected: NaN, shown as "-"
    assert s.loc[3, "bank_st_k"] == pytest.approx(2048.0) and s.loc[0, "bank_st_k"] != s.loc[0, "bank_st_k"]
    text = ncu.render(s)
    assert "gdn_bwd_dh_kernel" in text and "time per kernel (total 19205.3 us)" in text
    lines = text.splitlines()
    first_total = next(i for i, line in enumerate(lines) if line.startswith("time per kernel")) + 3
    assert lines[first_total].split()[0] == "gdn_bwd_dqk_inter_kernel"  # the largest share first


def test_a_file_without_the_csv_header_is_refused(tmp_path):
    p = tmp_path / "ncu.csv"
    p.write_text("==PROF== Connected\n==ERROR== LibraryNotLoaded\n")
    assert ncu.main([str(p)]) == 2
    with pytest.raises(ValueError, match="--csv --page details"):
        ncu.read(p.read_text())


@pytest.mark.parametrize("shape,extra", [("B1_T8192_H4_HV8", []), ("varlen8_T32768_H16_HV32", ["--fwd-only"]),
                                         ("B1_T8192_H4_HV8", ["--ab", "ours-no-cluster"])])
def test_the_profiled_call_runs_on_the_emulation(shape, extra, capsys):
    from benchmarks.profile_kernels import main

    assert main(["--dry-run", "--shape", shape, *extra]) == 0
    err = capsys.readouterr().err
    assert "non-finite values: 0" in err and ("forward at" in err) == ("--fwd-only" in extra)
    assert ("A/B column ours-no-cluster" in err) == ("--ab" in extra)


def test_fla_profile_is_gpu_only_and_says_so(capsys):
    from benchmarks.profile_kernels import main

    with pytest.raises(SystemExit):
        main(["--dry-run", "--impl", "fla-triton"])
    assert "--impl fla-triton runs FLA's kernels on a GPU" in capsys.readouterr().err
