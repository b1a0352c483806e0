"""Where a forward call's host time goes: torch.profiler over a few calls of our TileLang forward (or FLA's)
at one of the forward benchmark's shapes, with the GPU time of the same calls for comparison.

    python3 benchmarks/profile_host.py [--shape B1_T65536_H2_HV4] [--impl ours|fla] [--calls 20] [--rows 25]
                                       [--python 25]

Prints the host time per call (enqueue, no sync) and the GPU time per call (CUDA events over the same calls,
synchronised), the number of kernel launches per call, and the profiler's table of the operators with the most
self CPU time; with ``--python N``, also cProfile's N Python functions with the most own time over the same
number of calls (where the host time goes between the operators).  When the host time per call reaches the GPU time, the GPU waits for the host: fewer launches or
less Python per call is then what makes the call faster.  CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_kernels_fwd import fla_triton  # noqa: E402
from benchmarks.inputs import SHAPES, make  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B1_T65536_H2_HV4", choices=list(SHAPES))
    ap.add_argument("--impl", default="ours", choices=["ours", "fla"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--python", type=int, default=0, metavar="N", help="cProfile's N functions with most own time")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    dev = torch.device("cuda")
    B, T, H, HV, lens = SHAPES[args.shape]
    q, k, v, g, beta, cu = make(B, T, H, HV, lens, dev)
    if args.impl == "ours":
        import kernels
        fn = kernels.chunk_gated_delta_rule
    else:
        fn, why = fla_triton()
        if fn is None:
            print(f"FLA's Triton path cannot run here: {why}")
            return 2

    def call():
        return fn(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)

    with torch.no_grad():
        for _ in range(3):                       # compile, autotune, table caches
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - t) / args.calls
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.calls):
            call()
        e1.record()
        torch.cuda.synchronize()
        wall = e0.elapsed_time(e1) / args.calls
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                    "cudaLaunchKernelExC"))
    gpu_busy = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{args.impl} forward at {args.shape}: host {host * 1e3:.3f} ms per call (enqueue), "
          f"events {wall:.3f} ms per call back to back, kernels busy {gpu_busy / 1e3 / args.calls:.3f} ms per call, "
          f"{launches / args.calls:.1f} kernel launches per call")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.python:
        import cProfile
        import pstats
        with torch.no_grad():
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.calls):
                call()
            pr.disable()
            torch.cuda.synchronize()
        print(f"cProfile over {args.calls} calls (own time, then with callees; profiling adds its own overhead):")
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
