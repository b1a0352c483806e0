"""Time ``gdn_bwd_fused_one`` with pieces of its work left out (``build(skip=...)``), against the one-term plan's
dh + dqk, on one shape; the variants compile in parallel processes first.

    python3 benchmarks/experiments/fused_bwd_one_time.py [--shape B,T,H,HV] [--nreg 192,168,128,24] VARIANT...

A VARIANT is "[old+][prof+][nosafe+]SKIP[@NREG]": SKIP is "full" or a comma list of ``skip`` names ("sd,rect");
"old": ``fused_bwd_one_old`` (an earlier copy beside this file); "prof": with clock64 marks (the phase profile
printed); "nosafe": TileLang's bound checks off; NREG: the warpgroups' registers (else ``--nreg``).  Prints a table of ms and ptxas spill bytes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)


def _parse(variant):
    """A variant's name (its options and SKIP, without NREG) -> (build keywords, pass configs)."""
    import tilelang

    from kernels.build import pass_configs
    *opts, rest = variant.split("+")
    assert set(opts) <= {"nosafe", "old", "prof"}, variant
    pc = pass_configs()
    if "nosafe" in opts:
        pc[tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
    skip = frozenset() if rest == "full" else frozenset(rest.split(","))
    kw = dict(skip=skip)
    if "prof" in opts:
        kw["profile"] = True
    return kw, pc


def _module(variant):
    """``fused_bwd_one``, or with the "old+" prefix ``fused_bwd_one_old`` (an earlier copy beside it, for A/B)."""
    import importlib
    return importlib.import_module("fused_bwd_one_old" if "old+" in variant else "fused_bwd_one")


def _compile(job):
    """(variant, nreg) -> (variant, nreg, seconds, ptxas summary or error)."""
    import time

    import tilelang

    from kernels.build import TARGET, ptxas_report
    variant, nreg = job
    t = time.time()
    try:
        kw, pc = _parse(variant)
        kern = tilelang.compile(_module(variant).build(nreg=nreg, **kw), target=TARGET, pass_configs=pc)
        r = ptxas_report(kern.get_kernel_source())
        return variant, nreg, time.time() - t, {k: v for k, v in r.items() if k != "log"}
    except Exception as e:  # reported in the table
        return variant, nreg, time.time() - t, f"{type(e).__name__}: {str(e)[:200]}"


def print_profile(p):
    """Median cycles of each warpgroup's phases over chunks 4..59 of CTA (0, 0): phase length / to its arrival."""
    st = p[:, :, :4]
    nxt = torch.cat([st[:, :, 1:], torch.cat([st[:, 1:, :1], st[:, -1:, :1]], 1)], 2)
    dur, work = (nxt - st)[:, 4:60, :], (p[:, :, 4:] - st)[:, 4:60, :]
    print(f"cycles a chunk (WG0 P1 to P1): {(p[0, 60, 0] - p[0, 4, 0]) / 56:.0f}")
    for w in range(3):
        print(f"  WG{w} phase / to its arrival (median cycles): "
              + "  ".join(f"P{j + 1} {dur[w, :, j].median():.0f}/{work[w, :, j].median():.0f}" for j in range(4)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,32")
    ap.add_argument("--nreg", action="append", default=None)
    ap.add_argument("variants", nargs="+")
    a = ap.parse_args(argv)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    nregs = [tuple(int(x) for x in s.split(",")) for s in (a.nreg or ["192,160,136,24"])]
    jobs = []
    for v in a.variants:
        v, _, own = v.partition("@")
        jobs += [(v, tuple(int(x) for x in own.split(",")))] if own else [(v, n) for n in nregs]
    with ProcessPoolExecutor(min(len(jobs), 12), mp_context=mp.get_context("spawn")) as ex:
        built = list(ex.map(_compile, jobs))
    import tilelang
    import torch
    import triton

    from fused_bwd_one_check import fused_args, make_inputs, plan_tables
    from kernels.backward import pipeline as bp
    from kernels.build import TARGET
    B, T, H, HV = (int(s) for s in a.shape.split(","))
    xs = make_inputs(B, T, H, HV, False, False, "cuda")
    b, plan, f, tables, states, grads, terms = plan_tables(*xs)
    args, out = fused_args(b, f, tables, states, False)

    def plan_pass():
        gr = bp.dh(b=b, plan=plan, tables=tables, saved=False, maps=None, factors=f)
        bp.dqk(b=b, plan=plan, tables=tables, states=states, grads=gr, fp32_sums=True, factors=f)
    t_plan = triton.testing.do_bench(plan_pass, warmup=5, rep=50)
    rows = []
    for variant, nreg, secs, rep in built:
        if isinstance(rep, str):
            rows.append((variant, nreg, float("nan"), rep))
            continue
        kw, pc = _parse(variant)
        kern = tilelang.compile(_module(variant).build(nreg=nreg, **kw), target=TARGET, pass_configs=pc)
        ms = triton.testing.do_bench(lambda: kern(*args), warmup=5, rep=50)
        rows.append((variant, nreg, ms, rep))
    torch.cuda.synchronize()
    if any("prof+" in v for v in a.variants):
        print_profile(args[-1].cpu().double())
    print(torch.cuda.get_device_name(), f"B{B} T{T} H{H} HV{HV}; dh + dqk {t_plan:.3f} ms")
    for variant, nreg, ms, rep in rows:
        print(f"  {variant:<32} {','.join(map(str, nreg)):<16} {ms:7.3f} ms  {ms / t_plan:5.2f}x  {rep}")


if __name__ == "__main__":
    main()
