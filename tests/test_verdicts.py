"""The verdict rule's yardsticks: the fp64 rule and the cross-check of the two fp64 references (INVALID), the
baseline's sanity check (NO-BASELINE), unknown statuses, and the report's verdict section."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch

from cases.matrices import get_matrix
from parity import verdicts
from parity.backends.reference import TorchEmulated
from parity.results import FLOOR_BACKEND
from parity.session import ParitySession
from parity.tolerances import BASELINE_CHECKS, FP64_RTOL
from parity.verdicts import FAIL, INVALID, NOREF, PASS, cross_check, judge, judge_frame

CASE_ID = "dense_B1_T64_H2-HV4_K32-V32_bf16_g-fp32_beta-fp32_qwen-gates_s0"


def _row(backend, tensor="o", rel=1e-3, maxd=1e-2, status="ok", out_dtype="bfloat16", max_ref=4.0, case=CASE_ID,
         dtype="bf16"):
    return {"case_id": case, "group_id": case[:-3], "backend": backend, "tensor": tensor, "against": "fp64",
            "status": status, "rel_rmse": rel, "max_diff": maxd, "max_ref": max_ref, "out_dtype": out_dtype,
            "dtype": dtype, "impl": "x", "reason": "", "where_seq": 0, "where_token": 3, "where_head": 1,
            "where_channel": 2, "nan_count": 0, "inf_count": 0, "seed": 0, "dist": "qwen-gates", "g_dtype": "fp32",
            "T": 64, "layout": "dense"}


FLOOR = _row(FLOOR_BACKEND, rel=1.6e-3, maxd=7.8e-3)
BASE = _row("torch-emulated", rel=3.5e-3, maxd=2.0e-2)


# ----------------------------------------------------------------------------------------------- the fp64 rule


def test_a_tensor_returned_in_fp64_is_held_to_the_fp64_rule():
    """Judged by the bf16 rule, an fp64 reference at rel_rmse 1e-6 (or 0.65) passed: the bound was 2x bf16's."""
    good = _row("ref-recurrent", rel=8e-16, maxd=2e-15, out_dtype="float64")
    assert judge(good, BASE, FLOOR).status == PASS
    for rel, maxd, metric in ((1e-6, 1e-15, "rel_rmse"), (0.65, 1.0, "rel_rmse"), (1e-13, 4.0 * 2e-10, "max_diff")):
        v = judge(_row("ref-recurrent", rel=rel, maxd=maxd, out_dtype="float64"), BASE, FLOOR)
        assert (v.status, v.metric) == (FAIL, metric) and "fp64 rule" in v.message, v
    assert judge(_row("ref-recurrent", rel=0.99 * FP64_RTOL, maxd=0.99 * FP64_RTOL * 4.0, out_dtype="float64"),
                 None, None).status == PASS  # the fp64 rule needs neither baseline nor floor


def test_an_fp64_capture_is_not_failed_by_a_zero_floor():
    """The floor of an fp64 tensor is 0 (rounding fp64 to fp64): as a bound it failed every fp64 output."""
    floor = _row(FLOOR_BACKEND, rel=0.0, maxd=0.0, out_dtype="float64", dtype="fp64")
    row = _row("ref-recurrent", rel=7e-16, maxd=1e-15, out_dtype="float64", dtype="fp64")
    assert judge(row, None, floor).status == PASS


# ----------------------------------------------------------------------------------------------- INVALID


def _frame(check_rel):
    rows = [FLOOR, BASE, _row(FLOOR_BACKEND, "ht", 1e-8, 1e-7, out_dtype="float32"),
            _row("torch-emulated", "ht", 3e-3, 1e-2, out_dtype="float32"),
            _row("ref-recurrent", rel=check_rel, maxd=check_rel, out_dtype="float64"),
            _row("ref-recurrent", "ht", rel=5e-16, maxd=5e-16, out_dtype="float64"),
            _row("fla-triton", rel=4e-3, maxd=2e-2), _row("fla-triton", "ht", 4e-3, 2e-2, out_dtype="float32")]
    other = "dense_B1_T65_H2-HV4_K32-V32_bf16_g-fp32_beta-fp32_qwen-gates_s0"
    fixed = {"rel_rmse": 5e-16, "max_diff": 5e-16}
    rows += [{**r, "case_id": other, "group_id": other[:-3], **(fixed if r["backend"] == "ref-recurrent" else {})}
             for r in rows]
    return pd.DataFrame(rows)


def test_references_that_disagree_make_the_case_invalid_and_withhold_every_verdict():
    judged = judge_frame(_frame(0.65))
    bad = judged[judged["case_id"] == CASE_ID]
    assert set(bad["verdict"]) == {INVALID} and len(bad) == 4  # ref-recurrent's and fla-triton's o and ht
    msg = bad["v_message"].iloc[0]
    assert CASE_ID in msg and "o rel_rmse 6.500e-01 > 1.000e-10" in msg
    assert set(judged[judged["case_id"] != CASE_ID]["verdict"]) == {PASS}  # the other case is judged as usual
    text = verdicts.section(_frame(0.65))
    assert "Invalid cases (1)" in text and "o rel_rmse 6.500e-01 > 1.000e-10" in text and INVALID in text
    assert set(judge_frame(_frame(3e-16))["verdict"]) == {PASS}


def test_the_section_says_when_a_cached_reference_was_recomputed():
    df = _frame(3e-16)
    df["ref_source"] = ["recomputed: entry x: computed from other inputs or flags"] + ["cache"] * (len(df) - 1)
    assert f"case {CASE_ID}: recomputed: entry x: computed from other inputs" in verdicts.section(df)


def test_a_nan_in_the_recurrent_reference_invalidates_the_case():
    rows = [_row("ref-recurrent", status="nan", out_dtype="float64", rel=math.nan, maxd=math.nan)]
    rows[0]["nan_count"] = 3
    assert "3 NaN" in cross_check(rows)
    assert cross_check([_row("ref-recurrent", status="unsupported", out_dtype=None)]) is None  # did not run


def test_by_configuration_puts_invalid_first():
    judged = judge_frame(_frame(0.65))
    conf = verdicts.by_configuration(judged)
    assert set(conf[conf["group_id"] == CASE_ID[:-3]]["verdict"]) == {INVALID}


# ----------------------------------------------------------------------------------------------- the baseline


@pytest.mark.parametrize("base, words", [
    (_row("torch-emulated", rel=0.31, maxd=1.2), "194x the rounding floor"),  # decay dropped: rel_rmse ~0.3
    (_row("torch-emulated", rel=0.0, maxd=0.0), "0x the rounding floor"),  # the reference itself, not rounded
    (_row("torch-emulated", rel=math.nan, maxd=math.nan, status="nan"), "not finite"),
    (_row("torch-emulated", "ht", rel=0.2, maxd=0.5, out_dtype="float32"), "against fp64 > 0.05"),
], ids=["dropped-decay", "zero-error", "nan", "ht-far-off"])
def test_an_insane_baseline_is_no_bound(base, words):
    """A baseline far from fp64 made a bound 2x its error, and a wrong kernel passed under it."""
    floor = FLOOR if base["tensor"] == "o" else _row(FLOOR_BACKEND, "ht", 1e-6, 1e-6, out_dtype="float32")
    row = _row("fla-triton", base["tensor"], rel=0.1, maxd=0.4, out_dtype=base["out_dtype"])
    v = judge(row, base, floor)
    assert v.status == NOREF and words in v.message and "sanity" in v.message, v


def test_a_sane_baseline_bounds_and_a_missing_one_falls_back_to_the_floor():
    row = _row("fla-triton", rel=6e-3, maxd=3e-2)
    assert judge(row, BASE, FLOOR).status == PASS  # 6e-3 <= 2 x 3.5e-3
    assert judge(_row("fla-triton", rel=1.2e-2, maxd=3e-2), BASE, FLOOR).status == FAIL  # 1.2e-2 > 2 x 3.5e-3
    assert judge(_row("fla-triton", rel=6e-3, maxd=9e-2), BASE, FLOOR).status == FAIL  # 9e-2 > 4 x 2e-2
    assert judge(row, _row("torch-emulated", status="unsupported"), FLOOR).status == FAIL  # 6e-3 > 2 x 1.6e-3


def test_the_limits_hold_on_the_baselines_of_the_recorded_runs():
    """Measured data: every baseline row of the committed H200 runs passes its own sanity check (the table's
    limits are not so tight that a correct baseline is refused)."""
    from parity import results
    from parity.environment import ROOT

    files = sorted((ROOT / "reports").glob("*/results.jsonl.gz"))
    if not files:
        pytest.skip("no recorded result files in reports/")
    df = results.load(files[0]).frame()
    df = df[(df["against"] == "fp64") & (df["status"] == "ok")]
    index = {(r["case_id"], r["backend"], r["tensor"]): r for r in df.to_dict("records")}
    checked = 0
    for (case, backend, tensor), r in index.items():
        if backend == "torch-emulated":
            assert verdicts.baseline_problem(r, r, index.get((case, FLOOR_BACKEND, tensor))) is None, (case, tensor)
            checked += 1
    assert checked > 100 and set(BASELINE_CHECKS) >= {"lowp-same", "fp32", "widened"}


# ----------------------------------------------------------------------------------------------- statuses


@pytest.mark.parametrize("status", ["passed", None, "OK"])
def test_an_unknown_status_is_refused_naming_it(status):
    with pytest.raises(ValueError, match=r"has status .*; a row's status is one of ok, nan, error"):
        judge(_row("fla-triton", status=status), BASE, FLOOR)
    with pytest.raises(ValueError, match="fla-triton"):
        judge_frame(pd.DataFrame([FLOOR, BASE, _row("fla-triton", status=status)]))
    with pytest.raises(ValueError, match="torch-emulated"):
        judge(_row("fla-triton"), {**BASE, "status": status}, FLOOR)


# ----------------------------------------------------------------------------------------------- end to end


class SkipsLastToken(TorchEmulated):
    """A wrong kernel: the last token's state update is skipped (its beta is zero)."""

    name = "fake-skips-last-token"
    has_backward = False

    def _forward(self, inputs):
        beta = inputs.beta.clone()
        beta[:, -1] = -1e4 if inputs.use_beta_sigmoid_in_kernel else 0.0
        o, ht, _ = super()._forward(dataclasses.replace(inputs, beta=beta))
        return o, ht, "fake/skips-last-token"


class BaselineWithoutDecay(TorchEmulated):
    """A broken baseline: the decay is dropped (g = 0)."""

    def _forward(self, inputs):
        o, ht, _ = super()._forward(dataclasses.replace(inputs, g=torch.zeros_like(inputs.g),
                                                        use_gate_in_kernel=False))
        return o, ht, "fake/baseline-without-decay"


SMOKE = [c for c in get_matrix("smoke").cases(None) if not c.grad and c.T >= 63][::5]


def _cells(session):
    return {c.id: {t: v.status for t, v in session.run(c, "tests.test_verdicts:SkipsLastToken").verdicts.items()}
            for c in SMOKE[:4]}


def test_a_wrong_kernel_never_passes_with_a_sane_or_a_broken_baseline():
    """Today a baseline without decay serves as the bound and the kernel that skips the last token passes 20 of 74
    smoke cells; with a correct baseline it fails every one, with the broken one every cell is NO-BASELINE or FAIL."""
    good = _cells(ParitySession(device="cpu"))
    assert all(FAIL in v.values() for v in good.values()), good
    broken = ParitySession(device="cpu")
    broken._backends["torch-emulated"] = BaselineWithoutDecay()
    cells = _cells(broken)
    assert not [c for c, v in cells.items() if set(v.values()) == {PASS}], cells
    assert sum(NOREF in v.values() for v in cells.values()) >= 2, cells


def test_the_fp64_references_agree_and_the_baseline_is_sane_on_smoke_cases():
    s = ParitySession(device="cpu")
    for case in SMOKE[:2]:
        st = s.state(case)
        assert st.invalid is None, st.invalid
        for t, base in st.base.items():
            assert verdicts.baseline_problem(base, base, st.floor[t]) is None, (case.id, t)
