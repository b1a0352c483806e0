"""The plans that ``tests/test_kernels_gpu.py`` forces (``PLANS`` on ``PLAN_CASES``), checked on the CPU before a
GPU runs them: each change of the dispatched plan is a valid ``ForwardPlan`` for every case it applies to, and the
kernels those plans need beyond ``kernels.build.all_configs`` (forms the dispatch never chooses, compiled on the
GPU box at first use) compile for sm_90a with no spills and no stack."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests import kernel_support as tt
from tests import test_kernels_gpu as gpu

RERUN = "rerun: pytest tests/test_gpu_test_plans.py"


@functools.lru_cache(maxsize=1)
def forced():
    """[(case, label, dispatched plan, forced plan or the ValueError that refused it)] over the applicable pairs."""
    from benchmarks.memory_plan import stub_kernel_path
    from kernels.forward.pipeline import plan_for, prepare

    out = []
    for case in gpu.PLAN_CASES:
        args, kw = tt.call_args(case)
        with stub_kernel_path():
            dispatched = plan_for(prepare(*args, **kw))
        for label, change in gpu.PLANS.items():
            if gpu.plan_skip_reason(change, case):
                continue
            try:
                out.append((case, label, dispatched, dataclasses.replace(dispatched, **change)))
            except ValueError as e:
                out.append((case, label, dispatched, e))
    return out


def test_every_forced_plan_is_a_valid_plan():
    refused = [f"ForwardPlan refuses {gpu.PLANS[label]} on {d}: {p} / case {case.id} / plan {label} / {RERUN}"
               for case, label, d, p in forced() if isinstance(p, ValueError)]
    assert len(forced()) >= len(gpu.PLANS)
    assert not refused, "\n".join(refused)


def _unbuilt():
    from kernels.build import all_configs
    built = set(all_configs())
    out = []
    for _, _, _, plan in forced():
        if not isinstance(plan, ValueError):
            out += [c for c in plan.configs() if c not in built and c not in out]
    return out


UNBUILT = _unbuilt()


@pytest.mark.skipif(not UNBUILT, reason="every forced plan's kernels are in kernels.build.all_configs")
@pytest.mark.parametrize("cfg", UNBUILT, ids=[c.name for c in UNBUILT])
def test_forced_kernels_outside_the_build_list_compile(cfg):
    from kernels.build import compile_report, get_kernel

    px = compile_report(cfg, get_kernel, type(cfg).__name__)["ptxas"]
    got = {k: px.get(k) for k in ("returncode", "registers", "stack", "spill_stores", "spill_loads")}
    assert got["returncode"] == 0 and got["registers"] and not any(got[k] for k in got if k not in (
        "returncode", "registers")), f"{cfg.name}: ptxas {got} / {RERUN} -k '{cfg.name}'"
