"""Time the one-term plans' recompute (``pipeline.recompute``, the ws tables form) storing U's hi term alone, as
dispatched, against the same kernel storing U hi + lo, on one shape; checks that S and U hi are bitwise the same.

    python3 benchmarks/experiments/recompute_u_time.py [--shape B,T,H,HV] [--rep 50]

Prints ms for each form (``triton.testing.do_bench``, each call with its output allocations) and their ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,32")
    ap.add_argument("--rep", type=int, default=50)
    a = ap.parse_args(argv)
    from contextlib import nullcontext
    from unittest import mock

    import torch
    import triton

    from fused_bwd_check import make_inputs
    from kernels.backward import pipeline as bp
    from kernels.plan import ONE_TERM_FIELDS, BackwardPlan

    B, T, H, HV = (int(s) for s in a.shape.split(","))
    q, k, v, g, beta, do, dht, h0, cu = make_inputs(B, T, H, HV, False, False, "cuda")
    b = bp.prepare_backward(q, k, v, g, beta, do, dht, None, h0, True, False, cu)
    plan = dataclasses.replace(bp.plan_for(b), **ONE_TERM_FIELDS, fused=True)
    b, _ = bp._scaled(b, plan)
    tables = bp.prep(b=b, plan=plan, saved=None)
    intra, state, *rest = plan.recompute_configs()
    split = (intra, dataclasses.replace(state, prec=dataclasses.replace(state.prec, u="split")), *rest)
    forms = {"U hi alone": None, "U hi + lo": split}
    out, ms = {}, {}
    for name, cfgs in forms.items():
        with mock.patch.object(BackwardPlan, "recompute_configs", lambda self: cfgs) if cfgs else nullcontext():
            run = lambda: bp.recompute(x=b.x, plan=plan, tables=tables, side=None)  # noqa: E731
            out[name] = run()
            ms[name] = triton.testing.do_bench(run, warmup=5, rep=a.rep)
    one, two = out.values()
    same = all(torch.equal(getattr(one, n), getattr(two, n)) for n in ("Sch", "Uh"))
    print(f"shape B{B} T{T} H{H} HV{HV}, {torch.cuda.get_device_name()}; S and U hi bitwise equal: {same}")
    for name, t in ms.items():
        print(f"  {name:<12} {t:7.3f} ms   {state.name if name == 'U hi alone' else split[1].name}")
    print(f"  ratio hi alone / hi + lo: {ms['U hi alone'] / ms['U hi + lo']:.3f}")


if __name__ == "__main__":
    main()
