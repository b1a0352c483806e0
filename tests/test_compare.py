"""python -m parity compare: cells classified from result files written by the real writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases import Case
from parity import compare, results
from parity.cli import main as cli_main
from parity.execute import base_row
from parity.results import FLOOR_BACKEND

H200 = Path(__file__).resolve().parent.parent / "reports" / "h200-standard" / "results.jsonl.gz"
C = [Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates", seed=0).replace(T=t) for t in (64, 65, 128, 129)]
C_OTHER_SEED = C[3].replace(seed=1)  # same configuration as C[3], other inputs
C_REDRAWN = Case(T=256, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")  # same id, other inputs in B

# bf16 bounds with these numbers: rel_rmse <= max(2 x 3e-3, 2 x 2e-3) = 6e-3, max_diff <= max(4 x 2e-3, 4 x 1e-3)
FLOOR = {"rel_rmse": 2e-3, "max_diff": 1e-3}
BASE = {"rel_rmse": 3e-3, "max_diff": 2e-3}
PASS_LO, PASS_MID, PASS_HI, FAILING = 2e-3, 3e-3, 5e-3, 2e-2


def _row(case, backend, tensor="o", rel=None, status="ok", max_diff=1e-3, rms_ref=0.5, max_ref=2.0, reason=""):
    row = {**base_row(case, backend, tensor), "impl": backend, "status": status, "reason": reason}
    if status in ("ok", "nan"):
        nan = status == "nan"
        row.update(rel_rmse=float("nan") if nan else rel, max_diff=float("nan") if nan else max_diff,
                   rms_ref=rms_ref, max_ref=max_ref, nan_count=3 if nan else 0, inf_count=0,
                   mean_diff=float("nan") if nan else rel / 10, cos_sim=1.0)
    return row


def _judging_rows(case, rms_ref=0.5):
    """The rounding floor and the baseline every verdict is measured against."""
    return [_row(case, FLOOR_BACKEND, rel=FLOOR["rel_rmse"], max_diff=FLOOR["max_diff"], rms_ref=rms_ref),
            _row(case, "torch-emulated", rel=BASE["rel_rmse"], max_diff=BASE["max_diff"], rms_ref=rms_ref)]


def _write(path: Path, gpu: str, rows: list[dict], ref_version="chunk-fp64-v1", torch_version="2.11.0") -> Path:
    header = {"run_id": path.parent.name, "matrix": "custom", "backends": sorted({r["backend"] for r in rows}),
              "ref_version": ref_version,
              "env": {"gpu": gpu, "gpu_count": 1, "sm": "90", "driver": "580.159.04", "cuda": "13.0",
                      "packages": {"torch": torch_version, "fla-core": "0.6.0"},
                      "git": {"commit": "abc123", "dirty": False}, "date": "2026-11-30T00:00:00+00:00"}}
    w = results.ResultWriter(path, header)
    w.write_cell(rows)
    w.finish({"wall_s": 1.0})
    return path


# (case, backend, A row kwargs, B row kwargs or None, expected state, expected NaN change)
SCENARIOS = [
    (C[0], "fla-triton", dict(rel=PASS_MID), dict(rel=FAILING), compare.NEW_FAILURE, ""),
    (C[0], "flash-qla", dict(rel=FAILING), dict(rel=PASS_MID), compare.FIXED, ""),
    (C[0], "fla-dispatch", dict(rel=PASS_MID), dict(status="nan"), compare.NEW_FAILURE, compare.NAN_APPEARED),
    (C[0], "ref-recurrent", dict(rel=1e-16), dict(rel=5e-16), compare.SAME, ""),  # 5x, but far under the floor
    (C[1], "fla-triton", dict(rel=PASS_LO), dict(rel=PASS_HI), compare.WORSE, ""),
    (C[1], "flash-qla", dict(rel=PASS_HI), dict(rel=PASS_LO), compare.BETTER, ""),
    (C[1], "fla-dispatch", dict(rel=PASS_MID), dict(status="error", reason="RuntimeError: illegal memory access"),
     compare.NEW_FAILURE, ""),
    (C[2], "fla-triton", dict(rel=PASS_MID), dict(rel=PASS_MID * 1.2), compare.SAME, ""),
    (C[2], "flash-qla", dict(rel=PASS_MID), dict(status="unavailable", reason="package flash-qla is not installed"),
     compare.NOT_COMPARABLE, ""),
    (C[2], "fla-dispatch", dict(status="nan"), dict(rel=FAILING), compare.SAME, compare.NAN_GONE),
    (C[3], "fla-triton", dict(rel=PASS_MID), None, compare.NOT_COMPARABLE, ""),
]


@pytest.fixture()
def pair(tmp_path):
    rows_a = [r for c in C for r in _judging_rows(c)] + _judging_rows(C_REDRAWN)
    rows_b = [r for c in C[:3] for r in _judging_rows(c)] + _judging_rows(C_OTHER_SEED)
    rows_b += _judging_rows(C_REDRAWN, rms_ref=0.51)  # the fp64 reference of this id changed: other inputs
    for case, backend, a, b, *_ in SCENARIOS:
        rows_a.append(_row(case, backend, **a))
        if b is not None:
            rows_b.append(_row(case, backend, **b))
    rows_b.append(_row(C_OTHER_SEED, "fla-triton", rel=PASS_MID))
    rows_a.append(_row(C_REDRAWN, "fla-triton", rel=PASS_MID))
    rows_b.append(_row(C_REDRAWN, "fla-triton", rel=FAILING))
    a = _write(tmp_path / "a" / "results.jsonl", "NVIDIA H200", rows_a)
    b = _write(tmp_path / "b" / "results.jsonl", "NVIDIA GeForce RTX 5090", rows_b, torch_version="2.13.0")
    return a, b


def _state(cmp, case_id, backend, tensor="o"):
    t = cmp.table
    hit = t[(t["case_id"] == case_id) & (t["backend"] == backend) & (t["tensor"] == tensor)]
    assert len(hit) == 1, (case_id, backend, len(hit))
    return hit.iloc[0]


def test_every_state_is_classified(pair):
    cmp = compare.compare_files(*pair)
    for case, backend, _, _, state, nan in SCENARIOS:
        got = _state(cmp, case.id, backend)
        assert (got["state"], got["nan"]) == (state, nan), (case.id, backend, got["why"])
    assert _state(cmp, C[1].id, "fla-triton")["ratio"] == pytest.approx(PASS_HI / PASS_LO)
    assert _state(cmp, C[1].id, "fla-dispatch")["B verdict"] == "ERROR"
    assert _state(cmp, C[2].id, "flash-qla")["why"].startswith("skipped in B: package flash-qla is not installed")
    assert _state(cmp, C[3].id, "fla-triton")["why"] == f"only in A; B ran the same configuration on other inputs " \
                                                         f"({C_OTHER_SEED.id})"
    assert _state(cmp, C_OTHER_SEED.id, "fla-triton")["why"].startswith("only in B; A ran the same configuration")
    redrawn = _state(cmp, C_REDRAWN.id, "fla-triton")  # PASS -> FAIL, but not on the same inputs
    assert redrawn["state"] == compare.NOT_COMPARABLE and "inputs of this case id differ" in redrawn["why"]
    counts = cmp.counts()
    assert counts.loc["fla-dispatch", compare.NEW_FAILURE] == 2 and counts.loc["fla-dispatch", compare.NAN_GONE] == 1
    # torch-emulated and the floor are what verdicts are measured by, never cells themselves
    assert not set(cmp.table["backend"]) & {"torch-emulated", FLOOR_BACKEND}
    assert cmp.exit_code == 1


def test_markdown_and_exit_code(pair, tmp_path, capsys):
    a, b = pair
    out = tmp_path / "compare.md"
    assert cli_main(["compare", str(a), str(b), "--out", str(out)]) == 1
    assert "3 new failure" in capsys.readouterr().out
    text = out.read_text()
    env = text.split("## Environments")[1].split("##")[0]
    gpu_line = next(line for line in env.splitlines() if line.startswith("| GPU"))
    assert "NVIDIA H200" in gpu_line and "RTX 5090" in gpu_line and "differs" in gpu_line
    torch_line = next(line for line in env.splitlines() if line.startswith("| torch "))
    assert "2.11.0" in torch_line and "2.13.0" in torch_line
    for heading in ("## Cells per backend and state", "## New failures", "## Fixed", "## Worse", "## Better",
                    "## NaN/Inf appeared or went away", "## Not comparable"):
        assert heading in text, heading
    new = text.split("## New failures")[1].split("##")[0]
    assert C[0].id in new and "fla-dispatch" in new and "illegal memory access" in new
    worse = text.split("## Worse")[1].split("##")[0]
    assert C[1].id in worse and "2.50x" in worse
    # B against itself: nothing new; run folders work as arguments
    assert cli_main(["compare", str(b.parent), str(b.parent), "--out", str(tmp_path / "same.md")]) == 0
    # reversed, the fixed cell is a new failure
    assert cli_main(["compare", str(b), str(a), "--out", str(tmp_path / "rev.md")]) == 1
    assert cli_main(["compare", str(a), str(tmp_path / "missing.jsonl")]) == 2


def test_another_reference_version_is_not_comparable(tmp_path):
    rows = _judging_rows(C[0]) + [_row(C[0], "fla-triton", rel=PASS_MID)]
    a = _write(tmp_path / "a" / "results.jsonl", "NVIDIA H200", rows)
    b = _write(tmp_path / "b" / "results.jsonl", "NVIDIA H200", rows, ref_version="chunk-fp64-v2")
    cmp = compare.compare_files(a, b)
    got = _state(cmp, C[0].id, "fla-triton")
    assert got["state"] == compare.NOT_COMPARABLE and "chunk-fp64-v1 in A, chunk-fp64-v2 in B" in got["why"]
    assert cmp.exit_code == 0


def test_h200_file_against_itself_is_all_same():
    cmp = compare.compare_files(H200, H200)
    states = cmp.table["state"].value_counts().to_dict()
    assert set(states) == {compare.SAME, compare.NOT_COMPARABLE}
    assert states[compare.SAME] > 1000
    # the only cells that cannot be compared are the ones a backend skipped
    assert cmp.of(compare.NOT_COMPARABLE)["why"].str.startswith("skipped in A").all()
    assert (cmp.table["nan"] == "").all() and cmp.baseline_drift.empty and cmp.exit_code == 0
    text = compare.render(cmp)
    assert "NVIDIA H200" in text and "no new failure" in text and "## New failures" not in text


H200_PARTIAL = Path(__file__).resolve().parent / "data" / "h200-standard-partial-old-format.jsonl.gz"


@pytest.mark.skipif(not (H200.exists() and H200_PARTIAL.exists()), reason="the H200 result files are not here")
def test_two_real_h200_runs_of_different_commits():
    """A partial run of our v1 kernels against the canonical run: the upstream backends are the same cell for cell
    (deterministic kernels, same inputs), and so are ours on every cell both ran: the canonical ``tilelang`` rows
    come from the fused ws kernels (NOTES.md, file 12): o's rel_rmse within 1e-5 of v1's (relative), the final
    state's within 5%."""
    cmp = compare.compare_files(H200_PARTIAL, H200)
    t = cmp.table
    assert cmp.of(compare.NEW_FAILURE).empty and cmp.exit_code == 0
    upstream = t[t["backend"].isin(["fla-triton", "fla-dispatch", "fla-recurrent", "flash-qla"])]
    assert set(upstream["state"]) == {compare.SAME, compare.NOT_COMPARABLE}
    ours = t[(t["backend"] == "tilelang") & (t["state"] != compare.NOT_COMPARABLE)]
    assert len(ours) and set(ours["state"]) == {compare.SAME}
    o, ht = ours[ours["tensor"] == "o"], ours[ours["tensor"] == "ht"]
    assert len(o) and ((o["A"] / o["B"] - 1).abs() < 1e-5).all()
    assert len(ht) and ((ht["A"] / ht["B"] - 1).abs() < 0.05).all()
    assert cmp.of(compare.WORSE).empty and cmp.of(compare.BETTER).empty
