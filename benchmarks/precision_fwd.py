"""Accuracy of the forward at precisions of ``kernels.forward.precision.PRESETS``, on the CPU (the emulation).

    python benchmarks/precision_fwd.py [--T 2048] [--dists gauss-l2,qwen-gates,slow-decay,strong-decay,large-h0]
                                       [--precisions default,half,pu16] [--dtype bf16]

For each distribution (B1 H2 HV4 K = V = 128; an initial state where the distribution has one): o's rel_rmse against
fp64 (``reference.chunk_gated_delta_rule``) as a multiple of its rounding floor (the fp64 o rounded to the input
dtype), and the final state's rel_rmse, of the FLA-like bf16 scheme (``reference.emulated``) and of the emulated
forward (``kernels.forward.emulation.chunk_gated_delta_rule_at``) at each precision; a row marks where the state is
not bitwise the first precision's.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["rows", "main"]

DISTS = ("gauss-l2", "qwen-gates", "slow-decay", "strong-decay", "large-h0")


def rows(case, precisions) -> list:
    """[(name, o rel_rmse / floor, state rel_rmse, state bitwise the first precision's)] of ``case``: the FLA-like
    scheme, then the emulation at each of ``precisions`` (``PRESETS`` names); the last None where there is nothing
    to compare (the FLA-like scheme, the first precision)."""
    import torch

    from kernels.forward.emulation import chunk_gated_delta_rule_at
    from kernels.forward.precision import PRESETS
    from parity.metrics import compare
    from reference import chunk_gated_delta_rule as fp64_reference
    from reference.emulated import chunk_gated_delta_rule as fla_like
    from tests.kernel_support import call_args

    a, kw = call_args(case)
    kw["output_final_state"] = True
    o_ref, S_ref = fp64_reference(*a, **kw)
    floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
    err = lambda o, S: (compare(o, o_ref).rel_rmse / floor, compare(S, S_ref).rel_rmse)  # noqa: E731
    out = [("fla-like", *err(*fla_like(*a, **kw)), None)]
    first = None
    for name in precisions:
        o, S = chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS[name])
        out.append((name, *err(o, S), None if first is None else bool(torch.equal(S, first))))
        first = S if first is None else first
    return out


def main(argv=None):
    from cases.case import Case
    from cases.distributions import get_distribution
    from kernels.forward.precision import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--precisions", default="default,half,pu16")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    a = ap.parse_args(argv)
    names = a.precisions.split(",")
    bad = [n for n in names if n not in PRESETS]
    if bad:
        ap.error(f"unknown precisions {bad}; presets: {sorted(PRESETS)}")
    print(f"forward, o rel_rmse / its rounding floor and the final state's rel_rmse vs fp64 (CPU emulation), "
          f"B1 T{a.T} H2 HV4 K=V=128 {a.dtype}")
    for dist in a.dists.split(","):
        h0 = "fp32" if get_distribution(dist).needs_h0 else None
        print(f"{dist}{', h0' if h0 else ''}")
        for name, o, s, same in rows(Case(T=a.T, H=2, HV=4, dtype=a.dtype, dist=dist, h0_dtype=h0), names):
            tag = "  state bitwise the first's" if same else ""
            print(f"  {name:<9} o {o:.4f}x floor  state {s:.3e}{tag}", flush=True)


if __name__ == "__main__":
    main()
