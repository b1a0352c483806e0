"""Attribution rows (tensor h): every backend that exposes its chunk-start states is compared with the fp64
reference's, per chunk."""

from __future__ import annotations

import pytest
import torch

from cases import Case, make_inputs
from parity import attribution, report, results, runner
from parity.execute import base_row
from parity.backends import get_backend


def test_chunk_profile_known_answer():
    ref = torch.ones(1, 4, 1, 2, 2, dtype=torch.float64)
    out = ref.clone()
    out[:, 2] *= 1.5  # only chunk 2 is off, by 50%
    assert attribution.chunk_profile(out, ref) == [0.0, 0.0, 0.5, 0.0]
    assert attribution.chunk_profile(out, ref, max_bins=2) == [0.0, 0.25]


def test_emulated_states_are_compared_chunk_by_chunk(tmp_path):
    cases = [Case(T=200, H=1, HV=2, K=16, V=16, dtype="bf16", dist="qwen-gates"),
             Case(layout="varlen-ragged", T=200, H=1, HV=2, K=16, V=16, dtype="bf16")]
    cfg = runner.RunConfig(cases=cases, out=tmp_path / "r" / "results.jsonl", backends=["torch-emulated"],
                           workers=0, progress=False, cache_dir="")
    rs = results.load(runner.run(cfg))
    h = [r for r in rs.rows if r["tensor"] == "h"]
    assert len(h) == 1 and h[0]["case_id"] == cases[0].id  # dense cases only
    row = h[0]
    assert row["status"] == "ok" and len(row["chunk_rel_rmse"]) == 4  # ceil(200 / 64) chunks
    assert row["chunk_rel_rmse"][0] == 0.0  # the first chunk starts from the zero state, exactly
    assert 1e-4 < row["rel_rmse"] < 1e-2  # bf16-rounded stored states
    text = report.write_report([tmp_path / "r" / "results.jsonl"]).read_text()
    assert "## Attribution: where the error enters" in text


def test_shape_mismatch_is_an_error_row():
    class Broken(type(get_backend("torch-emulated"))):
        name = "broken-states"

        def chunk_states(self, inputs):
            return torch.zeros(1, 1, 1, 1, 1), "broken"

    case = Case(T=70, H=1, HV=1, K=8, V=8, dtype="fp32")
    rows = attribution.attribution_rows(case, [Broken()], make_inputs(case), base_row)
    assert rows[0]["status"] == "error" and "chunk states have shape" in rows[0]["reason"]


@pytest.mark.slow
def test_fla_triton_states_under_the_interpreter():
    case = Case(T=128, H=1, HV=2, K=16, V=16, dtype="fp32", dist="qwen-gates", h0_dtype="fp32")
    b = get_backend("fla-triton")
    ok, reason = b.available()
    if not ok:
        pytest.skip(reason)
    rows = attribution.attribution_rows(case, [b], make_inputs(case), base_row)
    assert rows[0]["status"] == "ok" and rows[0]["rel_rmse"] < 1e-5
    assert rows[0]["chunk_rel_rmse"][0] == 0.0  # h[0] is the initial state itself
