"""Accuracy of the backward at each operand form of ``kernels.backward.emulation.OPERANDS``, on the CPU.

    python benchmarks/precision_bwd.py [--T 1024] [--dists raw-qk-l2,strong-decay,qwen-gates,slow-decay]
                                       [--operands split,bf16,fp16] [--dtype bf16]

For each distribution, without and with an initial state (B1 H2 HV4 K = V = 128): the rel_rmse against fp64
(``parity.refs.compute``) of every gradient of the FLA-like baseline (``parity.backends.BASELINE``) and of the
emulated backward at each operand form: "split" (the kernels' forms), "bf16" (every wgmma operand and table one
input-dtype term) and "fp16" (one fp16 term under a power of two per matrix).  A row marks the gradients where it is
worse than the baseline, and under strong decay a dg past its rounding floor (the emulation tests' rule).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["rows", "main"]

DISTS = ("raw-qk-l2", "strong-decay", "qwen-gates", "slow-decay")


def rows(case, operands) -> list:
    """[(name, {gradient: rel_rmse}, [gradients that break the rule])] of ``case``: the baseline, then the
    emulation at each of ``operands``."""
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd
    from parity.metrics import compare
    from tests import kernel_support as tt

    xs, kw, do, dht = tt.bwd_args(case)
    want, base = tt.fp64_grads(case), tt.baseline_grads(case)
    names = tt.GRAD_NAMES
    err = lambda got: {n: compare(a, r).rel_rmse for n, a, r in zip(names, got, want) if r is not None}  # noqa: E731
    eb = err(base)
    floor = compare(want[3].to(xs[0].dtype), want[3]).rel_rmse
    out = [("fla-like", eb, [])]
    for op in operands:
        e = err(chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands=op))
        bad = [n for n in e if (e[n] > floor if n == "dg" and case.dist == "strong-decay" else e[n] > eb[n])]
        out.append((op, e, bad))
    return out


def main(argv=None):
    from cases.case import Case
    from kernels.backward.emulation import OPERANDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--operands", default=",".join(OPERANDS))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    a = ap.parse_args(argv)
    ops = a.operands.split(",")
    bad_ops = [o for o in ops if o not in OPERANDS]
    if bad_ops:
        ap.error(f"unknown operand forms {bad_ops}; forms: {OPERANDS}")
    print(f"backward gradients, rel_rmse vs fp64 (CPU emulation), B1 T{a.T} H2 HV4 K=V=128 {a.dtype}")
    for dist in a.dists.split(","):
        for h0 in (None, "fp32"):
            case = Case(T=a.T, H=2, HV=4, dtype=a.dtype, dist=dist, h0_dtype=h0, grad=True)
            print(f"{dist}, {'h0' if h0 else 'no h0'}")
            for name, e, bad in rows(case, ops):
                cells = "  ".join(f"{n} {v:.2e}" for n, v in e.items())
                print(f"  {name:<9}{cells}" + (f"   worse: {','.join(bad)}" if bad else ""), flush=True)


if __name__ == "__main__":
    main()
