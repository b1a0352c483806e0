"""Check ``gdn_bwd_fused`` (``kernels/backward/fused.py``) against the one-term plan's dh_ws and dqk on the same tables.

    python3 benchmarks/experiments/fused_bwd_check.py [--shape B,T,H,HV] [--h0] [--varlen]

On a GPU: the one-term plan (the backward benchmark's "ours-one16") runs its conversion, prep, dh and the recompute
and dqk; the pipeline's fused stage (``pipeline.fused``) runs on the same q, k, v, dO, S, U, Tinv, gate table and
factors.  Prints each output's max |fused - plan| / max |plan|, then both forms' time (``triton.testing.do_bench``,
each with its output allocations).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchmarks.bench_kernels_bwd import AB  # noqa: E402

# the backward benchmark's one-term plan, without the forward's tables
ONE16 = dict(AB["ours-one16"][1], reads_saved_tables=False)


def make_inputs(B, T, H, HV, h0, varlen, dev):
    """q, k, v, g, beta, do, dht, initial_state, cu_seqlens (bf16 inputs, logsigmoid gates, L2-normalised q, k)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    D = 128
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, HV, D)
    g = torch.nn.functional.logsigmoid(r(B, T, HV)) / 16
    beta = torch.sigmoid(r(B, T, HV))
    do = r(B, T, HV, D) * 0.1
    cu = None
    N = B
    if varlen:
        lens = [T * B // 2 - 37, T * B // 4 + 37, T * B // 4]
        q, k, v, g, beta, do = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta, do))
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        N = len(lens)
    dht = r(N, HV, D, D) * 0.01
    hz = r(N, HV, D, D) * 0.1 if h0 else None
    bf = lambda x: x.to(dev, torch.bfloat16)  # noqa: E731
    return (bf(q), bf(k), bf(v), g.to(dev), beta.to(dev), bf(do), dht.to(dev), None if hz is None else hz.to(dev),
            None if cu is None else cu.to(dev))


def plan_tables(q, k, v, g, beta, do, dht, h0, cu):
    """(b, plan, factors, tables, states, grads, terms) of the one-term plan's stages on these inputs."""
    from kernels.backward import pipeline as bp
    b = bp.prepare_backward(q, k, v, g, beta, do, dht, None, h0, True, False, cu)
    plan = dataclasses.replace(bp.plan_for(b), **ONE16)
    b, f = bp._scaled(b, plan)
    tables = bp.prep(b=b, plan=plan, saved=None)
    grads = bp.dh(b=b, plan=plan, tables=tables, saved=False, maps=None, factors=f)
    states = bp.recompute(x=b.x, plan=plan, tables=tables, side=None, maps=None)
    terms = bp.dqk(b=b, plan=plan, tables=tables, states=states, grads=grads, fp32_sums=True, factors=f)
    return b, plan, f, tables, states, grads, terms


def fused_stage(b, plan, f, tables, states):
    """(grads, terms) of the pipeline's fused stage (``pipeline.fused``: dq~, dk~ per value head) on these tables."""
    from kernels.backward import pipeline as bp
    # on the split plan's fp16 q and dO (io_dtype "": the kernel converts nothing, dv in fp16)
    return bp.fused(b=b, plan=dataclasses.replace(plan, fused=True, io_dtype=""), tables=tables, states=states,
                    factors=f)


def compare(fgrads, fterms, grads, terms, H, has_h0):
    """[(name, max |fused - plan| / max |plan|)] of the fused stage's (``fgrads, fterms``) and the plan's outputs."""
    def rel(a, ref):
        a, ref = a.double(), ref.double()
        return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    Ttot, HV, D = fterms.dqv.shape
    gs = lambda t: t.view(Ttot, H, HV // H, D).sum(2)  # noqa: E731
    rows = [("dv", rel(fgrads.dv, grads.dv)), ("dq (group sums)", rel(gs(fterms.dqv), terms.dqv)),
            ("dk (group sums)", rel(gs(fterms.dkv), terms.dkv))]
    for name in ("qz", "kw", "kr", "yv2", "db22", "sd"):
        rows.append((name, rel(getattr(fterms, name).sum(0), getattr(terms, name).sum(0))))
    rows.append(("rect", rel(fterms.rect, terms.rect)))
    if has_h0:
        rows.append(("dh0", rel(fgrads.dh0, grads.dh0)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2,1024,2,4")
    ap.add_argument("--h0", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    a = ap.parse_args(argv)
    import triton

    from kernels.backward import pipeline as bp
    B, T, H, HV = (int(s) for s in a.shape.split(","))
    b, plan, f, tables, states, grads, terms = plan_tables(*make_inputs(B, T, H, HV, a.h0, a.varlen, "cuda"))
    fgrads, fterms = fused_stage(b, plan, f, tables, states)
    torch.cuda.synchronize()
    print(torch.cuda.get_device_name(), f"B{B} T{T} H{H} HV{HV} h0={a.h0} varlen={a.varlen}")
    for name, e in compare(fgrads, fterms, grads, terms, b.x.H, a.h0):
        print(f"  {name:<16} max |fused - plan| / max |plan| = {e:.3e}")

    def plan_pass():
        gr = bp.dh(b=b, plan=plan, tables=tables, saved=False, maps=None, factors=f)
        bp.dqk(b=b, plan=plan, tables=tables, states=states, grads=gr, fp32_sums=True, factors=f)
    t_plan = triton.testing.do_bench(plan_pass, warmup=5, rep=50)
    t_fused = triton.testing.do_bench(lambda: fused_stage(b, plan, f, tables, states), warmup=5, rep=50)
    print(f"  dh + dqk {t_plan:.3f} ms, fused {t_fused:.3f} ms, ratio {t_fused / t_plan:.3f}")


if __name__ == "__main__":
    main()
