"""GPU checks of our TileLang GDN forward that the verdict rows (``test_kernels_verdicts_gpu.py``) cannot express
(marker ``gpu``): every state-kernel plan the dispatch can choose, forced where it would choose another, judged by
``parity.verdicts`` as its own backend; the forward keeping its intra tables changes no bit of o or the final
state; int32 cu_seqlens give bitwise the int64 result; output_final_state=False and bad inputs.

Skips with the reason when there is no CUDA device, it is not sm_90 (Hopper), or tilelang is missing.
"""

from __future__ import annotations

import dataclasses
import functools

import pandas as pd
import pytest
import torch

from cases.case import Case
from parity.backends.tilelang import TileLangKernels
from tests import kernel_support as tt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

# with h0 (precision "default_h0") and without ("default": the output kernel's 128-column form); GVA 2 and 4, the
# varlen boundaries and many short sequences, K = V = 64, the in-kernel L2 norm
PLAN_CASES = [
    Case(T=1000, H=4, HV=8, h0_dtype="fp32"),
    Case(layout="varlen-boundary", T=577, H=2, HV=4, h0_dtype="fp32", state_v_first=True),
    Case(B=2, T=500, H=2, HV=4, K=64, V=64, h0_dtype="fp32", state_v_first=True),
    Case(layout="varlen-short", T=8192, H=2, HV=4, h0_dtype="fp32"),
    Case(T=8192, H=4, HV=8),
    Case(T=2048, H=2, HV=8, dist="raw-qk-l2"),
]
# plan values besides the dispatched one (ForwardPlan fields): the register-operand state kernel without CP, with
# CP forced and with BV 128; the shared-memory one at two CTAs per SM and at one
PLANS = {"rv": dict(state_form="rv", block_v=64, ctas_per_sm=1, cp=1),
         "rv_cp3": dict(state_form="rv", block_v=64, ctas_per_sm=1, cp=3),
         "rv_bv128": dict(state_form="rv", block_v=128, ctas_per_sm=1, cp=1),
         "smem_occ2_bv16": dict(state_form="smem", block_v=16, ctas_per_sm=2, cp=1),
         "smem_occ2_bv32": dict(state_form="smem", block_v=32, ctas_per_sm=2, cp=1),
         "smem_occ1_bv64": dict(state_form="smem", block_v=64, ctas_per_sm=1, cp=1)}


class PlannedTileLang(TileLangKernels):
    """The ``tilelang`` backend's forward with the dispatched plan changed by ``change`` (ForwardPlan fields)."""

    has_backward = False

    def __init__(self, label: str, change: dict):
        self.name = f"tilelang[{label}]"
        self.change = change

    def supports(self, case, device):
        bv = self.change.get("block_v", 0)
        if bv > case.V:
            return False, f"a state block of {bv} value columns needs V >= {bv} (V = {case.V})"
        return super().supports(case, device)

    def _forward(self, inputs):
        from kernels.forward.pipeline import chunk_gated_delta_rule as impl
        from kernels.forward.pipeline import plan_for, prepare

        kw = {k: v for k, v in inputs.kwargs().items() if k not in ("q", "k", "v", "g", "beta")}
        args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        plan = dataclasses.replace(plan_for(prepare(*args, **kw)), **self.change)
        o, ht = impl(*args, **kw, plan=plan)
        return o, ht, f"gdn-parity/tilelang {self.name}"


@functools.lru_cache(maxsize=None)
def judged_plans(case: Case) -> pd.DataFrame:
    """``parity.verdicts.judge_frame`` of ``case`` run on every plan of ``PLANS`` and the baseline."""
    from parity.backends import BASELINE, get_backend
    from parity.execute import run_case
    from parity.verdicts import judge_frame

    rows = []
    backends = [PlannedTileLang(label, change) for label, change in PLANS.items()] + [get_backend(BASELINE)]
    run_case(case, backends, torch.device("cuda"), None, lambda name, rs: rows.extend(rs), repeat=False,
             pairwise=False, attribution=False)
    return judge_frame(pd.DataFrame(rows))


@pytest.mark.parametrize("label", list(PLANS))
@pytest.mark.parametrize("case", PLAN_CASES, ids=[c.id for c in PLAN_CASES])
def test_every_plan_the_dispatch_can_choose_passes_the_harness_rule(case, label):
    from parity.verdicts import PASS

    ok, why = PlannedTileLang(label, PLANS[label]).supports(case, torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    df = judged_plans(case)
    ours = df[df["backend"] == f"tilelang[{label}]"]
    assert set(ours["tensor"]) == {"o", "ht"}, sorted(ours["tensor"])
    bad = ours[ours["verdict"] != PASS]
    assert bad.empty, "\n".join(f"{r.verdict}: {r.v_message}" for r in bad.itertuples())


@pytest.mark.parametrize("case", PLAN_CASES[:5], ids=[c.id for c in PLAN_CASES[:5]])
def test_kept_tables_change_nothing_else(case):
    """The forward that keeps its intra tables for the backward (the intra kernel also storing Tinv) gives bitwise
    the same o and final state as the one that does not, and hands over Th, Ah, Al of [HV, NC, 64, 64]."""
    from kernels.forward.pipeline import chunk_gated_delta_rule as impl

    args, kw = tt.call_args(case, torch.device("cuda"))
    o, ht = impl(*args, **kw, output_final_state=True)
    kept = {}
    o2, ht2 = impl(*args, **kw, output_final_state=True, keep_tables=kept)
    torch.cuda.synchronize()
    assert torch.equal(o, o2), f"o differs: max |diff| / max {tt.max_rel(o2, o):.3e}"
    assert torch.equal(ht, ht2), f"final state differs: max |diff| / max {tt.max_rel(ht2, ht):.3e}"
    assert set(kept) == {"Th", "Ah", "Al"} and kept["Th"].shape[-2:] == (64, 64)


def test_int32_cu_seqlens_give_the_int64_result():
    import kernels

    args, kw = tt.call_args(PLAN_CASES[1], torch.device("cuda"))
    o, ht = kernels.chunk_gated_delta_rule(*args, **kw, output_final_state=True)
    kw["cu_seqlens"] = kw["cu_seqlens"].to(torch.int32)
    o32, ht32 = kernels.chunk_gated_delta_rule(*args, **kw, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.equal(o, o32) and torch.equal(ht, ht32)


def test_output_final_state_false_and_no_h0():
    """Without output_final_state no state is returned and o is bitwise the o of the call that returns it."""
    import kernels

    (q, k, v, g, b), _ = tt.call_args(Case(B=2, T=300, H=2, HV=4), torch.device("cuda"))
    o, ht = kernels.chunk_gated_delta_rule(q, k, v, g, b)
    o2, ht2 = kernels.chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True)
    torch.cuda.synchronize()
    assert ht is None and ht2 is not None
    assert torch.equal(o, o2)


def test_bad_input_on_gpu_raises_valueerror():
    import kernels

    (q, k, v, g, b), _ = tt.call_args(Case(B=2, T=64, H=2, HV=4), torch.device("cuda"))
    with pytest.raises(ValueError, match="batch size must be 1"):
        kernels.chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.tensor([0, 64], device="cuda"))
    with pytest.raises(ValueError, match="initial_state"):
        kernels.chunk_gated_delta_rule(q, k, v, g, b, initial_state=torch.zeros(3, 4, 128, 128, device="cuda"))
