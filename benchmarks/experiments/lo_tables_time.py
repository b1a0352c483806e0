"""Time the one-term plans' prep and recompute storing Tinv's and U's hi terms alone, as dispatched, against the same
kernels storing them hi + lo (``pipeline.prep``, ``pipeline.recompute``: the ws tables form), on one shape; checks
that every table both store is bitwise the same.

    python3 benchmarks/experiments/lo_tables_time.py [--shape B,T,H,HV] [--rep 50]

Prints ms for each stage and form (``triton.testing.do_bench``, each call with its output allocations) and the
ratios.
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
    plan = dataclasses.replace(bp.plan_for(b), **ONE_TERM_FIELDS, fused=True, prep_converts=False)
    b, _ = bp._scaled(b, plan)
    prep_cfg = plan.prep_config(False)
    intra, state, *rest = plan.recompute_configs()
    split = (intra, dataclasses.replace(state, prec=dataclasses.replace(state.prec, u="split")), *rest)
    lo = {"recompute_configs": lambda self: split,
          "prep_config": lambda self, saved: dataclasses.replace(prep_cfg, tinv_hi=False)}
    names = {"hi alone": (prep_cfg.name, state.name), "hi + lo": (lo["prep_config"](None, False).name, split[1].name)}
    out, ms = {}, {}
    for form, patch in (("hi alone", {}), ("hi + lo", lo)):
        with mock.patch.multiple(BackwardPlan, **patch) if patch else nullcontext():
            prep = lambda: bp.prep(b=b, plan=plan, saved=None)  # noqa: E731
            tables = prep()
            rec = lambda: bp.recompute(x=b.x, plan=plan, tables=tables, side=None)  # noqa: E731
            out[form] = (tables, rec())
            ms[form] = (triton.testing.do_bench(prep, warmup=5, rep=a.rep),
                        triton.testing.do_bench(rec, warmup=5, rep=a.rep))
    (t1, s1), (t2, s2) = out.values()
    same = all(torch.equal(getattr(t1, n), getattr(t2, n)) for n in ("Th", "Agh", "Agl", "Fb", "Lb")) and all(
        torch.equal(getattr(s1, n), getattr(s2, n)) for n in ("Sch", "Uh"))
    print(f"shape B{B} T{T} H{H} HV{HV}, {torch.cuda.get_device_name()}; every stored table bitwise equal: {same}")
    for form, (tp, tr) in ms.items():
        print(f"  {form:<9} prep {tp:7.3f} ms  recompute {tr:7.3f} ms   {names[form][0]}  {names[form][1]}")
    (p1, r1), (p2, r2) = ms.values()
    print(f"  ratio hi alone / hi + lo: prep {p1 / p2:.3f}, recompute {r1 / r2:.3f}")


if __name__ == "__main__":
    main()
