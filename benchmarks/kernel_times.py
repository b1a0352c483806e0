"""GPU time per kernel of one forward (+ backward) call, for ours, FlashQLA and FLA's Triton path side by side.

    python3 benchmarks/kernel_times.py [--shape B1_T32768_H16_HV32] [--impls ours,FlashQLA,FLA] [--fwd-only]
        [--calls 5] [--gates logsigmoid|qwen] [--spans]

``--impls`` also takes the A/B columns of ``benchmarks/bench_kernels_bwd.py`` (``AB``: ours with other plan
values, e.g. ``ours,ours-convert-pass``), so that two forms of ours are timed kernel by kernel in one run.

Inputs as ``benchmarks/bench_kernels_bwd.py``'s (bf16, fp32 gates, final state stored, ``do`` and ``dht`` random).
Each implementation runs twice outside the profile (compilation, autotuning), then ``--calls`` calls under
``torch.profiler``; the time of every event on the GPU (kernels, and copies or fills) is summed per name (template
arguments dropped) and divided by the calls.  Prints one table per implementation (ms a call, launches a call,
share of the sum) and a last line of the sums.  ``--spans``: for ours and its A/B columns, also the MiB each kernel's
tensor arguments span in one more call (``launch_spans``) and the rate that is at its time (an estimate: re-reads are
missed, untouched elements counted).  Each call is ``profile_kernels.one_call`` (the backward on the
calling thread).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_kernels_bwd import AB, SHAPES, alter, backward_context, make  # noqa: E402
from benchmarks.inputs import GATES  # noqa: E402

IMPLS = ("ours", "FlashQLA", "FLA")


def kernel_name(raw: str) -> str:
    """``raw`` (a profiler event name) without template arguments, argument lists and a ``void`` prefix."""
    name = re.sub(r"^void\s+", "", raw)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or raw


def implementation(name: str):
    """(fn, context factory, None) of implementation ``name`` (one of ``IMPLS`` or an A/B column of ``AB``), or
    (None, None, why it cannot run)."""
    if name == "ours" or name in AB:
        from kernels.autograd import apply
        f = None if name == "ours" else alter(name)
        return (lambda *a, **k: apply(*a, **k, impl="tilelang", alter=f)), contextlib.nullcontext, None
    from benchmarks.bench_kernels_fwd import fla_triton, flash_qla
    fn, why = flash_qla() if name == "FlashQLA" else fla_triton()
    return fn, (lambda: backward_context(name)), why


def caller(fn, ctx, leaves, kw, do, dht, fwd_only: bool):
    """One call of ``fn`` (``profile_kernels.one_call`` in ``ctx``, the leaves' gradients reset) as a function."""
    from benchmarks.profile_kernels import one_call

    def call():
        for x in leaves:
            x.grad = None
        with ctx():
            one_call(fn, leaves, kw, do, dht, fwd_only)
    return call


def kernel_symbol(source: str) -> str | None:
    """The name of the first ``__global__`` function of a CUDA ``source`` (None: there is none)."""
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source)
    return m.group(1) if m else None


def launch_spans(call) -> dict:
    """{kernel name: MiB a call} that one ``call``'s launches of our TileLang kernels (``kernels.build.get_kernel``)
    span by their tensor arguments (``memory_plan.span_bytes``, summed over launches), keyed as the profiler names
    them (the kernel's ``__global__`` symbol)."""
    from unittest import mock

    import kernels.build as build
    from benchmarks.memory_plan import span_bytes

    spans = defaultdict(int)
    get = build.get_kernel

    def spying(cfg):
        kern = get(cfg)
        source = getattr(kern, "get_kernel_source", None)        # (a stand-in kernel has none: its config's name)
        name = (kernel_symbol(source()) if source else None) or cfg.name

        def run(*args, **kwargs):
            spans[name] += span_bytes([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
            return kern(*args, **kwargs)
        return run

    with mock.patch.object(build, "get_kernel", spying):
        call()
    return {k: n / 2 ** 20 for k, n in spans.items()}


def per_kernel(call, calls: int) -> dict:
    """{kernel name: (ms a call, launches a call)} of ``calls`` calls of ``call`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    us, n = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = kernel_name(e.name)
            us[k] += e.device_time
            n[k] += 1
    return {k: (us[k] / 1000 / calls, n[k] / calls) for k in us}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="B1_T32768_H16_HV32", choices=list(SHAPES))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--gates", default="logsigmoid", choices=GATES)
    ap.add_argument("--rows", type=int, default=25, help="kernels shown per implementation (the rest summed)")
    ap.add_argument("--spans", action="store_true",
                    help="also the MiB our kernels' tensor arguments span a call (one more call, not timed) and the "
                    "rate that gives at the kernel's time: how near it runs to the memory bandwidth")
    args = ap.parse_args(argv)
    impls = [x for x in args.impls.split(",") if x]
    for x in impls:
        if x not in IMPLS and x not in AB:
            ap.error(f"--impls takes {', '.join(IMPLS)} or an A/B column of bench_kernels_bwd.py ({', '.join(AB)}); "
                     f"got {x!r}")
    if not torch.cuda.is_available():
        print("no CUDA device: this script times GPU kernels")
        return 2
    B, T, H, HV, lens = SHAPES[args.shape]
    a, kw, do, dht = make(B, T, H, HV, lens, torch.device("cuda"), gates=args.gates)
    what = "forward" if args.fwd_only else "forward + backward"
    print(f"{what}, {args.shape}, {args.gates} gates, {torch.cuda.get_device_name()}, mean of {args.calls} calls")
    sums = {}
    for name in impls:
        fn, ctx, why = implementation(name)
        if fn is None:
            print(f"\n{name}: skipped ({why})")
            continue
        leaves = [x.detach().requires_grad_() for x in a]
        call = caller(fn, ctx, leaves, kw, do, dht, args.fwd_only)
        try:
            rows = per_kernel(call, args.calls)
            spans = launch_spans(call) if args.spans and (name == "ours" or name in AB) else {}
        except Exception as e:  # noqa: BLE001 - one implementation failing leaves the others' tables
            print(f"\n{name}: failed: {type(e).__name__}: {e}")
            continue
        total = sum(ms for ms, _ in rows.values())
        sums[name] = total
        print(f"\n{name}: kernels' sum {total:.3f} ms a call" + (f", our kernels' spans {sum(spans.values()):.0f} MiB"
                                                                if spans else ""))
        print(f"  {'ms':>7}  {'share':>6}  {'launches':>8}  " + (f"{'MiB':>8}  {'TB/s':>5}  " if spans else "")
              + "kernel")
        order = sorted(rows.items(), key=lambda kv: -kv[1][0])
        for k, (ms, cnt) in order[:args.rows]:
            rate = ""
            if spans:
                mib = spans.get(k)
                rate = (f"{mib:8.1f}  {mib * 2 ** 20 / (ms * 1e-3) / 1e12:5.2f}  " if mib is not None
                        else f"{'':8}  {'':5}  ")
            print(f"  {ms:7.3f}  {100 * ms / total:5.1f}%  {cnt:8.1f}  {rate}{k[:100]}")
        rest = order[args.rows:]
        if rest:
            ms = sum(v[0] for _, v in rest)
            print(f"  {ms:7.3f}  {100 * ms / total:5.1f}%  {sum(v[1] for _, v in rest):8.1f}  ({len(rest)} others)")
    print("\nsums, ms a call: " + ", ".join(f"{k} {v:.3f}" for k, v in sums.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
