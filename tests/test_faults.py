"""Fault injection through ``parity run``: backends that crash their worker, hang past --cell-timeout, return
NaN, Inf or a small bias, or raise in supports()/available() (tests/fake_backends.py). Each costs its own cells
only; the other cells' rows are all there, ``--resume`` completes what a crash left missing, and report.md is
written. Also the result file's lock: one writer at a time, a dead holder never blocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cases import Case
from parity import results, runner
from parity.backends import resolve
from parity.cli import main as cli_main
from parity.results import FLOOR_BACKEND, FileLocked, WriteLock, latest_rows
from parity.verdicts import judge_frame

FAKE = "tests.fake_backends"
ROOT = Path(__file__).resolve().parent.parent
CASES = [Case(T=T, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates") for T in (64, 65)]
FAULTS = {"Crasher": "fake-crasher", "Hanger": "fake-hanger", "NaNer": "fake-nan", "Infer": "fake-inf",
          "Biased": "fake-biased", "RaisingSupports": "fake-raising-supports",
          "RaisingAvailable": "fake-raising-available"}
SPECS = ["torch-emulated", *(f"{FAKE}:{cls}" for cls in FAULTS), "ref-recurrent"]


def _run_args(out, *extra):
    args = ["run", "--backends", ",".join(SPECS), "--out", str(out), "--workers", "1", "--warmup", "0",
            "--cell-timeout", "10", "--cache", "none", "--no-progress", "--no-repeat", *extra]
    for c in CASES:
        args += ["--case", c.id]
    return args


def _fp64(rs, case_id, backend):
    return {r["tensor"]: r for r in latest_rows(rs.rows).values()
            if r["case_id"] == case_id and r["backend"] == backend and r.get("against", "fp64") == "fp64"}


@pytest.mark.slow
def test_every_fault_costs_its_own_cells_and_resume_completes_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("GDN_FAKE_FAULT_ONCE_DIR", str(tmp_path))  # the crash and the hang happen once
    out = tmp_path / "run" / "results.jsonl"
    assert cli_main(_run_args(out)) == 0
    assert (out.parent / "report.md").exists()
    rs = results.load(out)
    assert not rs.problems
    names = [b.name for b in resolve(SPECS)]
    crashed, clean = CASES[1].id, CASES[0].id
    # every cell of every case has its rows; the faulty ones say why
    for c in CASES:
        for b in (FLOOR_BACKEND, *names):
            assert {"o", "ht"} <= set(_fp64(rs, c.id, b)), (c.id, b)
    assert "worker process died (exit code 7)" in _fp64(rs, crashed, "fake-crasher")["o"]["reason"]
    assert "timed out after 10 s" in _fp64(rs, crashed, "fake-hanger")["o"]["reason"]
    for c in CASES:
        assert "supports() raised RuntimeError: supports exploded" in _fp64(rs, c.id, "fake-raising-supports")["o"][
            "reason"]
        assert "available() raised RuntimeError: available exploded" in _fp64(rs, c.id, "fake-raising-available")[
            "o"]["reason"]
        assert _fp64(rs, c.id, "fake-nan")["o"]["status"] == "nan"
        assert _fp64(rs, c.id, "fake-inf")["o"]["inf_count"] == 1
    assert rs.runs[0]["availability"]["fake-raising-available"]["available"] is False
    judged = judge_frame(rs.frame())
    verdict = {(r["case_id"], r["backend"], r["tensor"]): r["verdict"] for r in judged.to_dict("records")}
    for b in ("fake-nan", "fake-inf", "fake-biased"):
        assert verdict[(clean, b, "o")] == "FAIL", b
    for b in ("fake-raising-supports", "fake-raising-available"):
        assert verdict[(clean, b, "o")] == "ERROR", b
    assert verdict[(clean, "ref-recurrent", "o")] == "PASS" and verdict[(clean, "fake-crasher", "o")] == "PASS"
    # the crash and the hang left the crashed case without its pairwise rows: resume runs it again
    lack = runner.missing_rows(CASES[1], resolve(SPECS), latest_rows(rs.rows))
    assert any(m.startswith("fake-crasher: did not finish") for m in lack)
    assert any(m.startswith("pairwise") for m in lack)
    assert not runner.missing_rows(CASES[0], resolve(SPECS), latest_rows(rs.rows))
    assert cli_main(_run_args(out, "--resume")) == 0
    again = results.load(out)
    assert runner.resume_plan(CASES, resolve(SPECS), again.rows) == []
    assert _fp64(again, crashed, "fake-crasher")["o"]["status"] == "ok"
    assert {r["case_id"] for r in again.rows if r["part"] == 1} == {crashed}  # the clean case was not redone
    assert again.ends[0]["worker_restarts"] == 2 and "## Summary" in (out.parent / "report.md").read_text()


def _complete_run(tmp_path, name="r"):
    cfg = runner.RunConfig(cases=CASES[:1], out=tmp_path / name / "results.jsonl", progress=False, cache_dir="",
                           backends=["torch-emulated", "ref-recurrent"], workers=0)
    return cfg, results.load(runner.run(cfg))


def test_resume_redoes_a_case_whose_pairwise_or_attribution_rows_were_lost(tmp_path):
    """A kill between a case's emits leaves its cells' rows on disk but not its pairwise/attribution rows."""
    cfg, rs = _complete_run(tmp_path)
    kept = [r for r in rs.rows if r["against"] == "fp64" and r["tensor"] != "h"]
    assert len(kept) < len(rs.rows)
    lines = [json.dumps(rec) for rec in rs.runs + kept]
    cfg.out.write_text("\n".join(lines) + "\n")
    assert len(runner.resume_plan(cfg.cases, resolve(cfg.backends), results.load(cfg.out).rows)) == 1
    cfg.resume = True
    again = results.load(runner.run(cfg))
    before = {results.row_key(r) for r in rs.rows}
    assert before == {results.row_key(r) for r in again.rows}  # every lost row is back
    assert runner.resume_plan(cfg.cases, resolve(cfg.backends), again.rows) == []


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path, capsys):
    out = tmp_path / "r" / "results.jsonl"
    args = ["run", "--case", CASES[0].id, "--backends", "torch-emulated", "--workers", "0", "--out", str(out),
            "--cache", "none", "--no-progress", "--no-report", "--resume"]
    with WriteLock(out):  # another run holds the file
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert str(out) in err and f"pid {os.getpid()}" in err and "another run" in err
        assert not out.exists()  # the second run wrote nothing
        with pytest.raises(FileLocked):
            results.ResultWriter(out, {})
    assert cli_main(args) == 0  # unlocked: the next run writes
    rs = results.load(out)
    assert len(rs.runs) == 1 and not rs.problems


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    out = tmp_path / "results.jsonl"
    code = ("import sys, time; from parity.results import WriteLock; WriteLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(FileLocked, match=f"pid {proc.pid}"):
            WriteLock(out).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert (tmp_path / "results.jsonl.lock").exists()  # the file stays; the kernel dropped the flock
    WriteLock(out).acquire().unlock()


@pytest.mark.slow
def test_a_killed_run_is_completed_by_resume(tmp_path):
    """SIGKILL of the whole run (parent and worker) while a cell hangs: the lock dies with it, and --resume runs
    every case that lacks a row."""
    import time

    out = tmp_path / "r" / "results.jsonl"
    specs = f"torch-emulated,{FAKE}:Hanger,ref-recurrent"
    cmd = [sys.executable, "-m", "parity", "run", "--backends", specs, "--out", str(out), "--workers", "1",
           "--warmup", "0", "--cache", "none", "--no-progress", "--no-report", "--no-repeat"]
    for c in CASES:
        cmd += ["--case", c.id]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GDN_FAKE_FAULT_ONCE_DIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while time.time() - t0 < 240 and not (tmp_path / "fake-hanger").exists():
            time.sleep(0.5)  # the hanger marks its (only) hang when it starts it
        assert (tmp_path / "fake-hanger").exists() and proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: its parent and its worker
        proc.wait(timeout=30)
    before = results.load(out)
    assert runner.resume_plan(CASES, resolve(specs.split(",")), before.rows) == [(CASES[1].id, [
        "torch-emulated", "fake-hanger", "ref-recurrent"])]  # its rounding floor was written before the hang
    os.environ["GDN_FAKE_FAULT_ONCE_DIR"] = str(tmp_path)
    try:
        assert cli_main(["run", "--resume", "--backends", specs, "--out", str(out), "--workers", "0", "--cache",
                         "none", "--no-progress", "--no-repeat", *(a for c in CASES for a in ("--case", c.id))]) == 0
    finally:
        del os.environ["GDN_FAKE_FAULT_ONCE_DIR"]
    after = results.load(out)
    assert runner.resume_plan(CASES, resolve(specs.split(",")), after.rows) == []
    assert _fp64(after, CASES[1].id, "fake-hanger")["o"]["status"] == "ok" and (out.parent / "report.md").exists()
