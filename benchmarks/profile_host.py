"""Where a call's host time goes: torch.profiler over a few calls of our TileLang GDN (or FLA's, or FlashQLA's
forward) at one of the forward benchmark's shapes, with the GPU time of the same calls for comparison.

    python3 benchmarks/profile_host.py [--shape B1_T65536_H2_HV4] [--direction fwd|fwdbwd|bwd]
                                       [--impl ours|fla|flashqla] [--ab COL] [--calls 20] [--rows 25] [--python 25]

``--direction``: ``fwd`` the public call without gradients (default); ``fwdbwd`` one forward + backward through
autograd (``kernels.autograd.apply`` and ``torch.autograd.backward``, the leaves' gradients reset before each call:
the ``ours`` column of ``benchmarks/bench_kernels_bwd.py``); ``bwd`` the backward pipeline alone on the forward's
saved tables (that benchmark's "backward alone"; ours only).  ``--ab COL`` (ours, ``fwdbwd`` or ``bwd``): the
plans of that benchmark's A/B column COL (``bench_kernels_bwd.AB``) instead of the dispatched ones.  Prints the
host time per call (enqueue, no sync; for ``fwdbwd`` also with autograd's backward on the calling thread instead of
its device thread) and the GPU time per
call (CUDA events over the same calls, synchronised), the number of kernel launches per call, each kernel's GPU
time per call (where the GPU time goes, comparable across ``--impl``: FlashQLA's forward alone), for our ``fwdbwd``
one call's host time split on either thread (``thread_split``: forward, hand-off, the backward's body by pipeline
stage, return; in the forward and the body, the time inside kernel launches and allocations), and the profiler's
table of the operators with the most self CPU time; with ``--python N``, also cProfile's N Python functions with
the most own time over the same number of calls (where the host time goes between the operators).  The profiler
and cProfile run autograd's backward on the calling thread, so that its Python is seen.  When the host time per
call reaches the GPU time, the GPU waits for the host: fewer launches or less Python per call is then what makes
the call faster.  CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_kernels_fwd import fla_triton, flash_qla  # noqa: E402
from benchmarks.inputs import SHAPES, make  # noqa: E402

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B1_T65536_H2_HV4", choices=list(SHAPES))
    ap.add_argument("--direction", default="fwd", choices=["fwd", "fwdbwd", "bwd"])
    ap.add_argument("--impl", default="ours", choices=["ours", "fla", "flashqla"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--python", type=int, default=0, metavar="N", help="cProfile's N functions with most own time")
    ap.add_argument("--ab", default="", metavar="COL", help="the plans of bench_kernels_bwd.py's A/B column COL")
    args = ap.parse_args(argv)
    if args.impl == "fla" and args.direction == "bwd":
        ap.error("--direction bwd times our backward pipeline alone: ours only")
    if args.ab:
        from benchmarks.bench_kernels_bwd import AB
        if args.ab not in AB:
            ap.error(f"--ab takes {', '.join(AB)}; got {args.ab!r}")
        if args.impl != "ours" or args.direction == "fwd":
            ap.error("--ab changes our forward + backward or backward alone (--impl ours, --direction fwdbwd or bwd)")
    if args.impl == "flashqla" and args.direction != "fwd":
        ap.error("--impl flashqla profiles FlashQLA's forward (--direction fwd)")
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    call, parts, why = _call(args, torch.device("cuda"))
    if call is None:
        print(why)
        return 2

    # autograd's backward on this thread (a factory: the context sets the mode when constructed)
    def here():
        return torch.autograd.set_multithreading_enabled(False)

    def host_ms(ctx) -> float:
        torch.cuda.synchronize()
        with ctx():
            t = time.perf_counter()
            for _ in range(args.calls):
                call()
            host = (time.perf_counter() - t) / args.calls
        torch.cuda.synchronize()
        return host * 1e3

    for _ in range(3):                       # compile, autotune, table caches
        call()
    host = host_ms(contextlib.nullcontext)
    host_here = host_ms(here) if args.direction == "fwdbwd" else None
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(args.calls):
        call()
    e1.record()
    torch.cuda.synchronize()
    wall = e0.elapsed_time(e1) / args.calls
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, here():
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in LAUNCH_APIS)
    gpu_busy = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    what = {"fwd": "forward", "fwdbwd": "forward + backward", "bwd": "backward alone"}[args.direction]
    print(f"{args.impl} {what} at {args.shape}: host {host:.3f} ms per call (enqueue)"
          + (f", {host_here:.3f} with the backward on the calling thread" if host_here is not None else "")
          + f", events {wall:.3f} ms per call back to back, kernels busy {gpu_busy / 1e3 / args.calls:.3f} ms per "
          f"call, {launches / args.calls:.1f} kernel launches per call")
    if parts is not None:
        for on_thread in (False, True):
            (f, to, body, back), stages, inside = thread_split(*parts, args.calls, on_thread)
            print(f"  one call, median ms, backward on {'the calling' if on_thread else 'its device'} thread: forward "
                  f"{f:.3f}, to the backward's start {to:.3f}, its body {body:.3f}, back to the caller {back:.3f}; "
                  "the body's stages: " + ", ".join(f"{n} {ms:.3f}" for n, ms in stages.items()))
            for p, d in inside.items():
                print(f"    {p}: {d['launches']:.0f} kernel launches {d['launch']:.3f} ms, {d['allocs']:.0f} "
                      f"allocations {d['alloc']:.3f} ms")
    print(f"GPU time per call by kernel, ms (the {args.rows} largest):")
    for name, ms in kernel_times(ev, args.calls)[:args.rows]:
        print(f"  {ms:8.3f}  {name}")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.python:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        with here():
            pr.enable()
            for _ in range(args.calls):
                call()
            pr.disable()
        torch.cuda.synchronize()
        print(f"cProfile over {args.calls} calls (own time, then with callees; profiling adds its own overhead):")
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(args.python)
    return 0


def kernel_times(events, calls: int) -> list:
    """[(kernel name, GPU ms per call)], largest first, from the profiler's ``key_averages()`` over ``calls``
    calls: the CUDA entries' own GPU time."""
    out = [(e.key, e.self_device_time_total / 1e3 / calls) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(out, key=lambda x: -x[1])


def _call(args, dev):
    """(one call of ``args.direction`` on fixed inputs, parts, None) or (None, None, why it cannot run); parts: for
    ours forward + backward (the forward alone, the backward's output gradients) for ``thread_split``, else None."""
    B, T, H, HV, lens = SHAPES[args.shape]
    if args.impl == "fla":
        fn, why = fla_triton()
        if fn is None:
            return None, None, f"FLA's Triton path cannot run here: {why}"
    if args.impl == "flashqla":
        fn, why = flash_qla()
        if fn is None:
            return None, None, f"FlashQLA cannot run here: {why}"
    if args.direction == "fwd":
        q, k, v, g, beta, cu = make(B, T, H, HV, lens, dev)
        if args.impl == "ours":
            import kernels
            fn = kernels.chunk_gated_delta_rule

        def fwd():
            with torch.no_grad():
                return fn(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
        return fwd, None, None
    from benchmarks.bench_kernels_bwd import backward_alone_args, backward_context
    from benchmarks.bench_kernels_bwd import make as make_bwd
    a, kw, do, dht = make_bwd(B, T, H, HV, lens, dev)
    col = getattr(args, "ab", "") or "ours"
    if args.direction == "bwd":
        side = backward_alone_args(col, a, kw, do, dht)
        return (lambda: side["fn"](*a, do, dht, **side["kw"])), None, None
    if args.impl == "ours":
        import functools

        from benchmarks.bench_kernels_bwd import alter
        from kernels.autograd import apply as fn
        fn = fn if col == "ours" else functools.partial(fn, alter=alter(col))
    leaves = [x.detach().requires_grad_() for x in a]

    def forward():
        for x in leaves:
            x.grad = None
        return fn(*leaves, **kw)

    def fwdbwd():
        with backward_context("FLA" if args.impl == "fla" else "ours"):
            torch.autograd.backward(forward(), (do, dht))
    return fwdbwd, ((forward, (do, dht)) if args.impl == "ours" else None), None


# the torch allocation functions the pipelines call, timed by ``thread_split``
ALLOCATORS = ("empty", "empty_like", "zeros", "zeros_like")
COUNTS = {"launch": "launches", "alloc": "allocs"}      # ``thread_split``'s times and their counts


def thread_split(forward, grads, calls: int, on_thread: bool) -> tuple:
    """(parts, stages, inside) of one forward + backward of ours, median ms over ``calls`` calls: ``parts`` the
    forward (``forward()``: the autograd Function's outputs), from ``torch.autograd.backward`` to the Function's
    backward starting, its body, and from its end to ``torch.autograd.backward`` returning; ``stages`` the body's host
    time per stage of the backward pipeline (``memory_plan.STAGES``' names); ``inside`` for the forward and the body
    the host time (ms) and count of the kernel launches (calls of what ``kernels.build.get_kernel`` returns) and of
    the allocations (torch's ``ALLOCATORS``) within them, ``{"forward": {"launch", "launches", "alloc", "allocs"},
    "body": ...}``; ``on_thread``: autograd's backward on the calling thread, else on its device thread (the default
    for CUDA tensors).  Everything it replaces is put back, also after a failure."""
    import statistics

    import kernels.backward.pipeline as bpipe
    import kernels.build as build
    from benchmarks.memory_plan import STAGES
    from kernels.autograd import ChunkGatedDeltaRuleFunction as F
    body, rows, spent = [], [], {}
    inner, raw = F.backward, F.__dict__["backward"]        # raw: the staticmethod itself, put back as it was
    names = STAGES[bpipe.__name__]
    stage_fns = {n: getattr(bpipe, n) for n in names}
    get_kernel = build.get_kernel
    allocators = {n: getattr(torch, n) for n in ALLOCATORS}
    phase = ["forward"]
    acc = {p: dict.fromkeys(("launch", "launches", "alloc", "allocs"), 0.0) for p in ("forward", "body")}

    def timed_call(fn, record):
        """``fn`` with the host time of each call handed to ``record``."""
        def run(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            record(time.perf_counter() - t)
            return out
        return run

    def counted(kind, fn):
        def record(dt):
            into = acc.get(phase[0])
            if into is not None:
                into[kind] += dt
                into[COUNTS[kind]] += 1
        return timed_call(fn, record)

    def timed(ctx, *g):
        phase[0] = "body"
        t = time.perf_counter()
        try:
            out = inner(ctx, *g)
        finally:
            body.append((t, time.perf_counter()))
            phase[0] = "after"
        return out

    def stage_timed(name, fn):
        def record(dt):
            spent[name] = spent.get(name, 0.0) + dt
        return timed_call(fn, record)
    per_stage = {n: [] for n in names}
    per_inside = {(p, k): [] for p in acc for k in acc[p]}
    try:
        F.backward = staticmethod(timed)
        for n, fn in stage_fns.items():
            setattr(bpipe, n, stage_timed(n, fn))
        build.get_kernel = lambda cfg: counted("launch", get_kernel(cfg))
        for n, fn in allocators.items():
            setattr(torch, n, counted("alloc", fn))
        for _ in range(calls):
            body.clear()
            spent.clear()
            for p in acc:
                acc[p].update(dict.fromkeys(acc[p], 0.0))
            phase[0] = "forward"
            ta = time.perf_counter()
            outs = forward()
            tb = time.perf_counter()
            phase[0] = "hand-off"
            with torch.autograd.set_multithreading_enabled(not on_thread):
                torch.autograd.backward(outs, grads)
            te = time.perf_counter()
            (tc, td), = body
            rows.append((tb - ta, tc - tb, td - tc, te - td))
            for n in names:
                per_stage[n].append(spent.get(n, 0.0))
            for (p, k), v in per_inside.items():
                v.append(acc[p][k])
    finally:
        F.backward = raw
        for n, fn in stage_fns.items():
            setattr(bpipe, n, fn)
        build.get_kernel = get_kernel
        for n, fn in allocators.items():
            setattr(torch, n, fn)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    inside = {p: {k: statistics.median(per_inside[p, k]) * (1e3 if k in COUNTS else 1) for k in acc[p]}
              for p in acc}
    return (tuple(1e3 * statistics.median(c) for c in zip(*rows)),
            {n: 1e3 * statistics.median(v) for n, v in per_stage.items()}, inside)

if __name__ == "__main__":
    sys.exit(main())
