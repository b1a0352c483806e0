"""Compile a reference implementation's JIT kernels for the benchmark shapes in parallel processes.

FlashQLA compiles its TileLang kernels at its first call for each head layout, one after the other, in the calling
process: minutes for the five benchmark shapes, before anything is timed. ``warm`` runs one call per shape in
spawned processes at once; each fills TileLang's disk cache, from which the benchmark's own first call then loads.
Nothing is timed here, and a shape that fails is reported and leaves the others running.

    warm("benchmarks.bench_kernels_fwd:flash_qla", ["B1_T8192_H4_HV8", ...], workers=5, backward=True)
"""

from __future__ import annotations

import functools
import importlib
import time

__all__ = ["warm"]


def _resolve(resolver: str):
    """``module:function`` -> the function, which returns (the implementation or None, why)."""
    mod, name = resolver.split(":")
    return getattr(importlib.import_module(mod), name)


def _warm_one(shape: str, resolver: str, gates: str, backward: bool, device: str):
    """One call of the implementation on ``shape``'s inputs (and its backward): (shape, seconds, error or None)."""
    import torch

    from benchmarks.inputs import SHAPES, make
    t = time.time()
    try:
        fn, why = _resolve(resolver)()
        if fn is None:
            return shape, time.time() - t, f"unavailable: {why}"
        B, T, H, HV, lens = SHAPES[shape]
        q, k, v, g, beta, cu = make(B, T, H, HV, lens, torch.device(device), gates=gates)
        leaves = [x.requires_grad_(backward) for x in (q, k, v, g, beta)]
        with torch.set_grad_enabled(backward):
            o, ht = fn(*leaves, output_final_state=True, cu_seqlens=cu)
            if backward:
                torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        if device == "cuda":
            torch.cuda.synchronize()
        return shape, time.time() - t, None
    except Exception as e:  # noqa: BLE001 - one shape's failure is reported, the others go on
        from parity.execute import describe_error
        return shape, time.time() - t, describe_error(e)[:300]


def warm(resolver: str, shapes, workers: int, gates: str = "logsigmoid", backward: bool = False,
         device: str = "cuda", log=print) -> dict:
    """Call the implementation that ``resolver`` ("module:function", as ``bench_kernels_fwd.flash_qla``) returns
    once on each of ``shapes`` (names of ``benchmarks.inputs.SHAPES``), at most ``workers`` spawned processes at a
    time, forward (and backward when ``backward``).  Returns {shape: error or None}; logs one line per shape."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    shapes = list(shapes)
    if not shapes:
        return {}
    t = time.time()
    out = {}
    job = functools.partial(_warm_one, resolver=resolver, gates=gates, backward=backward, device=device)
    try:
        with ProcessPoolExecutor(max(1, min(workers, len(shapes))), mp_context=mp.get_context("spawn")) as ex:
            for shape, secs, err in ex.map(job, shapes):
                out[shape] = err
                log(f"  warmed {resolver.split(':')[-1]} on {shape:<26} {secs:6.1f} s {err or ''}")
    except Exception as e:  # noqa: BLE001 - a worker that died (a crash in the JIT): the benchmark compiles in-process
        for shape in shapes:
            out.setdefault(shape, f"warm-up process lost: {type(e).__name__}: {e}"[:300])
        log(f"  warm-up stopped: {type(e).__name__}: {e}"[:300])
    log(f"  {len(shapes)} shapes in {time.time() - t:.1f} s")
    return out
