"""Accuracy of the backward at each operand form of ``kernels.backward.emulation.OPERANDS``, on the CPU.

    python benchmarks/precision_bwd.py [--T 1024] [--dists raw-qk-l2,strong-decay,qwen-gates,slow-decay]
                                       [--operands split,bf16,fp16,one16] [--dtype bf16] [--do-exp 0]

For each distribution, without and with an initial state (B1 H2 HV4 K = V = 128): the rel_rmse against fp64
(``parity.refs.compute``) of every gradient of the FLA-like baseline (``parity.backends.BASELINE``) and of the
emulated backward at each operand form: "split" (the kernels' forms), "bf16" (every wgmma operand and table one
input-dtype term), "fp16" (one fp16 term under a power of two per matrix) and "one16" (one unscaled fp16 term per
table, the emulation's ``kernel_dtype``), "one16g" (the same with dO, dht and v, h0 under a power of two per GVA
group, ``group_scales``), "one16gc" (and dh's F1 dO, F0 dX under a power of two per chunk, ``chunk_exp``: what
``BackwardPlan.one_term`` on the fp16 kernels computes for bf16 inputs, ``ONE_TERM_FP16``), "one16gcp" (one16gc
with dUloc from one fp16 term of P, ``p_single``: what a fused backward forming P in shared memory reads), "dh16"
and "dqk16" (one kernel's operands and the tables between it and dqk one fp16 term each, the other kernels split),
"store16" and "storeb16" (one16gcp with dq~ and dk~ per value head stored in fp16 under the group's powers of two,
or in bf16, before their group sums: ``dqk_store``; store16 is the fused plan with the recompute's products split,
``ours-rc-split``), "rc16" (store16 with the recompute's K S, X and F2 U products one term, ``recompute_one``: the
dispatched fused plan's form, ``FUSED_FP16``) and "rc16ag" (rc16 with Ag one term too).
``--do-exp E``: dO and dht times 2^E, the emulated gradients times 2^-E (exact; the baseline's, in bf16's exponent
range, unscaled), the range the one-term forms see.  A row marks the gradients where it is worse than the
baseline, and under strong decay a dg past its rounding floor (the emulation tests' rule); a gradient with NaN or
Inf counts as worse.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["rows", "main"]

DISTS = ("raw-qk-l2", "strong-decay", "qwen-gates", "slow-decay")
# the emulation's arguments of each form: an OPERANDS value, "one16" (BackwardPlan.one_term with io_dtype),
# "one16g" (the same with dO, dht and v, h0 under a power of two per GVA group, the emulation's ``group_scales``) or
# "one16gc" (and dh's F1 dO, F0 dX under a power of two per chunk, ``chunk_exp``); "one16gcp" (and dUloc from one
# fp16 term of P, ``p_single``)
ONE16 = ("one16", "one16g", "one16gc", "one16gcp")
# one kernel's operands one fp16 term (``half_term``), the others split: dh's and the dS', dY tables it stores
# ("dh16"), or dqk's and the S, U, dS', dY tables it reads ("dqk16")
HYBRID = {"dh16": "dh_operands", "dqk16": "dqk_operands"}
# one16gcp with dq~ and dk~ per value head stored in a narrower dtype before their GVA group sums (``dqk_store``)
STORE = {"store16": "float16", "storeb16": "bfloat16"}
# store16 with the recompute's products one term (``recompute_one``): those of ``BackwardPlan.recompute_one``
# (``emulation.RECOMPUTE_ONE``), and these precision fields too
RECOMPUTE = {"rc16": (), "rc16ag": ("ag",)}


def _form(op: str) -> dict:
    import torch
    if op in ONE16:
        return dict(dh_single=True, s_single=True, lo8_tables=False, one_term=True, kernel_dtype=torch.float16,
                    group_scales=op != "one16", chunk_exp=op in ("one16gc", "one16gcp"), p_single=op == "one16gcp")
    if op in HYBRID:
        return {HYBRID[op]: "fp16"}
    if op in STORE:
        return {**_form("one16gcp"), "dqk_store": getattr(torch, STORE[op])}
    if op in RECOMPUTE:
        from kernels.backward.emulation import RECOMPUTE_ONE
        return {**_form("store16"), "recompute_one": RECOMPUTE_ONE + RECOMPUTE[op]}
    return dict(operands=op)


def rows(case, operands, do_exp: int = 0) -> list:
    """[(name, {gradient: rel_rmse}, [gradients that break the rule])] of ``case``: the baseline, then the
    emulation at each of ``operands`` (dO and dht times ``2^do_exp``, its gradients scaled back)."""
    from kernels.backward.emulation import chunk_gated_delta_rule_bwd
    from parity.metrics import compare
    from tests import kernel_support as tt

    xs, kw, do, dht = tt.bwd_args(case)
    want, base = tt.fp64_grads(case), tt.baseline_grads(case)
    names = tt.GRAD_NAMES
    err = lambda got: {n: compare(a, r) for n, a, r in zip(names, got, want) if r is not None}  # noqa: E731
    eb = {n: m.rel_rmse for n, m in err(base).items()}
    floor = compare(want[3].to(xs[0].dtype), want[3]).rel_rmse
    out = [("fla-like", eb, [])]
    s = 2.0 ** do_exp
    for op in operands:
        got = chunk_gated_delta_rule_bwd(*xs, do * s, None if dht is None else dht * s, **kw, **_form(op))
        ms = err([None if x is None else x.double() / s for x in got])
        e = {n: m.rel_rmse for n, m in ms.items()}
        bad = [n for n in e if not ms[n].finite or (e[n] > floor if n == "dg" and case.dist == "strong-decay"
                                                    else e[n] > eb[n])]
        out.append((op, e, bad))
    return out


def main(argv=None):
    from cases.case import Case
    from kernels.backward.emulation import OPERANDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--dists", default=",".join(DISTS))
    forms = OPERANDS + ONE16 + tuple(HYBRID) + tuple(STORE) + tuple(RECOMPUTE)
    ap.add_argument("--operands", default=",".join(forms))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--do-exp", type=int, default=0, help="dO and dht times 2^E (the gradients scaled back)")
    a = ap.parse_args(argv)
    ops = a.operands.split(",")
    bad_ops = [o for o in ops if o not in forms]
    if bad_ops:
        ap.error(f"unknown operand forms {bad_ops}; forms: {forms}")
    bf16_only = ONE16 + tuple(STORE) + tuple(RECOMPUTE)
    if set(ops) & set(bf16_only) and a.dtype != "bf16":
        ap.error(f"{', '.join(bf16_only)}: forms for bf16 inputs (one fp16 term is the input dtype's one term for "
                 "fp16)")
    print(f"backward gradients, rel_rmse vs fp64 (CPU emulation), B1 T{a.T} H2 HV4 K=V=128 {a.dtype}, "
          f"dO and dht x 2^{a.do_exp}")
    for dist in a.dists.split(","):
        for h0 in (None, "fp32"):
            case = Case(T=a.T, H=2, HV=4, dtype=a.dtype, dist=dist, h0_dtype=h0, grad=True)
            print(f"{dist}, {'h0' if h0 else 'no h0'}")
            for name, e, bad in rows(case, ops, a.do_exp):
                cells = "  ".join(f"{n} {v:.2e}" for n, v in e.items())
                print(f"  {name:<9}{cells}" + (f"   worse: {','.join(bad)}" if bad else ""), flush=True)


if __name__ == "__main__":
    main()
