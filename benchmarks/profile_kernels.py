"""One forward + backward call of our TileLang GDN inside an NVTX range, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "gdn-profile/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --csv --page details \
        python3 benchmarks/profile_kernels.py [--shape B1_T32768_H16_HV32] [--fwd-only] \
        [--ab ours-no-cluster] [--impl fla-triton] > ncu.csv
    python3 scripts/ncu_summary.py ncu.csv          # one line per kernel: time, throughputs, occupancy, stalls

(``scripts/gpu_steps.sh profile`` runs both.)  Inputs as ``benchmarks/bench_kernels_bwd.py`` (bf16, fp32 gates,
final state, ``do`` and ``dht`` random) at one of the forward benchmark's shapes.  A first call outside the range
compiles and warms up, so only the second call's kernels are profiled.  ``--dry-run``: CPU plumbing check with the
torch emulations and a 256x smaller shape, no NVTX.  ``--ab COL``: both calls with the plans of the benchmark's
A/B column ``COL`` (``bench_kernels_bwd.AB``), e.g. ``ours-no-cluster``.  ``--impl
fla-triton``: FLA's chunk_gated_delta_rule on its Triton kernels instead (forward with FLA_FLASH_QLA=0,
FLA_TILELANG=0; backward in the benchmark's FLA context), for a per-kernel comparison at the same shape (GPU only).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import contextlib  # noqa: E402

from benchmarks.bench_kernels_bwd import AB, SHAPES, alter, backward_context, make  # noqa: E402

RANGE = "gdn-profile"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B1_T32768_H16_HV32", choices=list(SHAPES))
    ap.add_argument("--fwd-only", action="store_true", help="profile the forward alone")
    ap.add_argument("--ab", default=None, choices=list(AB),
                    help="run with this A/B column's plans (benchmarks/bench_kernels_bwd.py's AB)")
    ap.add_argument("--impl", default="ours", choices=["ours", "fla-triton"],
                    help="whose kernels: ours (TileLang) or FLA's Triton ones (GPU only)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.impl != "ours" and (args.dry_run or args.ab):
        ap.error("--impl fla-triton runs FLA's kernels on a GPU: no --dry-run or --ab with it")
    return _profile(args)


def _profile(args) -> int:
    from kernels.autograd import apply as ours

    B, T, H, HV, lens = SHAPES[args.shape]
    impl = "tilelang"
    if args.dry_run:
        dev = torch.device("cpu")
        lens = [max(1, x // 256) for x in lens] if lens else None
        T, impl = (sum(lens) if lens else T // 256), "emulation"
    elif not torch.cuda.is_available():
        print("no CUDA device (use --dry-run on a CPU)")
        return 2
    else:
        dev = torch.device("cuda")
    a, kw, do, dht = make(B, T, H, HV, lens, dev)
    leaves = [x.detach().requires_grad_() for x in a]

    if args.impl == "fla-triton":
        from benchmarks.bench_kernels_fwd import fla_triton
        fla, why = fla_triton()
        if fla is None:
            print(f"FLA's Triton path cannot run here: {why}")
            return 2
        fn, ctx = fla, lambda: backward_context("FLA")
    else:
        fn = lambda *x, **k: ours(*x, **k, impl=impl, alter=alter(args.ab) if args.ab else None)    # noqa: E731
        ctx = contextlib.nullcontext

    def call():
        with ctx():
            return one_call(fn, leaves, kw, do, dht, args.fwd_only)

    call()                                  # compile and warm up, outside the range
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(RANGE)
    for x in leaves:
        x.grad = None
    o = call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    grads = [x.grad for x in leaves] if not args.fwd_only else []
    bad = sum(int((~torch.isfinite(t.float())).sum()) for t in [o, *grads] if t is not None)
    ab = (f", A/B column {args.ab}" if args.ab else "") + (f", {args.impl}" if args.impl != "ours" else "")
    print(f"profiled {'forward' if args.fwd_only else 'forward + backward'} at {args.shape} "
          f"(B={B} T={T} H={H} HV={HV}{' varlen' if lens else ''}) on {dev.type}{ab}; non-finite values: {bad}",
          file=sys.stderr)
    return 0 if bad == 0 else 1


def one_call(fn, leaves, kw, do, dht, fwd_only: bool):
    """One forward (+ backward, on the calling thread) of ``fn`` on ``leaves``; returns o."""
    o, ht = fn(*leaves, **kw)
    if not fwd_only:
        # autograd runs a CUDA backward on its own device thread, outside this thread's NVTX range (ncu then
        # profiled the forward alone): run it on this thread
        with torch.autograd.set_multithreading_enabled(False):
            torch.autograd.backward((o, ht), (do, dht))
    return o


if __name__ == "__main__":
    sys.exit(main())
