"""Forward benchmark of our TileLang GDN kernels vs FLA Triton vs FlashQLA (H200 / sm_90).

    python benchmarks/bench_kernels_fwd.py [--shapes NAME,...] [--bv 64,32] [--rep 200]

Forward with the final state, bf16 q/k/v, fp32 g/beta, no initial state; inputs are
random (q ~ N(0,1), k L2-normalised N(0,1), v ~ N(0,1), g = logsigmoid(N(0,1)),
beta ~ U(0,1)).  Times are ``triton.testing.do_bench`` medians (ms) measured in this
one run.  Columns:

* ``ours``      - ``kernels.chunk_gated_delta_rule`` (the dispatched config, BV=64);
* ``ours BV=x`` - the recurrent kernel with another value-block width (``--bv``; tuning info);
* ``ours intra`` - the intra-chunk kernel alone (``intra_stage``), to split our time between the
                  parallel intra kernel and the sequential recurrent kernel (tuning info);
* ``FLA``       - ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with FLA_FLASH_QLA=0
                  FLA_TILELANG=0 (its Triton kernels);
* ``FlashQLA``  - ``flash_qla.chunk_gated_delta_rule`` (imported lazily; the column is skipped
                  with the reason when it cannot be imported or fails).

TFLOP/s use one algorithmic count for everyone (per 64-token chunk and value head, K = V = D):
KK^T + QK^T + Tinv K + Tinv V + P U (2 C^2 (3 D + 2 D)) and W S, Q S, K^T U (3 x 2 C D^2), i.e.
~11.5 MFLOP per chunk-head at D = 128; our kernels execute ~2.2x that (two-term splits).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as Fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = {
    # name: (B, T, H, HV, varlen lengths or None)
    "B1_T32768_H16_HV32": (1, 32768, 16, 32, None),
    "B8_T4096_H16_HV32": (8, 4096, 16, 32, None),
    "B1_T8192_H4_HV8": (1, 8192, 4, 8, None),
    "B1_T65536_H2_HV4": (1, 65536, 2, 4, None),
    "varlen8_T32768_H16_HV32": (1, 32768, 16, 32, [1000, 7000, 2500, 6000, 300, 9000, 4000, 2968]),
}
D = 128
C = 64


def flops(B, T, HV, lens):
    n_chunks = sum(-(-L // C) for L in lens) if lens else B * -(-T // C)
    per = 2 * C * C * (3 * D + 2 * D) + 3 * 2 * C * D * D
    return n_chunks * HV * per


def make(B, T, H, HV, lens, dev, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T, H, D, device=dev, generator=gen).to(torch.bfloat16)
    k = Fn.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, D, device=dev, generator=gen).to(torch.bfloat16)
    g = Fn.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen))
    beta = torch.rand(B, T, HV, device=dev, generator=gen)
    cu = None
    if lens:
        assert sum(lens) == T and B == 1
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=dev)
    return q, k, v, g, beta, cu


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--bv", default="32", help="extra BV widths of our recurrent kernel to time ('' for none)")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    from triton.testing import do_bench

    import kernels
    from kernels.gdn_fwd.api import chunk_gated_delta_rule as ours_impl
    from kernels.gdn_fwd.api import intra_stage
    from kernels.gdn_fwd import testing as tt

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    fla = tt.fla_triton_fn()
    fqla, fqla_reason = tt.flash_qla_fn()
    extra_bv = [int(x) for x in args.bv.split(",") if x]

    cols = ["ours"] + [f"ours BV={b}" for b in extra_bv] + ["ours intra", "FLA", "FlashQLA"]
    skipped = {}
    if fla is None:
        skipped["FLA"] = "fla not importable"
    if fqla is None:
        skipped["FlashQLA"] = fqla_reason
    results = {}
    for name in [s for s in args.shapes.split(",") if s]:
        B, T, H, HV, lens = SHAPES[name]
        q, k, v, g, beta, cu = make(B, T, H, HV, lens, dev)
        fns = {"ours": lambda: kernels.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                               cu_seqlens=cu)}
        for b in extra_bv:
            fns[f"ours BV={b}"] = (lambda b=b: ours_impl(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                                         _block_v=b))
        fns["ours intra"] = lambda: intra_stage(q, k, g, beta, cu_seqlens=cu)
        if fla is not None:
            fns["FLA"] = lambda: fla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
        if fqla is not None:
            fns["FlashQLA"] = lambda: fqla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
        row = {}
        for col, fn in fns.items():
            t0 = time.time()
            try:
                with torch.no_grad():
                    fn()  # compile / autotune outside the timing
                    torch.cuda.synchronize()
                    ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                row[col] = ms
            except Exception as e:
                row[col] = None
                skipped.setdefault(col, f"{type(e).__name__}: {str(e)[:160]}")
            print(f"  {name:<26} {col:<12} {('%.3f ms' % row[col]) if row[col] else 'failed':>12} "
                  f"(setup+bench {time.time() - t0:.1f} s)", flush=True)
        results[name] = (row, flops(B, T, HV, lens))
        del q, k, v, g, beta, cu
        torch.cuda.empty_cache()

    print("\n== forward with final state, bf16, median ms (TFLOP/s, algorithmic count) ==")
    hdr = f"{'shape':<26}" + "".join(f"{c:>22}" for c in cols) + f"{'FLA/ours':>10}{'FQLA/ours':>10}"
    print(hdr)
    for name, (row, fl) in results.items():
        line = f"{name:<26}"
        for c in cols:
            ms = row.get(c)
            line += f"{('%.3f (%.0f)' % (ms, fl / ms / 1e9)) if ms else '-':>22}"
        o = row.get("ours")
        r1 = row.get("FLA") / o if o and row.get("FLA") else None
        r2 = row.get("FlashQLA") / o if o and row.get("FlashQLA") else None
        line += f"{('%.2fx' % r1) if r1 else '-':>10}{('%.2fx' % r2) if r2 else '-':>10}"
        print(line)
    print("(ratios > 1: ours faster)")
    for c, why in skipped.items():
        print(f"column {c} skipped/failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
