"""``benchmarks/bench_kernels_bwd.py`` on a CPU (``--dry-run``: the emulations stand in for the kernels): its A/B
columns (``--ab``: ours with other plan values) and the plans behind them."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import bench_kernels_bwd as bench
from kernels.plan import backward_plan, forward_plan


@pytest.mark.parametrize("col", list(bench.AB))
def test_ab_column_changes_the_plan_it_names_and_no_other(col):
    f = bench.alter(col)
    fp = forward_plan("bfloat16", 1, 32, 512, keep_tables=True)
    bp = backward_plan("bfloat16", 16, 32, 512, 1)
    where, change = bench.AB[col]
    nf, nb = f(fp), f(bp)
    assert getattr(f, "keep_tables", None) == {"split": True, "both": False}.get(where), col
    if where == "split":
        # no fused plan at one sequence of 32 value heads: nothing to undo; at eight, the split plan it replaced
        assert nf is fp and nb is bp and bp.split is None
        fused = backward_plan("bfloat16", 16, 32, 512, 8)
        assert fused.fused and f(fused) is fused.split and not fused.split.fused and fused.split.takes_saved_tables
        assert fused.split == dataclasses.replace(fused, **{k: getattr(fused.split, k) for k in (
            "dtype", "io_dtype", "one_term", "dh_single", "s_single", "lo8", "reads_saved_tables", "dh_ws_bv",
            "dh_warm", "recompute_warm", "shared_scan", "fused", "fused_dq16", "prep_converts", "recompute_one",
            "longest_first", "cluster_group_sum")})
    elif where == "both":
        assert nf == dataclasses.replace(fp, keep_tables=False) and not nb.reads_saved_tables
    elif where == "merges":
        # (the forward's P tables need the q tile that the split merges do without)
        assert nf == dataclasses.replace(fp, precision=dataclasses.replace(fp.precision, merge=change),
                                         p_table=fp.p_table and change != "split")
        assert nb == dataclasses.replace(bp, merge=change) and nf.keep_tables and nf != fp and nb != bp
    else:
        assert nf is fp and nb == dataclasses.replace(bp, **bench.segmented_only(change, bp))
    if col == "ours-s-single":
        assert not bp.s_single and nb.s_single


def test_call_configs_cover_the_split_plan_where_the_fused_one_is_dispatched():
    names = {c.name for c in bench.call_configs(8, 4096, 16, 32, None, ["ours", "ours-split"])}
    assert any(n.startswith("bwd_fused") for n in names)                               # ours: the fused plan
    assert any(n.startswith("bwd_dqk_g2") and ",lo8," in n for n in names)             # ours-split: the split one


def test_call_configs_cover_every_column():
    cfgs = bench.call_configs(1, 8192, 4, 8, None, ["ours"] + list(bench.AB))
    names = {c.name for c in cfgs}
    assert any(n.startswith("bwd_dqk_g2") for n in names) and any(n.startswith("bwd_gsum") for n in names)
    assert any(",occ2," in n and ",lo8," in n for n in names)             # ours-rc-bv16o2 / bv32o2
    assert any("merge=bf16,ag=split,th" in n for n in names)                                       # ours-m1
    assert any("merge=split,ag=split,th" in n for n in names)                                    # ours-msplit
    assert {c.merge for c in cfgs if getattr(c, "kind", None) == "prep" and not c.saved} == {"bf16", "fp32", "split"}
    assert any(n.startswith("bwd_dqk") and ",s_single," in n for n in names)                        # ours-s-single
    # ours-lo16: dqk without fp8 tables; ours-ks1: the recompute's K S on S hi alone (no "ks" split), lo8
    assert any(n.startswith("bwd_dqk") and ",lo8," not in n for n in names)
    assert any(n.startswith("state_smem") and "sp[ag+x+u+upd+s+p]" in n and ",lo8," in n for n in names)


def test_dry_run_times_the_ab_columns(capsys, tmp_path):
    out_md = tmp_path / "RESULTS.md"
    assert bench.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--ab", ",".join(bench.AB),
                       "--rep", "1", "--warmup", "0", "--results", str(out_md)]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("== summary"):]
    row = next(line for line in summary.splitlines() if line.startswith("B1_T8192_H4_HV8"))
    assert all(c in summary for c in bench.AB) and row.count("(") == 1 + len(bench.AB)    # every column timed
    text = out_md.read_text()
    assert "## benchmarks/bench_kernels_bwd.py - commit " in text and row in text


def test_skip_takes_the_forward_benchmarks_columns_and_names_an_unknown_one(capsys, tmp_path):
    """``--skip flashinfer`` (a forward column; FlashInfer has no backward) runs, so one argument list serves both
    benchmarks; an unknown column is refused by name before anything runs."""
    args = ["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--rep", "1", "--warmup", "0",
            "--results", str(tmp_path / "RESULTS.md")]
    assert bench.main(args + ["--skip", "FLA,flashinfer"]) == 0
    out = capsys.readouterr().out
    assert "column FLA skipped/failed: --skip" in out and "flashinfer" not in out
    with pytest.raises(SystemExit):
        bench.main(args + ["--skip", "FLA,Flashinfer2"])
    assert "got ['Flashinfer2']" in capsys.readouterr().err


def test_results_sections_carry_the_commit_the_gpu_box_was_given(tmp_path, monkeypatch):
    """On a GPU box the tree's copy may hold a stale .git: GDN_PARITY_COMMIT (scripts/gpu_env.sh) names the commit."""
    from benchmarks import record

    monkeypatch.setenv("GDN_PARITY_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("GDN_PARITY_DIRTY", "0")
    heading = record.append("bench.py", ["a b", "1 2"], path=str(tmp_path / "R.md"), gpu="GPU X")
    assert "commit 0123456 " in heading.replace(",", " ") and "GPU X" in heading
    monkeypatch.setenv("GDN_PARITY_DIRTY", "1")
    assert record.commit() == "0123456+dirty"


def test_the_forward_keeps_tables_as_the_columns_plan_reads_them(monkeypatch):
    """``run_forward`` offers the forward a table dict where the dispatched backward reads the tables, or where a
    column's ``alter`` says so (``keep_tables``: ``ours-split`` keeps them where the fused plan is dispatched, the
    one-term columns keep none anywhere)."""
    import torch

    from kernels import autograd
    offered = []

    def fwd(q, k, v, g, beta, keep_tables=None, **kw):
        offered.append(keep_tables is not None)
        return None, None

    monkeypatch.setattr(autograd, "_directions", lambda impl: (fwd, None))
    q = torch.zeros(8, 64, 16, 128, dtype=torch.bfloat16)
    v = torch.zeros(8, 64, 32, 128, dtype=torch.bfloat16)      # 256 (value head, sequence) pairs: fused
    for x, y in ((q, v), (q[:1], v[:1])):
        for alter in (None, bench.alter("ours-again"), bench.alter("ours-split"), bench.alter("ours-fused")):
            autograd.run_forward(x, x, y, None, None, None, None, False, False, False, None, impl="tilelang",
                                 alter=alter, keep=True)
    assert offered == [False, False, True, False, True, True, True, False]
