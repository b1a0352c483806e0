"""Time ``gdn_bwd_fused`` (``kernels/backward/fused.py``) at warpgroup register splits against the one-term plan's
dh + dqk on the same tables, on one shape: the pipeline's fused stage with each split's kernel, each form with its
output allocations; the splits compile in parallel processes first.

    python3 benchmarks/experiments/fused_bwd_time.py [--shape B,T,H,HV] [NREG ...]

NREG: the four warpgroups' registers, "184,168,136,24" (the default).  Prints ms, the ratio to dh + dqk, ptxas'
spill bytes and whether it serialised the wgmma (C7512).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)


def _compile(nreg):
    """The compiled kernel's ptxas summary at ``nreg`` (fills TileLang's cache), or the error."""
    import tilelang

    from kernels.backward.fused import build_bwd_fused
    from kernels.build import TARGET, pass_configs, ptxas_report
    try:
        kern = tilelang.compile(build_bwd_fused(nreg=nreg), target=TARGET, pass_configs=pass_configs())
        r = ptxas_report(kern.get_kernel_source())
        return dict(spill_stores=r["spill_stores"], serialised="C7512" in r["log"])
    except Exception as e:  # reported in the table
        return f"{type(e).__name__}: {str(e)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,32")
    ap.add_argument("nreg", nargs="*", default=["184,168,136,24"])
    a = ap.parse_args(argv)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    nregs = [tuple(int(x) for x in s.split(",")) for s in a.nreg]
    with ProcessPoolExecutor(min(len(nregs), 12), mp_context=mp.get_context("spawn")) as ex:
        built = list(ex.map(_compile, nregs))
    from unittest import mock

    import tilelang
    import torch
    import triton

    import kernels.build as build
    from fused_bwd_check import fused_stage, make_inputs, plan_tables
    from kernels.backward import pipeline as bp
    from kernels.backward.configs import FUSED_KIND
    from kernels.backward.fused import build_bwd_fused
    B, T, H, HV = (int(s) for s in a.shape.split(","))
    b, plan, f, tables, states, grads, terms = plan_tables(*make_inputs(B, T, H, HV, False, False, "cuda"))

    def plan_pass():
        gr = bp.dh(b=b, plan=plan, tables=tables, saved=False, maps=None, factors=f)
        bp.dqk(b=b, plan=plan, tables=tables, states=states, grads=gr, fp32_sums=True, factors=f)
    t_plan = triton.testing.do_bench(plan_pass, warmup=5, rep=50)
    rows = []
    for nreg, rep in zip(nregs, built):
        ms = float("nan")
        if not isinstance(rep, str):
            kern = tilelang.compile(build_bwd_fused(nreg=nreg), target=build.TARGET, pass_configs=build.pass_configs())
            get = build.get_kernel

            def split_kernel(cfg, kern=kern, get=get):
                return kern if cfg.kind == FUSED_KIND else get(cfg)
            with mock.patch.object(build, "get_kernel", split_kernel):
                ms = triton.testing.do_bench(lambda: fused_stage(b, plan, f, tables, states), warmup=5, rep=50)
        rows.append((nreg, ms, rep))
    print(torch.cuda.get_device_name(), f"B{B} T{T} H{H} HV{HV}; dh + dqk {t_plan:.3f} ms")
    for nreg, ms, rep in rows:
        print(f"  {','.join(map(str, nreg)):<16} {ms:7.3f} ms  {ms / t_plan:5.2f}x  {rep}")


if __name__ == "__main__":
    main()
