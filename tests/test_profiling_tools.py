"""The profiling tools on a CPU: scripts/ncu_summary.py (Nsight Compute's CSV, details page, to one line per kernel)
and scripts/ncu_stalls.py (its source page, warp-state samples per SASS instruction) on synthetic files, and
benchmarks/profile_kernels.py's dry run, benchmarks/profile_host.py's split of a forward + backward's host time
(the kernel path's host code with no-op kernels), and scripts/sass_compare.py's opcode counts on a synthetic
listing."""

from __future__ import annotations

import pytest

from tests.script_support import load_script

ncu = load_script("ncu_summary")
stalls = load_script("ncu_stalls")

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


SOURCE_HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
               '"Instructions Executed","stall_barrier","stall_long_sb","stall_selected","stall_barrier (Not Issued)",'
               '"stall_long_sb (Not Issued)"')


def _sass(addr, src, barrier, long_sb, selected):
    n = barrier + long_sb + selected
    return f'"0x{addr:x}","      {src}","{n}","{n - selected}","128","{barrier}","{long_sb}","{selected}","0","0"'


SOURCE = "\n".join([
    '"Kernel Name","gdn_bwd_dqk_kernel",',
    SOURCE_HEAD,
    _sass(0, "LDC R1, c[0x0][0x28]", 0, 0, 10),
    _sass(16, "@!P0  BRA 0x7f4b514162c0", 0, 60, 0),
    _sass(32, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR32].tnspB, RZ, !UPT", 0, 0, 5),
    _sass(48, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 24, 0, 1),
])


def test_stall_shares_per_reason_instruction_and_range():
    df = stalls.read(SOURCE)
    assert list(df["s"]) == [10, 60, 5, 25]
    r = stalls.reasons(df)
    assert list(r.index) == ["long_sb", "barrier", "selected"] and r["long_sb"] == pytest.approx(60.0)
    hot = stalls.hot(df, 10.0)
    assert [h[0] for h in hot] == [0, 1, 3] and hot[1][2] == pytest.approx(70.0)
    assert hot[1][4] == [("long_sb", pytest.approx(100.0))] and hot[2][4][0] == ("barrier", pytest.approx(96.0))
    ranges = stalls.parse_ranges("0:2=start,2:=end", len(df))
    assert ranges == [("start", 0, 2), ("end", 2, 4)]
    assert stalls.range_shares(df, ranges) == [("start", pytest.approx(70.0)), ("end", pytest.approx(30.0))]
    text = stalls.render(df, 10.0, ranges)
    assert "100 samples over 4 instructions" in text and "BRA 0x7f4b514162c0" in text and "LDC" in text
    assert "HGMMA" not in text


def test_a_bad_source_page_or_range_is_refused(tmp_path, capsys):
    p = tmp_path / "k.csv"
    p.write_text("==PROF== Connected\n")
    assert stalls.main([str(p)]) == 2 and "--page source --csv --print-source sass" in capsys.readouterr().err
    p.write_text(SOURCE)
    assert stalls.main([str(p), "--ranges", "0:9=past"]) == 2 and "outside" in capsys.readouterr().err
    assert stalls.main([str(p), "--ranges", "0:2"]) == 2 and "START:END=NAME" in capsys.readouterr().err
    assert stalls.main([str(p), "--min", "50"]) == 0 and "BRA" in capsys.readouterr().out


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


@pytest.mark.parametrize("on_thread", [False, True])
def test_host_split_times_one_backward_body_per_call_and_restores_it(monkeypatch, on_thread):
    import types

    import torch

    import benchmarks.profile_host as ph
    import kernels.autograd as ka
    import kernels.backward.pipeline as bpipe
    from benchmarks.memory_plan import STAGES, stub_kernel_path

    monkeypatch.setitem(ph.SHAPES, "tiny", (1, 128, 1, 2, None))
    inner = ka.ChunkGatedDeltaRuleFunction.__dict__["backward"]
    stage_fns = {n: getattr(bpipe, n) for n in STAGES[bpipe.__name__]}
    _, parts, why = ph._call(types.SimpleNamespace(shape="tiny", direction="fwdbwd", impl="ours"),
                             torch.device("cpu"))
    assert why is None and parts is not None
    import kernels.build as build
    get_kernel, empty = build.get_kernel, torch.empty
    with stub_kernel_path():             # the kernel path's host code on the CPU, no-op kernels
        stub = build.get_kernel
        split, stages, inside = ph.thread_split(*parts, 3, on_thread)
        assert build.get_kernel is stub
    assert len(split) == 4 and all(t >= 0 for t in split) and split[2] > 0
    # the sequential reverse pass runs every stage but the segmented pass's and the fused plan's: each took host
    # time inside the body (the fused plan's stage none)
    assert set(stages) == set(stage_fns) and stages["fused"] == 0
    assert all(stages[n] > 0 for n in stages if n != "fused"), stages
    assert sum(stages.values()) <= split[2]
    # the forward and the body each launch kernels and allocate; the time inside them is part of their own
    for p, whole in (("forward", split[0]), ("body", split[2])):
        d = inside[p]
        assert d["launches"] >= 2 and d["allocs"] >= 2 and 0 < d["launch"] + d["alloc"] <= whole, (p, d, whole)
    assert ka.ChunkGatedDeltaRuleFunction.__dict__["backward"] is inner    # the staticmethod, not its function
    assert all(getattr(bpipe, n) is fn for n, fn in stage_fns.items())
    assert build.get_kernel is get_kernel and torch.empty is empty

    def broken(ctx, *g):
        raise RuntimeError("backward failed")
    broken_raw = staticmethod(broken)
    monkeypatch.setattr(ka.ChunkGatedDeltaRuleFunction, "backward", broken_raw)
    with stub_kernel_path(), pytest.raises(RuntimeError, match="backward failed"):
        ph.thread_split(*parts, 1, on_thread)
    assert ka.ChunkGatedDeltaRuleFunction.__dict__["backward"] is broken_raw    # restored after the failure too
    assert all(getattr(bpipe, n) is fn for n, fn in stage_fns.items())
    assert build.get_kernel is get_kernel and torch.empty is empty


@pytest.mark.parametrize("direction", ["fwdbwd", "bwd"])
def test_host_profile_runs_an_ab_columns_plans(monkeypatch, direction):
    """``--ab COL``: the call profiled is the one with bench_kernels_bwd.py's column COL's plans, here
    ``ours-no-cluster`` (a GVA group's dq, dk summed by gdn_bwd_group_sum, not in dqk's cluster), traced on the
    CPU with no-op kernels; the dispatched plan sums in the cluster."""
    import types

    import torch

    import benchmarks.profile_host as ph
    import kernels.build as build
    from benchmarks.memory_plan import stub_kernel_path

    def kinds(ab):
        seen = []
        with stub_kernel_path():
            call, _, why = ph._call(types.SimpleNamespace(shape="tiny", direction=direction, impl="ours", ab=ab),
                                    torch.device("cpu"))
            assert why is None
            stub = build.get_kernel
            build.get_kernel = lambda cfg: seen.append(getattr(cfg, "kind", "")) or stub(cfg)
            try:
                call()
            finally:
                build.get_kernel = stub
        return seen
    monkeypatch.setitem(ph.SHAPES, "tiny", (1, 128, 1, 2, None))
    assert "dqk_g2" in kinds("") and "gsum" not in kinds("")
    assert "dqk" in kinds("ours-no-cluster") and "gsum" in kinds("ours-no-cluster")


def test_host_profile_refuses_ab_where_it_changes_nothing(capsys):
    from benchmarks.profile_host import main

    for argv in (["--ab", "ours-nonesuch", "--direction", "bwd"], ["--ab", "ours-serial"],
                 ["--ab", "ours-serial", "--impl", "fla", "--direction", "fwdbwd"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--ab" in capsys.readouterr().err


def test_host_profile_refuses_flashqla_past_its_forward(capsys):
    from benchmarks.profile_host import main

    for direction in ("fwdbwd", "bwd"):
        with pytest.raises(SystemExit):
            main(["--impl", "flashqla", "--direction", direction])
        assert "FlashQLA's forward" in capsys.readouterr().err


def test_kernel_times_are_the_cuda_entries_per_call_largest_first():
    import types

    import torch

    from benchmarks.profile_host import kernel_times

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [types.SimpleNamespace(key="intra", device_type=cuda, self_device_time_total=4000.0),
          types.SimpleNamespace(key="fused", device_type=cuda, self_device_time_total=10000.0),
          types.SimpleNamespace(key="cudaLaunchKernel", device_type=cpu, self_device_time_total=0.0),
          types.SimpleNamespace(key="aten::empty", device_type=cpu, self_device_time_total=50.0),
          types.SimpleNamespace(key="idle", device_type=cuda, self_device_time_total=0.0)]
    assert kernel_times(ev, 10) == [("fused", 1.0), ("intra", 0.4)]


def test_host_profile_refuses_fla_backward_alone(capsys):
    from benchmarks.profile_host import main

    with pytest.raises(SystemExit):
        main(["--impl", "fla", "--direction", "bwd"])
    assert "ours only" in capsys.readouterr().err


sass = load_script("sass_compare")

_LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/              @!P0 FFMA R2, R3, R4, R5 ;
        /*0030*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   FMUL.FTZ R6, R7, R8 ;
"""


def test_sass_compare_counts_opcodes_and_flags_arithmetic_differences():
    """``scripts/sass_compare.py``: opcodes counted by name (predicated ones too, modifiers dropped), ptxas facts
    read from its verbose output, and only the arithmetic opcodes' counts decide whether two forms differ."""
    a = sass.opcodes(_LISTING)
    assert a == {"LDC": 1, "FFMA": 2, "HGMMA": 1, "FMUL": 1}
    fused_lost = sass.opcodes(_LISTING.replace("@!P0 FFMA R2, R3, R4, R5", "FADD R2, R3, R5"))
    assert sass.differing(a, fused_lost) == ["FFMA", "FADD"]
    moved = sass.opcodes(_LISTING.replace("LDC R1", "MOV R1"))
    assert sass.differing(a, moved) == []
    log = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 12 by compiler\n"
           "    0 bytes stack frame, 512 bytes spill stores, 544 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 5 barriers")
    assert sass.ptxas_facts(log) == {"registers": 168, "spill_stores": 512, "injected_wait": True}
    assert sass.ptxas_facts("Used 40 registers")["injected_wait"] is False


def test_sass_compare_reads_configuration_expressions():
    cfg = sass.config('BwdConfig("dqk_g2", "bfloat16", 128, lo8=True, exp_mask=True)')
    assert cfg.exp_mask and cfg.lo8 and cfg.kind == "dqk_g2"
    with pytest.raises(NameError):
        sass.config("__import__('os')")
