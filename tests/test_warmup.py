"""The compile warm-up pass (parity/warmup.py): signatures, failure isolation, and its place in the result file."""

from __future__ import annotations

from cases import Case
from parity import report, results, runner
from parity.warmup import Scheduler, family, representatives, signature, warmup

FAKE = "tests.fake_backends"
SMALL = [Case(T=T, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates") for T in (1, 64, 65)]


def test_signature_ignores_seed_and_data_but_not_kernel_flags():
    a = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
    assert signature(a) == signature(a.replace(seed=2)) == signature(a.replace(dist="gauss-l2"))
    assert signature(a) != signature(a.replace(dist="raw-qk-l2"))          # q/k L2 norm inside the kernel
    assert signature(a) != signature(a.replace(dist="qwen-gates-kernel"))  # gate and beta sigmoid inside
    assert signature(a) != signature(a.replace(T=65)) != signature(a.replace(g_dtype="bf16"))
    cases = [a, a.replace(seed=1), a.replace(dist="gauss-l2"), a.replace(T=128), a.replace(T=128, seed=1)]
    assert representatives(cases) == [a, a.replace(T=128)]


def test_a_failing_or_dying_backend_only_costs_its_own_share():
    # 9 (signature, backend) tasks in 2 processes: the crasher kills whichever process takes its T=65 task, and
    # the other process takes everything left, so only that one run is lost
    s = warmup(SMALL, ["torch-emulated", f"{FAKE}:Raiser", f"{FAKE}:Crasher"], ["cpu"], procs=2, timeout=300)
    assert (s.procs, s.signatures) == (2, 3)
    assert (s.runs, s.errors, s.died) == (3 + 2, 3, 1)
    assert all("boom" in m for m in s.first_errors) and s.seconds > 0
    d = s.as_dict()
    assert 0 < len(d["slowest"]) <= 5 and s.busy_s >= sum(t for t, _, _ in s.slowest) > 0
    assert {b for _, b, _ in d["slowest"]} <= {"torch-emulated", "fake-raiser", "fake-crasher"}
    assert [x[0] for x in d["slowest"]] == sorted((x[0] for x in d["slowest"]), reverse=True)


def test_the_sweep_records_the_warmup_and_the_report_names_it(tmp_path):
    cfg = runner.RunConfig(cases=SMALL[:2], out=tmp_path / "r" / "results.jsonl", backends=["torch-emulated"],
                           progress=False, cache_dir="", workers=1, warmup=1)
    rs = results.load(runner.run(cfg))
    warm = rs.ends[0]["warmup"]
    n_backends = len(rs.runs[0]["backends"])  # the baseline joins every run
    assert warm["signatures"] == 2 and warm["runs"] == 2 * n_backends and warm["errors"] == 0 and warm["died"] == 0
    text = report.render(rs)
    assert f"compile warm-up {warm['seconds']:.1f} s (2 compile signatures) with " in text
    assert "the slowest torch-emulated" in text


def test_warmup_is_off_by_default_on_a_cpu_and_when_asked():
    assert runner.warmup_procs(None, 100) == 0  # no GPU here
    assert runner.warmup_procs(0, 100) == 0 and runner.warmup_procs(3, 100) == 3


def test_pytest_runs_the_warmup_over_the_selected_cells():
    import subprocess
    import sys

    case = SMALL[1].id
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "tests/test_matrix.py", "--case", case, "--backend", "ref-recurrent", "--warmup", "1", "-s"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "gdn-parity compile warm-up: 1 signatures" in out.stdout and "0 errors, 0 died" in out.stdout


def test_a_family_ignores_lengths_but_not_what_selects_kernels():
    a = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
    assert family(a) == family(a.replace(T=4096)) == family(a.replace(B=3))
    assert family(a) != family(a.replace(layout="varlen-ragged", T=256))  # varlen kernels differ
    assert family(a) != family(a.replace(g_dtype="bf16")) != family(a.replace(grad=True))


def test_the_scheduler_runs_each_family_leader_before_its_followers():
    a = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
    b = a.replace(g_dtype="bf16")
    reps = [a, a.replace(T=128), b, a.replace(T=256)]
    s = Scheduler(reps, ["x", "y"])
    leaders = [s.next() for _ in range(4)]
    assert leaders == [(a.id, "x"), (a.id, "y"), (b.id, "x"), (b.id, "y")]
    assert s.next() is None and not s.finished()  # the rest waits on a running leader
    s.ended((b.id, "x"))
    assert s.next() is None  # b's family has no followers
    s.ended((a.id, "y"))
    assert [s.next(), s.next(), s.next()] == [(a.replace(T=128).id, "y"), (a.replace(T=256).id, "y"), None]
    for t in [(a.id, "x"), (b.id, "y"), (a.replace(T=128).id, "y"), (a.replace(T=256).id, "y")]:
        s.ended(t)
    assert [s.next(), s.next(), s.next()] == [(a.replace(T=128).id, "x"), (a.replace(T=256).id, "x"), None]
    assert not s.finished()
    s.ended((a.replace(T=128).id, "x"))
    s.ended((a.replace(T=256).id, "x"))
    assert s.finished() and s.next() is None


def test_the_warmup_command_compiles_the_selection_and_prints_its_summary(capsys):
    import json

    from parity import cli

    rc = cli.main(["warmup", "--case", SMALL[0].id, "--case", SMALL[2].id, "--backends", "torch-emulated",
                   "--procs", "1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["signatures"] == 2 and out["runs"] == 2 and out["died"] == 0


def test_a_timeout_stops_the_pass_and_counts_what_was_left():
    # four families, so four sleepers (30 s each) are running in the four processes when the 12 s are up
    cases = [Case(T=64, H=1, HV=2, K=8, V=8, dtype=d, g_dtype=g, dist="qwen-gates")
             for d in ("bf16", "fp16") for g in ("fp32", "bf16")]
    s = warmup(cases, ["torch-emulated", f"{FAKE}:Sleeper"], ["cpu"], procs=4, timeout=12)
    assert s.left > 0 and s.died == 0 and s.runs + s.errors + s.left == 2 * len(cases)
    assert s.seconds < 12 + 8  # the running processes are stopped at the timeout, not waited for one by one
