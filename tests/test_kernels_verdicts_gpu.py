"""The kernels' accuracy verdicts by the harness's own rule (marker ``gpu``): ``cases.Case`` rows run through
``parity.execute.run_case`` on the ``tilelang`` backend (forward and gradients) beside the same-precision
baseline, judged by ``parity.verdicts.judge_frame`` exactly as ``parity run`` judges a sweep cell.

Skips with the reason when there is no sm_90 GPU or tilelang.  Rows: dense and every varlen layout, GVA ratios
1, 2 and 4, an initial state in both layouts, bf16 and fp16, gates in the input dtype, K = V = 64, the decay
distributions that stress the state (g near -20, no decay), padded varlen (cu_seqlens[-1] < T), FLA's in-kernel
gate and beta sigmoid (``qwen-gates-kernel``) and the gradient rows of each.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from cases.case import Case
from tests import kernel_support as tt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

CASES = [
    Case(layout="dense", B=2, T=1000, H=2, HV=4, grad=True),
    Case(layout="dense", B=1, T=8192, H=4, HV=8, h0_dtype="fp32", grad=True),
    Case(layout="varlen-boundary", T=1024, H=2, HV=4, h0_dtype="fp32", state_v_first=True, grad=True),
    Case(layout="varlen-ragged", T=4096, H=1, HV=4, grad=True),
    Case(layout="varlen-short", T=2048, H=2, HV=2, h0_dtype="fp32", grad=True),
    Case(layout="varlen-empty", T=1024, H=2, HV=4, h0_dtype="fp32", grad=True),
    Case(layout="dense", B=1, T=2048, H=2, HV=4, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", grad=True),
    Case(layout="dense", B=1, T=1000, H=2, HV=4, K=64, V=64, h0_dtype="fp32", state_v_first=True, grad=True),
    Case(layout="dense", B=1, T=2048, H=2, HV=4, dist="strong-decay", grad=True),
    Case(layout="dense", B=1, T=2048, H=2, HV=4, dist="large-h0", h0_dtype="fp32", grad=True),
    Case(layout="varlen-padded", T=4096, H=2, HV=4, h0_dtype="fp32", grad=True),
    Case(layout="varlen-padded", T=1000, H=2, HV=4, K=64, V=64, h0_dtype="fp32", state_v_first=True, grad=True),
    Case(layout="varlen-padded", T=2048, H=1, HV=2, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", grad=True),
    Case(layout="dense", B=2, T=1000, H=2, HV=4, dist="qwen-gates-kernel", grad=True),
    Case(layout="varlen-ragged", T=4096, H=2, HV=4, dist="qwen-gates-kernel", h0_dtype="fp32", grad=True),
    Case(layout="varlen-padded", T=2048, H=2, HV=4, dist="qwen-gates-kernel", g_dtype="bf16", beta_dtype="bf16",
         grad=True),
    Case(layout="dense", B=1, T=8192, H=4, HV=8, dist="qwen-gates-kernel"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tilelang_cells_pass_the_harness_rule(case):
    from parity.backends import BASELINE, get_backend
    from parity.execute import run_case
    from parity.verdicts import PASS, judge_frame

    rows = []
    run_case(case, [get_backend("tilelang"), get_backend(BASELINE)], torch.device("cuda"), None,
             lambda name, rs: rows.extend(rs), repeat=False, pairwise=False, attribution=False)
    judged = judge_frame(pd.DataFrame(rows))
    ours = judged[judged["backend"] == "tilelang"]
    assert len(ours) > 0, "no tilelang row"
    bad = ours[ours["verdict"] != PASS]
    assert bad.empty, "\n".join(bad["v_message"].astype(str))
    tensors = set(ours["tensor"])
    assert {"o", "ht"} <= tensors and (not case.grad or {"dq", "dk", "dv"} <= tensors), tensors
