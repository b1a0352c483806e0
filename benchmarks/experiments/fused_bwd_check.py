"""Check ``gdn_bwd_fused`` (``kernels/backward/fused.py``) against the one-term plan's dh_ws and dqk on the same tables.

    python3 benchmarks/experiments/fused_bwd_check.py [--cpu] [--shape B,T,H,HV] [--h0] [--varlen]

On a GPU: the one-term plan (the backward benchmark's "ours-one16") runs its conversion, prep, dh and the recompute
and dqk; the fused kernel runs on the same q, k, v, dO, S, U, Tinv, gate table and factors.  Prints each output's
max |fused - plan| / max |plan|, then both forms' time (``triton.testing.do_bench``).  With ``--cpu``: the same
host path on the no-op kernel path (``benchmarks.memory_plan.stub_kernel_path``), each fused launch checked against
its TileLang parameters (count, dtype, rank).
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

ONE16 = dict(dtype="float16", io_dtype="bfloat16", one_term=True, dh_single=True, s_single=True, lo8=False,
             dh_ws_bv=32, reads_saved_tables=False)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32}


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


def fused_args(b, f, tables, states, has_h0):
    """The fused kernel's arguments and its outputs (a dict)."""
    x = b.x
    dev, D, HV, NC, Ttot, N = x.q.device, x.D, x.HV, x.NC, x.n_tok, x.N
    f32 = torch.float32
    out = dict(dv=torch.empty(Ttot, HV, D, device=dev, dtype=torch.bfloat16),
               dq32=torch.empty(Ttot, HV, D, device=dev, dtype=f32),
               dk32=torch.empty(Ttot, HV, D, device=dev, dtype=f32),
               **{n: torch.empty(2, HV, NC, 64, device=dev, dtype=f32) for n in ("qz", "kw", "kr", "yv", "db2")},
               sd=torch.empty(2, HV, NC, D, device=dev, dtype=f32), rect=torch.empty(HV, NC, 64, device=dev, dtype=f32),
               dh0=torch.empty(N if has_h0 else 1, HV, D, D, device=dev, dtype=f32))
    dht = b.dht if b.dht is not None else torch.zeros(1, HV, D, D, device=dev, dtype=f32)
    args = (x.q, x.k, x.v, b.do, states.Sch, states.Uh, tables.Th, tables.Fb, x.cu, x.chunk_offsets, dht,
            out["dv"], out["dq32"], out["dk32"], out["qz"], out["kw"], out["kr"], out["yv"], out["db2"], out["sd"],
            out["rect"], out["dh0"], int(b.dht is not None), int(has_h0), float(x.scale), f)
    return args, out


def checking_kernel(pf):
    """A stand-in for the compiled kernel that checks each argument against ``pf``'s parameters."""
    def run(*args):
        assert len(args) == len(pf.params), (len(args), len(pf.params))
        for a, v in zip(args, pf.params):
            buf = pf.buffer_map.get(v)
            if buf is None:
                assert isinstance(a, (int, float)), (v.name, type(a))
            else:
                want = _DTYPES[str(buf.dtype)]
                assert isinstance(a, torch.Tensor) and a.dtype == want and a.dim() == len(buf.shape), (
                    v.name, getattr(a, "dtype", None), want, getattr(a, "shape", None), len(buf.shape))
        print(f"fused launch: {len(args)} arguments match the signature")
    return run


def compare(out, grads, terms, H, has_h0):
    """[(name, max |fused - plan| / max |plan|)]."""
    def rel(a, ref):
        a, ref = a.double(), ref.double()
        return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    Ttot, HV, D = out["dq32"].shape
    gs = lambda t: t.view(Ttot, H, HV // H, D).sum(2)  # noqa: E731
    rows = [("dv", rel(out["dv"], grads.dv)), ("dq (group sums)", rel(gs(out["dq32"]), terms.dqv)),
            ("dk (group sums)", rel(gs(out["dk32"]), terms.dkv))]
    for name, ref in (("qz", terms.qz), ("kw", terms.kw), ("kr", terms.kr), ("yv", terms.yv2), ("db2", terms.db22),
                      ("sd", terms.sd)):
        rows.append((name, rel(out[name].sum(0), ref.sum(0))))
    rows.append(("rect", rel(out["rect"], terms.rect)))
    if has_h0:
        rows.append(("dh0", rel(out["dh0"], grads.dh0)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--shape", default="2,1024,2,4")
    ap.add_argument("--h0", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    a = ap.parse_args(argv)
    from kernels.backward.fused import build_bwd_fused
    B, T, H, HV = (int(s) for s in a.shape.split(","))
    dev = "cpu" if a.cpu else "cuda"
    xs = make_inputs(B, T, H, HV, a.h0, a.varlen, dev)
    pf = build_bwd_fused(io="bfloat16")
    if a.cpu:
        from benchmarks.memory_plan import stub_kernel_path
        with stub_kernel_path():
            b, plan, f, tables, states, grads, terms = plan_tables(*xs)
            args, out = fused_args(b, f, tables, states, a.h0)
            checking_kernel(pf)(*args)
        return
    import tilelang
    import triton

    from kernels.build import TARGET, pass_configs
    kern = tilelang.compile(pf, target=TARGET, pass_configs=pass_configs())
    b, plan, f, tables, states, grads, terms = plan_tables(*xs)
    args, out = fused_args(b, f, tables, states, a.h0)
    kern(*args)
    torch.cuda.synchronize()
    print(torch.cuda.get_device_name(), f"B{B} T{T} H{H} HV{HV} h0={a.h0} varlen={a.varlen}")
    for name, e in compare(out, grads, terms, b.x.H, a.h0):
        print(f"  {name:<16} max |fused - plan| / max |plan| = {e:.3e}")
    from kernels.backward import pipeline as bp

    def plan_pass():
        gr = bp.dh(b=b, plan=plan, tables=tables, saved=False, maps=None, factors=f)
        bp.dqk(b=b, plan=plan, tables=tables, states=states, grads=gr, fp32_sums=True, factors=f)
    t_plan = triton.testing.do_bench(plan_pass, warmup=5, rep=50)
    t_fused = triton.testing.do_bench(lambda: kern(*args), warmup=5, rep=50)
    print(f"  dh + dqk {t_plan:.3f} ms, fused {t_fused:.3f} ms, ratio {t_fused / t_plan:.3f}")


if __name__ == "__main__":
    main()
