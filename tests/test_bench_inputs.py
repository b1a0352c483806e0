"""The benchmarks' inputs on a CPU (``benchmarks.inputs``): ``--gates qwen`` changes g alone, to gates that carry
the state across many chunks; the summaries name the gates they were timed with; a dry run leaves the shape
table as it was."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_kernels_bwd as bench_bwd
from benchmarks import bench_kernels_fwd as bench_fwd
from benchmarks.inputs import SHAPES, make
from cases.distributions import qwen_gates

CPU = torch.device("cpu")


def _chunk_log_decay(g):
    """Median over heads and chunks of the 64-token sums of g [1, T, HV]."""
    return g[0].reshape(-1, 64, g.shape[-1]).sum(1).median().item()


def test_qwen_gates_change_g_alone():
    base = make(1, 1024, 2, 4, None, CPU, seed=3)
    qwen = make(1, 1024, 2, 4, None, CPU, seed=3, gates="qwen")
    for a, b in zip(base[:3] + base[4:5], qwen[:3] + qwen[4:5]):       # q, k, v, beta
        assert torch.equal(a, b)
    assert torch.equal(qwen[3], qwen_gates(1, 1024, 4, torch.Generator().manual_seed(3)))
    assert qwen[3].dtype == torch.float32 and (qwen[3] <= 0).all()
    # logsigmoid(N(0,1)) forgets within a chunk (about -52); the Qwen gates keep most heads' state for many chunks
    assert _chunk_log_decay(base[3]) < -40 and _chunk_log_decay(qwen[3]) > -20


def test_unknown_gates_are_refused_naming_them():
    with pytest.raises(ValueError, match="unknown gates 'sigmoid'"):
        make(1, 64, 1, 1, None, CPU, gates="sigmoid")


@pytest.mark.parametrize("bench", [bench_fwd, bench_bwd], ids=["fwd", "bwd"])
def test_summary_names_the_qwen_gates(bench, capsys, tmp_path):
    out_md = tmp_path / "RESULTS.md"
    extra = ["--variants", "default"] if bench is bench_fwd else []
    assert bench.main(["--dry-run", "--no-check", "--shapes", "B1_T8192_H4_HV8", "--gates", "qwen", "--rep", "1",
                       "--warmup", "0", "--results", str(out_md), *extra]) == 0
    out = capsys.readouterr().out
    assert "qwen gates" in out[out.index("== summary"):].splitlines()[0]
    assert "qwen gates" in out_md.read_text()
    assert SHAPES["B1_T8192_H4_HV8"] == (1, 8192, 4, 8, None)     # the dry run shrank a copy
