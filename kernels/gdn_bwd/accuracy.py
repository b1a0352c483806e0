"""Accuracy study of the backward's chunk-table precision, on the CPU emulation (no GPU, seconds per case).

    python -m kernels.gdn_bwd.accuracy [--T 1024]

For each case, every gradient's rel_rmse against fp64 autograd (``reference.chunk``) for: the dtype's rounding
floor ``rel_rmse(ref.to(dtype), ref)``; the FLA-like baseline (autograd through ``reference.emulated``, FLA's
intermediate roundings); our kernels as built ("split": the inter and intra kernels read the chunk tables S, U,
dS', dY as hi + lo); "lean" (they read the hi terms alone: half the shared memory and 8 -> 3 products in the
inter kernel, 5 -> 2 of the intra kernel's value-dim products), the design the next inter / intra kernels can
pipeline over chunks; and "lean_sd" (lean, but the S o dS' row sums, a dg term, from hi + lo in a pass of their
own) (``kernels/gdn_bwd/README.md``).  Two more columns (``emulation.study``) ask how a backward with FLA's /
FlashQLA's single-bf16 operands would do: "bf16" (every operand split of the backward single, the lean tables, the
forward recomputed with the "bf16" preset: S and U single) and "bf16+sd" (the same, but the S o dS' row sums from
a split dS', as a kernel holding dS' in fp32 registers would form them: "lean_sd").
"""

from __future__ import annotations

import argparse
import time

from kernels.gdn_fwd import testing as tt

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def cases(T: int) -> dict:
    return {
        f"gauss_h0_T{T}": dict(B=1, T=T, H=2, HV=4, h0=1.0),
        f"g_zero_no_l2_T{T}": dict(B=1, T=T, H=2, HV=4, gate="zero", l2=False),
        f"g_small_h0_T{T}": dict(B=1, T=T, H=2, HV=4, gate="small", h0=1.0),
        f"g_near_-20_T{T // 2}": dict(B=1, T=T // 2, H=1, HV=2, gate="near_-20"),
        "varlen_1_63_64_65_h0_vfirst_fp16": dict(B=1, T=0, H=1, HV=2, lens=[1, 63, 64, 65, 300], h0=1.0, vf=True,
                                                 dt=__import__("torch").float16),
    }


def _truth(spec: dict):
    """``(xs, do, dht, kw, want, base)`` of one case (``tt.bwd_inputs`` arguments): its inputs, the fp64 autograd
    gradients (``reference.chunk``) and the FLA-like baseline's (autograd through ``reference.emulated``)."""
    import torch

    from reference.chunk import chunk_gated_delta_rule as ref
    from reference.emulated import chunk_gated_delta_rule as emu

    xs, do, dht, kw = tt.bwd_inputs(**spec)
    want = tt.autograd_grads(ref, xs, kw, do, dht, lambda x: x.double())
    base = tt.autograd_grads(emu, xs, kw, do, dht, lambda x: x if x.dtype != torch.float64 else x.float())
    return xs, do, dht, kw, want, base


def study(spec: dict) -> dict:
    """{gradient name: {"floor", "fla-like", "split", "lean", "lean_sd", "bf16", "bf16+sd"}} for one case
    (``tt.bwd_inputs`` arguments)."""
    from kernels.gdn_bwd.emulation import SPLITS, TABLES, chunk_gated_delta_rule_bwd
    from kernels.gdn_bwd.emulation import study as emu_study

    xs, do, dht, kw, want, base = _truth(spec)
    dt = xs[0].dtype
    out = {n: {"floor": tt.rel_rmse(r.to(dt), r), "fla-like": tt.rel_rmse(b, r)}
           for n, r, b in zip(NAMES, want, base)}
    for tables in TABLES:
        for n, a, r in zip(NAMES, chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, _tables=tables), want):
            out[n][tables] = tt.rel_rmse(a, r)
    for col, single, tables in (("bf16", SPLITS, "lean"), ("bf16+sd", tuple(x for x in SPLITS if x != "dS"), "lean_sd")):
        with emu_study(single, fwd_preset="bf16"):
            got = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, _tables=tables)
        for n, a, r in zip(NAMES, got, want):
            out[n][col] = tt.rel_rmse(a, r)
    return out


SINGLES = {  # --singles: today's split kernels with only these operand splits single (emulation.study)
    "split": (), "intra": ("intra",), "intra+T": ("intra", "T"),   # intra: build._INTRA_SINGLE's form (4 fewer wgmma)
    "dh": ("T", "dU", "dX"),     # dh's single form (Tinv, dU, F0 dX; build._DH_SINGLE): 6 instead of 9 wgmma a chunk
    "intra+T+P+dU+dO+dX": ("intra", "T", "P", "dU", "dO", "dX"),
}


def singles(T: int, log=print) -> dict:
    """{variant: (worst ratio ours / FLA-like, where)} over ``cases(T)`` and every gradient, for the ``SINGLES``
    variants of the split kernels (session 7's table in ``README.md``): every operand split but the named ones
    (dh's single form, the API's since session 13, is switched off here: it is the variant "dh"; so are the intra
    terms' single operands, the API's since session 14: the variant "intra")."""
    from kernels.gdn_bwd import build
    from kernels.gdn_bwd.emulation import chunk_gated_delta_rule_bwd, study

    saved = build._DH_SINGLE, build._INTRA_SINGLE
    build._DH_SINGLE = build._INTRA_SINGLE = False
    try:
        return _singles(T, log, chunk_gated_delta_rule_bwd, study)
    finally:
        build._DH_SINGLE, build._INTRA_SINGLE = saved


def _singles(T, log, chunk_gated_delta_rule_bwd, study) -> dict:
    worst = {v: (0.0, "") for v in SINGLES}
    for name, spec in cases(T).items():
        xs, do, dht, kw, want, base = _truth(spec)
        for v, single in SINGLES.items():
            with study(single):
                got = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, _tables="split")
            parts = []
            for n, a, r, b in zip(NAMES, got, want, base):
                if a is None:
                    continue
                ratio = tt.rel_rmse(a, r) / tt.rel_rmse(b, r)
                parts.append(f"{n} {ratio:.2f}")
                if ratio > worst[v][0]:
                    worst[v] = (ratio, f"{name} {n}")
            log(f"{name:<36} {v:<20} " + "  ".join(parts))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--singles", action="store_true",
                    help="ratios ours / FLA-like of the split kernels with some operand splits single (SINGLES)")
    args = ap.parse_args(argv)
    if args.singles:
        for v, (r, where) in singles(args.T).items():
            print(f"worst {v:<20} {r:.2f}  ({where})")
        return 0
    cols = ("floor", "fla-like", "split", "lean", "lean_sd", "bf16", "bf16+sd")
    print("| case | grad | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for name, spec in cases(args.T).items():
        t = time.time()
        for n, row in study(spec).items():
            print(f"| {name} | {n} | " + " | ".join(f"{row[c]:.2e}" for c in cols) + " |", flush=True)
        print(f"<!-- {name}: {time.time() - t:.1f} s -->")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
