"""``--shard auto`` from a scheduler's environment, and the deploy/ recipes: a Slurm job array and a Kubernetes
Indexed Job, run on the CPU as separate processes with the scheduler's variables set, then merged; the merged
result equals one run's."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parity import results, runner
from parity.cli import main as cli_main
from parity.scheduler import shard_from_env
from parity.verdicts import judge_frame

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# a cheap selection: four smoke cases (fp32, bf16 with fp32 and bf16 gates, an in-kernel l2norm), CPU backends
SELECTION = "--matrix smoke --T 64 --limit 4 --backends ref-recurrent --workers 0 --no-repeat --cache none"
SHARDS = 2
PER_RUN = {"part", "at", "wall_s", "wall2_s", "ref_s", "ref_source", "peak_mem_bytes"}  # timings, provenance


@pytest.mark.parametrize("env, shard", [
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4"}, (1, 4)),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "4"}, (3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "6",
      "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "4"}, (3, 4)),
    ({"JOB_COMPLETION_INDEX": "0", "GDN_PARITY_SHARDS": "8"}, (1, 8)),
    ({"JOB_COMPLETION_INDEX": "7", "GDN_PARITY_SHARDS": "8"}, (8, 8)),
])
def test_shard_from_the_schedulers_index(env, shard):
    assert shard_from_env(env) == shard


@pytest.mark.parametrize("env, message", [
    ({}, "SLURM_ARRAY_TASK_ID .* JOB_COMPLETION_INDEX .* none is set"),
    ({"SLURM_ARRAY_TASK_ID": "2"}, "neither SLURM_ARRAY_TASK_COUNT nor SLURM_ARRAY_TASK_MIN/MAX"),
    ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "4"}, "SLURM_ARRAY_TASK_ID='x' is not an integer"),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "4"}, "not in the array 1-4"),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7",
      "SLURM_ARRAY_TASK_COUNT": "3"}, "not an evenly spaced range"),  # --array=1,3,7
    ({"JOB_COMPLETION_INDEX": "1"}, "GDN_PARITY_SHARDS is not"),
    ({"JOB_COMPLETION_INDEX": "8", "GDN_PARITY_SHARDS": "8"}, "JOB_COMPLETION_INDEX=8 with GDN_PARITY_SHARDS=8"),
    ({"JOB_COMPLETION_INDEX": "0", "GDN_PARITY_SHARDS": "2", "SLURM_ARRAY_TASK_ID": "0"}, "both"),
])
def test_missing_or_inconsistent_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        shard_from_env(env)


def test_cli_shard_auto_without_a_scheduler_is_a_clear_error(tmp_path, monkeypatch, capsys):
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "r" / "results.jsonl"
    code = cli_main(["run", "--case", "dense_B1_T1_H2-HV4_K32-V32_fp32_g-fp32_beta-fp32_h0-none_qwen-gates_s0",
                     "--shard", "auto", "--workers", "0", "--out", str(out)])
    assert code == 2 and "--shard auto needs a scheduler's index" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """The selection run once, unsharded, in this process."""
    from parity.cli import _csv, build_parser, select_cases

    args = build_parser().parse_args(["run", *SELECTION.split()])
    matrix, cases = select_cases(args)
    out = tmp_path_factory.mktemp("one") / "results.jsonl"
    cfg = runner.RunConfig(cases=cases, out=out, backends=_csv(args.backends), matrix=matrix, workers=0,
                           repeat=False, cache_dir="", progress=False)
    return results.load(runner.run(cfg))


def _scheduled_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "GDN_PARITY"))}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "GDN_PARITY_OUT": str(tmp_path / "out"),
            "GDN_PARITY_ARGS": SELECTION, **extra}


def _sh(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def _same_as_one_run(merged: Path, one: results.ResultSet) -> None:
    """Same rows (case, backend, against, tensor) with equal values but for per-run fields; same verdicts."""
    rs = results.load(merged)
    assert sorted(r["shard"] for r in rs.runs) == [f"{k}/{SHARDS}" for k in range(1, SHARDS + 1)]

    def keyed(rows):
        return {(r["case_id"], r["backend"], r["against"], r["tensor"]): {k: v for k, v in r.items()
                                                                         if k not in PER_RUN} for r in rows}

    a, b = keyed(rs.rows), keyed(one.rows)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert a[key] == b[key], key
    cols = ["case_id", "backend", "tensor", "verdict"]
    va = judge_frame(rs.frame())[cols].sort_values(cols).reset_index(drop=True)
    vb = judge_frame(one.frame())[cols].sort_values(cols).reset_index(drop=True)
    assert va.equals(vb) and (va["verdict"] == "PASS").any()


def _read_sbatch_log(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_slurm_recipe_shards_and_merge_equal_one_run(tmp_path, one_run):
    """deploy/slurm-submit.sh against a recording ``sbatch``; then each recorded job runs as Slurm would run it:
    every array task with its SLURM_ARRAY_* variables, the merge after them, all with the submitting environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/usr/bin/env bash\n(IFS=$\'\\t\'; echo "$*") >> {shlex.quote(str(log))}\n'
                    f'n=$(wc -l < {shlex.quote(str(log))}); echo "$((1000 + n));cluster"\n')
    fake.chmod(0o755)
    env = _scheduled_env(tmp_path, GDN_PARITY_SHARDS=str(SHARDS), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    submitted = _sh(["bash", "deploy/slurm-submit.sh", "--partition=test"], env)
    assert "array job 1001" in submitted.stdout and "merge job 1002" in submitted.stdout
    (array_args, merge_args) = _read_sbatch_log(log)
    assert array_args[-1] == "deploy/slurm.sbatch" and "--partition=test" in array_args
    assert merge_args[-1] == "deploy/merge.sh" and "--dependency=afterok:1001" in merge_args
    lo, hi = (int(x) for x in next(a for a in array_args if a.startswith("--array=")).split("=")[1].split("-"))
    assert (lo, hi) == (0, SHARDS - 1)
    for task in range(lo, hi + 1):
        _sh(["bash", array_args[-1]], {**env, "SLURM_ARRAY_JOB_ID": "1001", "SLURM_ARRAY_TASK_ID": str(task),
                                       "SLURM_ARRAY_TASK_MIN": str(lo), "SLURM_ARRAY_TASK_MAX": str(hi),
                                       "SLURM_ARRAY_TASK_COUNT": str(hi - lo + 1), "SLURM_SUBMIT_DIR": str(ROOT)})
    _sh(["bash", merge_args[-1]], {**env, "SLURM_JOB_ID": "1002"})
    _same_as_one_run(tmp_path / "out" / "results.jsonl", one_run)
    assert (tmp_path / "out" / "report.md").exists()


@pytest.mark.slow
def test_kubernetes_indexed_job_command_shards_and_merge_equal_one_run(tmp_path, one_run):
    """The Indexed Job's container command once per completion index with JOB_COMPLETION_INDEX set, then the merge
    Job's command (the manifests' structure is checked in the next test)."""
    env = _scheduled_env(tmp_path, GDN_PARITY_SHARDS=str(SHARDS))
    merge = tmp_path / "out" / "results.jsonl"
    _sh(["bash", "deploy/run-shard.sh"], {**env, "JOB_COMPLETION_INDEX": "0"})
    failed = subprocess.run(["bash", "deploy/merge.sh"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert failed.returncode == 1 and "1 of GDN_PARITY_SHARDS=2 shard files" in failed.stderr
    assert not merge.exists()  # an incomplete set is not merged
    _sh(["bash", "deploy/run-shard.sh"], {**env, "JOB_COMPLETION_INDEX": "1"})
    _sh(["bash", "deploy/merge.sh"], env)
    _same_as_one_run(merge, one_run)


def test_kubernetes_manifests_run_the_tested_commands_with_matching_counts():
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra) reads the manifests")
    job = yaml.safe_load((DEPLOY / "k8s-indexed-job.yaml").read_text())
    merge = yaml.safe_load((DEPLOY / "k8s-merge-job.yaml").read_text())
    assert job["kind"] == merge["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    (shard,), (merger,) = job["spec"]["template"]["spec"]["containers"], merge["spec"]["template"]["spec"]["containers"]
    assert shard["command"] == ["deploy/run-shard.sh"] and merger["command"] == ["deploy/merge.sh"]
    env_s, env_m = ({e["name"]: e["value"] for e in c["env"]} for c in (shard, merger))
    assert int(env_s["GDN_PARITY_SHARDS"]) == job["spec"]["completions"] >= job["spec"]["parallelism"]
    assert env_s["GDN_PARITY_SHARDS"] == env_m["GDN_PARITY_SHARDS"]
    assert env_s["GDN_PARITY_OUT"] == env_m["GDN_PARITY_OUT"]
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (shard, merger)]
    assert mounts[0] == mounts[1] and any(env_s["GDN_PARITY_OUT"].startswith(p) for p in mounts[0])
    claims = [{v["name"]: v["persistentVolumeClaim"]["claimName"] for v in j["spec"]["template"]["spec"]["volumes"]}
              for j in (job, merge)]
    assert claims[0] == claims[1]
    assert shard["workingDir"] == merger["workingDir"] and shard["image"] == merger["image"]
