"""Time the fused plan's inputs scaling and prep (``pipeline.scaled_prep``) in its dispatched form, prep converting
the inputs (``BackwardPlan.prep_converts``: ``gdn_bwd_amax``, then prep's converting form), against the conversion
pass (``gdn_bwd_amax``, ``gdn_bwd_convert``, prep on the copies), on one dense shape.

    python3 benchmarks/experiments/prep_convert_time.py [--shape B,T,H,HV] [--rep 200] [--rounds 3]

Prints ms for each form and round (``triton.testing.do_bench``, each call with its output allocations) and the
ratio of the medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,32")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: this script times GPU kernels")
        return 2
    import triton

    from fused_bwd_check import make_inputs
    from kernels.backward import pipeline as bp

    B, T, H, HV = (int(s) for s in a.shape.split(","))
    q, k, v, g, beta, do, _, _, _ = make_inputs(B, T, H, HV, False, False, "cuda")
    b = bp.prepare_backward(q, k, v, g, beta, do, None, None, None, True, False, None)
    plan = bp.with_fused_segments(bp.plan_for(b), b)
    if not plan.converts_in_prep:
        raise SystemExit(f"the dispatched plan at {a.shape} does not convert in prep: {plan}")
    forms = {"prep converts": plan, "convert pass": dataclasses.replace(plan, prep_converts=False)}
    ms = {name: [] for name in forms}
    for r in range(a.rounds):
        for name, p in forms.items():
            ms[name].append(triton.testing.do_bench(lambda p=p: bp.scaled_prep(b=b, plan=p, saved=None), warmup=10,
                                                    rep=a.rep))
            print(f"round {r}  {name:<14} {ms[name][-1]:.3f} ms")
    med = {name: statistics.median(v) for name, v in ms.items()}
    print(f"B{B} T{T} H{H} HV{HV}: prep converts {med['prep converts']:.3f} ms, convert pass "
          f"{med['convert pass']:.3f} ms, ratio {med['prep converts'] / med['convert pass']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
