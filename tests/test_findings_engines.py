"""The engine view (parity.engines) and the report's opening findings (parity.findings), from synthetic result rows
with known answers."""

from __future__ import annotations

import json

import pytest
from cases import Case
from parity import cli, engines, findings, report
from tests.test_recommend import _row, _rs

SHORT = Case(T=1024, H=1, HV=2, K=128, V=128, dtype="bf16", dist="qwen-gates")
LONG = SHORT.replace(T=40960)


def _cell(case, **backends):
    """floor 1e-3 and baseline 1e-3 (bound: max(2 x 1e-3, floor factor x 1e-3)); each backend (rel_rmse, max_diff)."""
    rows = [_row(case, "fp64-rounded", 1e-3, 1e-3), _row(case, "torch-emulated", 1e-3, 1e-3)]
    rows += [_row(case, name, *val) for name, val in backends.items()]
    return rows


def _rows():
    return (_cell(SHORT, **{"flashinfer": (1e-3, 1e-3), "sglang-fla": (1e-3, 1e-3), "fla-triton": (1e-3, 1e-3)})
            + _cell(LONG, **{"flashinfer": (1e-2, 1e-3), "sglang-fla": (1e-3, 1e-3), "fla-triton": (1e-3, 1e-3)}))


def _frame(rows):
    rs = _rs(rows)
    return rs, report.frame(rs)


def _view(sm, versions=None, rows=None):
    rs, df = _frame(rows or _rows())
    return engines.view(df, sm, versions or {}).set_index(["engine", "runs"])


def test_vllm_on_hopper_runs_flashinfer_and_gets_its_verdicts():
    v = _view("90", {"vllm": "0.33.0"})
    row = v.loc[("vLLM", "flashinfer")]
    assert row["installed"] == "vllm 0.33.0" and row["cases"] == 2
    assert row["verdicts"].startswith("1 PASS, 1 FAIL") or row["verdicts"].startswith("1 FAIL, 1 PASS")
    assert "exp(g)" in row["g, beta"]
    assert ("vLLM", "vllm-fla") not in v.index


def test_sglang_splits_by_prefill_length_and_says_when_not_installed():
    v = _view("90")
    short, long_ = v.loc[("SGLang", "flashinfer")], v.loc[("SGLang", "sglang-fla")]
    assert short["cases"] == 1 and short["verdicts"].startswith("1 PASS")
    assert long_["cases"] == 1 and "32768" in long_["why"] and long_["verdicts"].startswith("1 PASS")
    assert short["installed"] == "not installed (rule of sglang 0.5.23)"


def test_rules_off_hopper_and_without_a_gpu():
    assert engines.capability("90") == (9, 0) and engines.capability("100") == (10, 0)
    assert engines.capability(None) is None
    for sm, vllm, sglang in (("80", "vllm-fla", "sglang-fla"), (None, "vllm-fla", "sglang-fla"),
                             ("100", "flashinfer", "sglang-fla")):
        v = _view(sm).reset_index()
        assert set(v.loc[v["engine"] == "vLLM", "runs"]) == {vllm}, sm
        assert sglang in set(v.loc[v["engine"] == "SGLang", "runs"]), sm
    assert engines._vllm((10, 0), SHORT.replace(K=64, V=64))[0] == "vllm-fla"
    assert engines._sglang((9, 0), SHORT.replace(K=64, V=64))[0] == "sglang-fla"


def test_engine_backend_missing_from_the_run_is_said():
    rows = [r for r in _rows() if r["backend"] != "flashinfer"]
    v = _view("90", rows=rows)
    assert v.loc[("vLLM", "flashinfer")]["verdicts"] == "flashinfer not in this run"


def test_findings_name_failures_over_the_floor_with_the_known_cause(tmp_path):
    known = tmp_path / "known.json"
    known.write_text(json.dumps([{"backend": "flashinfer", "case": [LONG.group_id + "_*"], "reason": "a known cause",
                                  "link": "https://example.org/issue"}]))
    rs, df = _frame(_rows())
    text = findings.section(rs, df, known)
    assert text.startswith("## Findings")
    assert "`flashinfer` 1" in text and LONG.group_id in text
    assert "| 10.00 " in text  # rel_rmse 1e-2 over the floor's 1e-3 (and over the baseline's 1e-3)
    worst = findings.worst_over_floor(df).set_index("backend")
    assert worst.loc["flashinfer", "gates fp32"] == pytest.approx(10.0)
    assert worst.loc["fla-triton", "gates fp32"] == pytest.approx(1.0)
    assert set(worst.index) == {"flashinfer", "sglang-fla", "fla-triton"}
    assert "a known cause (https://example.org/issue)" in text
    assert "No failure: `fla-triton`, `sglang-fla`." in text
    assert "- vLLM (not installed (rule of vllm 0.33)) runs `vllm-fla` on 2 case(s)" in text  # no sm in the run env


def test_findings_without_a_known_cause_quote_the_verdict_and_survive_a_bad_file(tmp_path):
    bad = tmp_path / "known.json"
    bad.write_text("{not json")
    rs, df = _frame(_rows())
    text = findings.section(rs, df, bad)
    assert "Known causes not read" in text and str(bad) in text
    assert "rel_rmse 1.000e-02 >" in text


def test_findings_with_no_failure():
    rs, df = _frame(_cell(SHORT, **{"flashinfer": (1e-3, 1e-3)}))
    text = findings.section(rs, df)
    assert "No backend failed a verdict in this run." in text and "No failure: `flashinfer`." in text


def test_report_opens_with_findings_and_shows_the_engine_view():
    text = report.render(_rs(_rows()))
    assert text.index("## Findings") < text.index("## Environment") < text.index("## Engine view")


def test_cli_engines(tmp_path, capsys):
    assert cli.main(["engines"]) == 0
    out = capsys.readouterr().out
    assert "Engine view for this machine" in out and "vLLM" in out and "SGLang" in out
    path = tmp_path / "results.jsonl"
    rs = _rs(_rows())
    with path.open("w") as f:
        f.write(json.dumps({**rs.runs[0], "env": {**rs.runs[0]["env"], "sm": "90"}}) + "\n")
        for r in rs.rows:
            f.write(json.dumps({"record": "row", **r}) + "\n")
    code = cli.main(["engines", str(path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "## Engine view" in out.out and "On sm_90" in out.out and "| flashinfer |" in out.out


def test_every_new_backend_is_in_the_report_tables():
    rs, df = _frame(_rows())
    summary = report.section_summary(df)
    for b in ("flashinfer", "sglang-fla"):
        assert b in summary


def test_engines_cli_names_a_missing_file_and_a_run_without_matrix_cases_gets_the_rule(tmp_path, capsys):
    assert cli.main(["engines", str(tmp_path / "nope.jsonl")]) == 2
    assert "no result file at" in capsys.readouterr().err
    rows = [dict(r, case_id="replay:layer0", group_id="replay:layer0") for r in _rows()]
    v = _view("90", rows=rows)
    assert v.loc[("vLLM", "flashinfer")]["verdicts"] == "-"


def test_a_run_records_each_backends_conversion_and_the_report_shows_it(tmp_path):
    """The engine backends on a CPU: unavailable with the reason, their input conversion in the run header and in
    the report's backend table, and the findings and engine view present in the report."""
    from parity import results, runner

    case = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
    cfg = runner.RunConfig(cases=[case], out=tmp_path / "r" / "results.jsonl", progress=False, cache_dir="",
                           workers=0, backends=["flashinfer", "vllm-fla"])
    rs = results.load(runner.run(cfg))
    avail = rs.runs[0]["availability"]
    assert "alpha = exp(g) fp32" in avail["flashinfer"]["conversion"] and not avail["flashinfer"]["available"]
    assert "packed [1, B*T, H, K]" in avail["vllm-fla"]["conversion"]
    text = report.render(rs)
    assert "| input conversion" in text and "g -> alpha = exp(g) fp32" in text
    assert text.index("## Findings") < text.index("## Environment") < text.index("## Engine view")
    statuses = {r["status"] for r in rs.rows if r["backend"] in ("flashinfer", "vllm-fla")}
    assert statuses == {"unavailable"}


def test_findings_list_withheld_cells():
    """A baseline far from the floor (1000x: it fails its sanity check) serves as no bound: the cell is NO-BASELINE,
    and the findings list it with the backends that failed."""
    rows = [_row(SHORT, "fp64-rounded", 1e-3, 1e-3), _row(SHORT, "torch-emulated", 1.0, 1.0),
            _row(SHORT, "flashinfer", 1e-3, 1e-3)]
    rs, df = _frame(rows)
    text = findings.section(rs, df)
    assert "`flashinfer` 1" in text and "NO-BASELINE" in text
    assert "No backend failed a verdict in this run." not in text
