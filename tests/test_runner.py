"""The runner, the result format, resume, shards, merge, the report and the CLI, on a CPU."""

from __future__ import annotations

import json

import pytest

from cases import Case
from parity import report, results, runner
from parity.backends import resolve
from parity.cli import main as cli_main
from parity.results import FLOOR_BACKEND

SMALL = [Case(T=T, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates") for T in (1, 64, 65)]
FAKE = "tests.fake_backends"


def _run(tmp_path, backends, cases=SMALL, name="r", **kw):
    cfg = runner.RunConfig(cases=cases, out=tmp_path / name / "results.jsonl", backends=backends, progress=False,
                           cache_dir="", **{"workers": 0, **kw})
    return results.load(runner.run(cfg))


def _rows(rs, **match):
    return [r for r in rs.rows if all(r.get(k) == v for k, v in match.items())]


def test_every_cell_gets_a_status_and_failures_do_not_stop_the_sweep(tmp_path):
    rs = _run(tmp_path, ["torch-emulated", "ref-recurrent", f"{FAKE}:Raiser", f"{FAKE}:NaNer",
                         f"{FAKE}:Unavailable", f"{FAKE}:WrongShape"])
    assert len(rs.runs) == 1 and len(rs.ends) == 1 and rs.runs[0]["format"] == "gdn-parity-results"
    for c in SMALL:
        by = {(r["backend"], r["tensor"]): r for r in _rows(rs, case_id=c.id, against="fp64")}
        assert by[("torch-emulated", "o")]["status"] == "ok"
        assert by[("ref-recurrent", "ht")]["rel_rmse"] < 1e-12
        assert by[("fake-raiser", "o")]["status"] == "error"
        assert "boom: this backend always fails" in by[("fake-raiser", "o")]["reason"]
        assert by[("fake-nan", "o")]["status"] == "nan" and by[("fake-nan", "o")]["nan_count"] == 1
        assert by[("fake-nan", "ht")]["status"] == "ok"
        assert by[("fake-unavailable", "o")]["status"] == "unavailable"
        assert by[("fake-wrong-shape", "o")]["status"] == "error" and "shape" in by[("fake-wrong-shape", "o")]["reason"]
        floor = by[(FLOOR_BACKEND, "o")]
        assert floor["status"] == "ok" and 0 < floor["rel_rmse"] < 1e-2 and floor["ref_s"] >= 0
        # the pairwise view: each pair of backends that both ran cleanly
        assert _rows(rs, case_id=c.id, backend="ref-recurrent", against="torch-emulated", tensor="o")


def test_rows_are_tidy_and_carry_the_case(tmp_path):
    rs = _run(tmp_path, ["torch-emulated"], cases=SMALL[:1])
    row = _rows(rs, backend="torch-emulated", tensor="o")[0]
    for key in ("case_id", "group_id", "seed", "layout", "T", "dtype", "g_dtype", "dist", "backend", "against",
                "tensor", "status", "max_diff", "mean_diff", "cos_sim", "max_ref", "rel_rmse", "where_seq",
                "wall_s", "part", "impl"):
        assert key in row, key
    assert row["impl"] == "reference/emulated-bfloat16"
    env = rs.runs[0]["env"]
    assert env["packages"]["torch"] and "commit" in env["git"] and rs.runs[0]["ref_version"]


def test_resume_skips_finished_cells_and_adds_new_backends(tmp_path):
    first = _run(tmp_path, ["torch-emulated"])
    again = _run(tmp_path, ["torch-emulated"], resume=True)
    assert len(again.rows) == len(first.rows) and len(again.runs) == 2 and again.runs[1]["tasks"] == 0
    more = _run(tmp_path, ["torch-emulated", "ref-recurrent"], resume=True)
    added = [r for r in more.rows if r["part"] == 2]
    # a case missing a cell runs again whole, so that the pairwise rows of the new backend are there too; the
    # rounding floor, complete, is not redone
    assert {r["backend"] for r in added if r["against"] == "fp64"} == {"torch-emulated", "ref-recurrent"}
    assert {(r["backend"], r["against"]) for r in added if r["against"] != "fp64"} == {
        ("ref-recurrent", "torch-emulated")}
    assert not more.problems and runner.resume_plan(SMALL, resolve(["ref-recurrent"]), more.rows) == []


def test_a_file_that_names_the_run_part_session_still_loads_resumes_and_renders(tmp_path):
    path = _run(tmp_path, ["torch-emulated"], cases=SMALL[:1]).path
    lines = [json.loads(x) for x in open(path)]
    with open(path, "w") as f:  # the older spelling of the run part
        for rec in lines:
            f.write(json.dumps({("session" if k == "part" else k): v for k, v in rec.items()}) + "\n")
    old = results.load(path)
    assert [r["part"] for r in old.runs + old.ends] == [0, 0] and {r["part"] for r in old.rows} == {0}
    assert not any("session" in r for r in old.runs + old.rows + old.ends)
    rs = _run(tmp_path, ["torch-emulated", "ref-recurrent"], cases=SMALL[:1], resume=True)
    assert [r["part"] for r in rs.runs] == [0, 1] and {r["part"] for r in rs.rows} == {0, 1}
    text = report.write_report([path]).read_text()
    assert "| part " in text and "over 2 finished part(s)" in text
    assert "session" not in text.replace(str(path), "").lower()


def test_existing_file_needs_resume(tmp_path):
    _run(tmp_path, ["torch-emulated"], cases=SMALL[:1])
    with pytest.raises(FileExistsError, match="--resume"):
        _run(tmp_path, ["torch-emulated"], cases=SMALL[:1])


def test_torn_last_line_is_dropped_and_newer_versions_refused(tmp_path):
    rs = _run(tmp_path, ["torch-emulated"], cases=SMALL[:1])
    path = tmp_path / "r" / "results.jsonl"
    with open(path, "a") as f:
        f.write('{"record": "row", "case_id": "x"')  # a crash mid-write
    torn = results.load(path)
    assert torn.torn_lines == 1 and len(torn.rows) == len(rs.rows)
    again = _run(tmp_path, ["torch-emulated"], cases=SMALL[:1], resume=True)  # the writer repairs the file
    assert again.torn_lines == 0
    bad = tmp_path / "new.jsonl"
    bad.write_text(json.dumps({"record": "run", "format": "gdn-parity-results", "version": 99}) + "\n")
    with pytest.raises(ValueError, match="version 99 is newer"):
        results.load(bad)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"record": "run", "format": "something-else", "version": 1}) + "\n")
    with pytest.raises(ValueError, match="not a gdn-parity-results file"):
        results.load(other)


def test_shards_merge_into_the_whole(tmp_path):
    cases = SMALL + [c.replace(seed=1) for c in SMALL]
    a = _run(tmp_path, ["torch-emulated"], cases=cases, name="a", shard=(1, 2))
    b = _run(tmp_path, ["torch-emulated"], cases=cases, name="b", shard=(2, 2))
    ids_a, ids_b = {r["case_id"] for r in a.rows}, {r["case_id"] for r in b.rows}
    assert not ids_a & ids_b and ids_a | ids_b == {c.id for c in cases}
    merged = results.merge([tmp_path / "a" / "results.jsonl", tmp_path / "b" / "results.jsonl"],
                           tmp_path / "m" / "results.jsonl")
    assert len(merged.rows) == len(a.rows) + len(b.rows) and len(merged.runs) == 2 and len(merged.ends) == 2
    assert {r["run_id"] for r in merged.runs} == {"a", "b"}
    # kept in the repository as .jsonl.gz: the merge writes gzip there, and it loads back to the same rows
    gz = results.merge([tmp_path / "m" / "results.jsonl"], tmp_path / "z" / "results.jsonl.gz")
    assert (tmp_path / "z" / "results.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    assert sorted(map(results.row_key, gz.rows)) == sorted(map(results.row_key, merged.rows))


def test_shard_spec_is_validated():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        runner.shard_cases(SMALL, (3, 2))


@pytest.mark.slow
def test_a_crashing_worker_is_replaced_and_loses_nothing_else(tmp_path):
    rs = _run(tmp_path, ["torch-emulated", f"{FAKE}:Crasher", "ref-recurrent"], workers=1)
    crashed = SMALL[2]  # T = 65
    err = _rows(rs, case_id=crashed.id, backend="fake-crasher", tensor="o")[0]
    assert err["status"] == "error" and "worker process died (exit code 7)" in err["reason"]
    # the rest of the crashed case ran in the new worker, and the other cases were untouched
    assert _rows(rs, case_id=crashed.id, backend="ref-recurrent", tensor="o")[0]["status"] == "ok"
    for c in SMALL[:2]:
        assert _rows(rs, case_id=c.id, backend="fake-crasher", tensor="o")[0]["status"] == "ok"
    assert rs.ends[0]["worker_restarts"] == 1
    # the crashed case's sweep has no positive value for the crasher: its figure says so instead of failing
    text = report.write_report([tmp_path / "r" / "results.jsonl"]).read_text()
    assert "## Summary" in text and "could not be rendered" not in text and "Not drawn" not in text


def test_report_renders_every_section_from_the_file(tmp_path):
    cases = SMALL + [c.replace(g_dtype="bf16", beta_dtype="bf16") for c in SMALL]
    _run(tmp_path, ["torch-emulated", "ref-recurrent", f"{FAKE}:Raiser"], cases=cases)
    path = report.write_report([tmp_path / "r" / "results.jsonl"])
    text = path.read_text()
    for heading in ("## Environment", "## Summary", "## Error against fp64 by T", "## Backend against backend",
                    "## Worst cells", "## Unsupported, unavailable and failed cells"):
        assert heading in text, heading
    assert "boom: this backend always fails" in text
    assert "| T " in text and "fp64-rounded" in text and "wall time" in text
    header = text.split("### output o")[1].strip().splitlines()[0]
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert len(cols) == len(set(cols)), cols  # every backend once, the floor first
    assert cols[:3] == ["dist", "dtypes", "fp64-rounded"]
    assert "## Verdicts" in text and "fake-raiser" in text


def test_cli_list_run_report(tmp_path, capsys):
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smoke" in out and "qwen-gates" in out and "varlen-boundary" in out and "flash-qla" in out
    res = tmp_path / "cli" / "results.jsonl"
    assert cli_main(["run", "--case", SMALL[1].id, "--backends", "torch-emulated", "--workers", "0", "--out",
                     str(res), "--no-progress", "--cache", "none"]) == 0
    assert (tmp_path / "cli" / "report.md").exists()
    assert cli_main(["report", str(res), "--out", str(tmp_path / "again.md")]) == 0
    assert cli_main(["run", "--matrix", "nope"]) == 2


def test_a_poisoned_context_still_reports_the_failed_cell(monkeypatch):
    from parity import execute
    from parity.backends import get_backend

    monkeypatch.setattr(execute, "cuda_healthy", lambda device: False)  # as after an illegal memory access
    emitted = {}
    with pytest.raises(execute.ContextPoisoned):
        execute.run_case(SMALL[0], [get_backend(f"{FAKE}:Raiser"), get_backend("torch-emulated")],
                         __import__("torch").device("cpu"), None, lambda name, rows: emitted.setdefault(name, rows))
    assert "boom: this backend always fails" in emitted["fake-raiser"][0]["reason"]  # the backend's own message
    assert "torch-emulated" not in emitted  # the rest is left to a fresh process


def test_git_info_prefers_the_stamped_commit(monkeypatch):
    """On a GPU box the copied tree's .git can be stale: the commit stamped by scripts/gpu_stamp.sh wins."""
    from parity import environment

    monkeypatch.setenv("GDN_PARITY_COMMIT", "abc123")
    monkeypatch.setenv("GDN_PARITY_DIRTY", "0")
    assert environment.git_info() == {"commit": "abc123", "dirty": False}
    monkeypatch.delenv("GDN_PARITY_COMMIT")
    info = environment.git_info()
    assert info["commit"] != "abc123" and set(info) == {"commit", "dirty"}


def test_an_interrupted_run_keeps_its_finished_cells_and_says_how_to_resume(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "r" / "results.jsonl"
    cmd = [sys.executable, "-m", "parity", "run", "--case", SMALL[0].id, "--case", SMALL[1].id, "--backends",
           f"torch-emulated,{FAKE}:LongSleeper", "--out", str(out), "--workers", "1", "--warmup", "0", "--cache",
           "none", "--no-progress", "--no-report", "--no-repeat"]
    # the default SIGINT disposition in the child, whatever this process inherited (a SIGINT that is ignored at
    # start-up stays ignored: Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while time.time() - t0 < 300 and not (out.exists() and '"record": "row"' in out.read_text()):
        time.sleep(0.5)  # the first cells (baseline, torch-emulated) are on disk; the 10-minute sleeper is running
    assert proc.poll() is None, f"the run ended (exit code {proc.returncode}) before the test could interrupt it"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "--resume" in err and str(out) in err
    assert results.load(out).cells_done()  # what finished before the interrupt is kept


def test_an_error_without_a_message_is_recorded_with_where_it_was_raised(tmp_path):
    rs = _run(tmp_path, ["torch-emulated", f"{FAKE}:SilentRaiser"], cases=SMALL[:1])
    row = _rows(rs, backend="fake-silent-raiser", tensor="o")[0]
    first = row["reason"].splitlines()[0]
    assert row["status"] == "error"
    assert first == "RuntimeError (no message), raised in _forward at fake_backends.py:" + first.rsplit(":", 1)[1]
    assert "fake_backends.py" in row["reason"].split("\n", 1)[1]  # the traceback ends where it was raised


def test_resume_runs_a_backend_that_became_available(tmp_path, monkeypatch):
    """A backend unavailable when the cases ran (its package not yet installed) and available at --resume: its cells
    run then, with their pairwise rows; while it stays unavailable, resume has nothing to do."""
    spec = f"{FAKE}:InstalledLater"
    monkeypatch.delenv("GDN_FAKE_INSTALLED", raising=False)
    first = _run(tmp_path, ["torch-emulated", spec], cases=SMALL[:1])
    assert {r["status"] for r in _rows(first, backend="fake-installed-later")} == {"unavailable"}
    again = _run(tmp_path, ["torch-emulated", spec], cases=SMALL[:1], resume=True)
    assert again.runs[-1]["tasks"] == 0
    monkeypatch.setenv("GDN_FAKE_INSTALLED", "1")
    done = _run(tmp_path, ["torch-emulated", spec], cases=SMALL[:1], resume=True)
    latest = report.frame(done)
    mine = latest[(latest["backend"] == "fake-installed-later") & (latest["against"] == "fp64")]
    assert set(mine["status"]) == {"ok"}
    assert ((latest["backend"] == "fake-installed-later") & (latest["against"] == "torch-emulated")).any()
