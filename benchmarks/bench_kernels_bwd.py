"""Forward + backward benchmark of our TileLang GDN (``kernels.autograd``) vs FLA Triton vs FlashQLA.

    python benchmarks/bench_kernels_bwd.py [--shapes NAME,...] [--rep 50] [--no-check] [--dry-run]
                                          [--gates logsigmoid|qwen]

bf16 q/k/v, fp32 g/beta, no initial state, output_final_state=True; q ~ N(0,1), k L2-normalised N(0,1),
v ~ N(0,1), g = logsigmoid(N(0,1)) (``--gates qwen``: the forward benchmark's Qwen gates), beta ~ U(0,1);
do ~ N(0,1), dht ~ 0.1 N(0,1).  Shapes: the forward benchmark's (``benchmarks.inputs.SHAPES``; ``DEFAULT_SHAPES``
unless ``--shapes``).  Times are ``triton.testing.do_bench`` medians (ms) in this run, each the median of
``--rounds`` interleaved rounds (``benchmarks.rounds``; the reference ratios are per-round paired medians, and with
more than one round a table of every column against ``ours`` per round follows):
``fwd`` = the forward with autograd recording, ``fwd+bwd`` = forward then ``torch.autograd.backward``;
``bwd`` = their difference; for ours and each A/B column also the backward alone (no autograd, no forward: its
launches back to back, timed in the same rounds; at the few-head shapes it moves less between equal plans than
forward + backward through autograd) and the time of every backward stage (CUDA events, one call); and the host
time of one call of each (10 calls enqueued without waiting: where it reaches the median, the GPU waited for the
host).  The leaves'
gradients are reset before each timed call (``grad_to_none``).  ``--rep`` and ``--warmup`` are do_bench's
milliseconds, not counts: at ~8 ms a call ``--rep 10`` is one or two samples; ``--rep 200`` gives ~25.

Step 0 compiles the TileLang kernels (backward stages + the forward kernels, bf16) in parallel processes, and
FlashQLA's forward and backward for every shape, one process a shape (``benchmarks.warm_references``).
Step 1 prints one correctness line per implementation on two check cases (dense GVA; varlen with h0 and the
value-first state): each gradient's rel_rmse vs fp64 autograd through ``reference.chunk``, and the FLA-like
baseline (autograd through ``reference.emulated``), so a fast but wrong variant is visible.  Step 2 times.
Columns: ``ours`` (TileLang forward + backward, the dispatched plans), the A/B columns of ``--ab`` (``AB``: ours
with other plan values), ``FLA`` (forward and backward with every FLA dispatch backend off,
``parity.backends.fla_common.triton_backward``, except FLA's TileLang chunk_bwd_dqkwg where FLA refuses its Triton
one: Hopper with Triton in [3.4, 3.7.1), fla #640; the header line says which), ``FlashQLA``.
``--dry-run``: CPU plumbing test, the torch emulations stand in for the kernels, shapes shrink 256x.
The summary table is appended to ``benchmarks/RESULTS.md`` (``benchmarks/record.py``) unless ``--dry-run``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_kernels_fwd import enqueue_ms, fla_triton, flash_qla  # noqa: E402
from benchmarks.inputs import D, DEFAULT_SHAPES, GATES, SHAPES, shrunk  # noqa: E402
from benchmarks.inputs import make as make_fwd_inputs  # noqa: E402
from benchmarks.rounds import host_cell, interleave, median_of, paired_ratio, paired_table, spread  # noqa: E402
from kernels.plan import ONE_TERM_FIELDS  # noqa: E402
from parity.execute import describe_error  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# (name, B, T, H, HV, varlen lengths, h0 std, state_v_first)
CHECKS = [
    ("B1_T4096_H4_HV8", 1, 4096, 4, 8, None, None, False),
    ("varlen4_h0_vfirst_H2_HV4", 1, 4096, 2, 4, [2500, 63, 1400, 133], 1.0, True),
]


def make(B, T, H, HV, lens, dev, seed=0, h0std=None, vfirst=False, gates="logsigmoid"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, g, beta, cu = make_fwd_inputs(B, T, H, HV, lens, dev, seed=seed, gen=gen, gates=gates)
    N = len(lens) if lens else B
    h0 = None if h0std is None else h0std * torch.randn(N, HV, D, D, device=dev, generator=gen)
    do = torch.randn(B, T, HV, D, device=dev, generator=gen).to(torch.bfloat16)
    dht = 0.1 * torch.randn(N, HV, D, D, device=dev, generator=gen)
    return (q, k, v, g, beta), dict(initial_state=h0, output_final_state=True, state_v_first=vfirst,
                                    cu_seqlens=cu), do, dht


def backward_context(name: str):
    """The context an implementation's forward + backward run in: for FLA ``fla_common.triton_backward`` (every
    dispatch backend off but the TileLang chunk_bwd_dqkwg where FLA refuses its Triton one), since FLA picks its
    backward's sub-kernels when they are called, after the forward's own switch-off has ended; nothing for the
    others."""
    if name == "FLA":
        from parity.backends.fla_common import triton_backward
        return triton_backward()
    return contextlib.nullcontext()


# A/B columns (``--ab``): ours with plan values other than the dispatched ones (``dataclasses.replace`` of the
# ForwardPlan / BackwardPlan the Function dispatches; ``kernels.autograd.apply(alter=...)``)
# the one-term backward on fp16 operands (``kernels.plan.ONE_TERM_FIELDS``: bf16 inputs converted, v and dO under
# powers of two per GVA group; S, U, dS', dY hi alone; K = 128; the forward keeps no tables), with the sequential
# dh_ws at every layout, dh and dqk two kernels (not fused, as dispatched where ``kernels.plan.dispatches_fused``)
ONE16 = dict(ONE_TERM_FIELDS, fused=False, fused_warm=False, fused_exact=False)
AB = {"ours-again": ("backward", {}),   # the dispatched plan again, through alter: the A/B's noise floor
      # the split plan where the fused one is dispatched (``BackwardPlan.split``; the forward keeps its tables)
      "ours-split": ("split", None),
      "ours-serial": ("backward", dict(overlap_recompute=False)),  # the recompute on the main stream, after dh
      "ours-overlap": ("backward", dict(overlap_recompute=True)),  # the recompute on a side stream, beside dh
      "ours-no-cluster": ("backward", dict(cluster_group_sum=False)),  # GVA sums: fp32 rows + gdn_bwd_group_sum
      "ours-rc-bv32": ("backward", dict(recompute_block_v=32, recompute_ctas_per_sm=1)),  # the recompute's state
      "ours-rc-bv64": ("backward", dict(recompute_block_v=64, recompute_ctas_per_sm=1)),  # kernel shape (BV, CTAs
      "ours-rc-bv16o2": ("backward", dict(recompute_block_v=16, recompute_ctas_per_sm=2, recompute_ws=False,
                                          recompute_warm=False)),
      "ours-rc-bv32o2": ("backward", dict(recompute_block_v=32, recompute_ctas_per_sm=2, recompute_ws=False,
                                          recompute_warm=False)),  # smem
      # the recompute's smem state kernel (not the ws form; with the segmented dh per its own exact CP segments)
      "ours-rc-smem": ("backward", dict(recompute_ws=False, recompute_warm=False)),
      # dqk's gates formed at each use and its fp8 lo tiles widened by a shift (not dqk_e_once, dqk_exp_mask)
      "ours-dqk-plain": ("backward", dict(dqk_e_once=False, dqk_exp_mask=False)),
      # one sequential recompute pass at BV 16 (what block_v gives where the recompute runs per CP segment), dh's
      # transfer maps by its pass B
      "ours-rc-seq": ("backward", dict(recompute_cp=1, recompute_block_v=16, recompute_ctas_per_sm=1,
                                       shared_scan=False, recompute_warm=False, dh_warm=False)),
      # with the segmented dh in three passes: its pass B, and the recompute per its own CP segments (recompute_cp)
      "ours-no-shared-scan": ("backward", dict(shared_scan=False, dh_warm=False, recompute_warm=False)),
      # the recompute's K S one term (S hi alone)
      "ours-ks1": ("backward", dict(ks_single=True, recompute_ws=False, recompute_warm=False)),
      "ours-no-saved": ("both", None),   # the forward keeps no intra tables: prep recomputes Tinv (hi + lo) and Ag
      "ours-dh-single": ("backward", dict(dh_single=True, lo8=False)),  # dh's Tinv, dU, F0 dX single (sequential)
      "ours-s-single": ("backward", dict(s_single=True, lo8=False)),  # the recompute's S hi alone: no S lo table
      "ours-lo16": ("backward", dict(lo8=False)),  # the S and dS' lo tables in the input dtype, not fp8
      # dh_ws and dqk with every table and operand one fp16 term (``ONE16``)
      "ours-one16": ("both", dict(ONE16)),
      # the same with dh and dqk as one warp-specialised kernel after the recompute (dUloc from one fp16 term of P),
      # over its warm-up segments where one CTA per value head leaves SMs idle (``fused_warm``); its GVA sums by
      # gdn_bwd_group_sum, as dispatched
      "ours-fused": ("both", dict(ONE16, fused=True, fused_warm=True)),
      # over the same segments from exact end gradients (its chain form, the forward CP scan's maps, the fp64 walk)
      "ours-fused-exact": ("both", dict(ONE16, fused=True, fused_exact=True)),
      # the dispatched fused plan with dq~, dk~ stored in fp32 times the factors (``fused_dq16`` off), the group sums
      # reading them
      "ours-fused-dq32": ("backward", dict(fused_dq16=False)),
      # the dispatched fused plan with gdn_bwd_convert's pass before prep (``prep_converts`` off): prep on its copies
      "ours-convert-pass": ("backward", dict(prep_converts=False)),
      # the dispatched fused plan with the recompute's K S, X and F2 U split (``recompute_one`` off)
      "ours-rc-split": ("backward", dict(recompute_one=False)),
      # the dispatched fused plan with the fused kernel's sequences issued in index order (``longest_first`` off)
      "ours-seq-order": ("backward", dict(longest_first=False)),
      # the fused kernel in one pass per sequence (no segments)
      "ours-fused-seq": ("both", dict(ONE16, fused=True)),
      "ours-dh-regs": ("backward", dict(dh_ws_bv=0)),  # dh's register kernel (value-first, 64 value columns a CTA)
      # dh warp-specialised, key-first, 32 value columns a CTA (the segmented pass in three passes)
      "ours-dh-ws32": ("backward", dict(dh_ws_bv=32, dh_warm=False)),
      # the segmented reverse pass in three passes and the end-gradient scan, the recompute from the shared scan's
      # start states (not the warm forms of both)
      "ours-dh-3pass": ("backward", dict(dh_warm=False, recompute_warm=False, shared_scan=True)),
      # the warm dh, the recompute from the shared scan's start states (not from its own warm-up chunks)
      "ours-rc-scan": ("backward", dict(recompute_warm=False, shared_scan=True)),
      "ours-m1": ("merges", "bf16"),   # the forward's block merges one term, and prep's where it computes Tinv
      "ours-msplit": ("merges", "split"),   # the same with split (3-term wgmma) merges instead of fp32 ones
      }


def alter(col: str):
    """The plan function (``kernels.autograd.apply``'s ``alter``) of A/B column ``col``; applied to a plan the column
    does not change, it returns that plan.  A change the plan cannot take (a cluster sum off where there is none)
    leaves it as dispatched."""
    import dataclasses

    from kernels.plan import BackwardPlan, ForwardPlan
    where, change = AB[col]

    def f(plan):
        if where == "split":
            return plan.split if isinstance(plan, BackwardPlan) and plan.split is not None else plan
        if where == "merges":
            if isinstance(plan, ForwardPlan):
                # P tables need the intra kernel's q tile, which the split merges do without
                return dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, merge=change),
                                           p_table=plan.p_table and change != "split")
            return dataclasses.replace(plan, merge=change)
        if where == "both":
            if isinstance(plan, ForwardPlan):
                return dataclasses.replace(plan, keep_tables=False)
            return dataclasses.replace(plan, **{"reads_saved_tables": False, **(change or {})})
        if isinstance(plan, BackwardPlan) and where == "backward":
            return dataclasses.replace(plan, **segmented_only(change, plan))
        return plan
    if where in ("split", "both"):      # the forward keeps its tables for the split plan, none for the one-term ones
        f.keep_tables = where == "split"
    return f


def segmented_only(change: dict, plan) -> dict:
    """``change`` without ``shared_scan`` where ``plan`` has no segmented reverse pass (``dh_segments``), which that
    field needs; the other fields of the segmented pass are read with it alone."""
    return change if plan.dh_segments is not None else {k: v for k, v in change.items() if k != "shared_scan"}


ALONE = "(bwd alone)"


def backward_alone_args(col, a, kw, do, dht, emulation: bool = False) -> dict:
    """``{"fn": the backward pipeline, "kw": its keyword arguments}`` for A/B column ``col`` (or ``ours``) on the
    forward's inputs ``a``: the column's plan, and the forward's intra tables (computed once here) where the plan
    reads them, as the autograd Function hands them on.  ``emulation`` (a dry run): the emulated backward, every
    column's alike."""
    side = dict(initial_state=kw["initial_state"], state_v_first=kw["state_v_first"], cu_seqlens=kw["cu_seqlens"])
    if emulation:
        from kernels.backward.emulation import chunk_gated_delta_rule_bwd as emulated
        return {"fn": emulated, "kw": side}
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd, plan_for, prepare_backward, reads_saved_tables
    from kernels.forward.pipeline import chunk_gated_delta_rule as fwd_api
    plan = plan_for(prepare_backward(*a, do, dht, **side))
    plan = plan if col == "ours" else alter(col)(plan)
    saved = {}
    if plan.takes_saved_tables and reads_saved_tables(a[0]):
        fwd_api(*a, **side, keep_tables=saved)
    side.update(plan=plan, **({"saved_tables": saved} if saved else {}))
    return {"fn": chunk_gated_delta_rule_bwd, "kw": side}


def call_configs(B, T, H, HV, lens, cols):
    """Every kernel configuration a bf16 forward + backward of this shape runs in columns ``cols``."""
    import dataclasses

    from kernels.plan import backward_plan, forward_plan
    n = len(lens) if lens else B
    mc = max(-(-x // 64) for x in lens) if lens else -(-T // 64)
    nc = sum(-(-x // 64) for x in lens) if lens else B * -(-T // 64)
    out = []
    merges = [c for c in cols if c in AB and AB[c][0] == "merges"]
    for keep in (True, False):
        fp = forward_plan("bfloat16", n, HV, mc, keep_tables=keep)
        out += fp.configs() + tuple(c for m in merges for c in alter(m)(fp).configs())
    bp = backward_plan("bfloat16", H, HV, nc, n, max_chunks=mc)
    # with the split plan where the fused one is dispatched (``ours-split``)
    for p in [bp, dataclasses.replace(bp, reads_saved_tables=False)] + ([bp.split] if bp.split is not None else []):
        out += p.configs(True) + p.configs(False) + p.recompute_configs()
        for m in merges:
            out += alter(m)(p).configs(False)
    for col in cols:
        if col in AB and AB[col][0] == "both" and AB[col][1]:
            p = alter(col)(bp)
            out += p.configs(False) + p.recompute_configs()
        if col in AB and AB[col][0] == "backward":
            try:
                out += dataclasses.replace(bp, **AB[col][1]).configs(True)
            except ValueError:            # a change this shape's plan cannot take (no cluster to turn off)
                pass
    return out


def grads(fn, args, kw, do, dht, cast=lambda x: x, name: str = ""):
    leaves = [cast(x).detach().requires_grad_() for x in args]
    h0 = kw["initial_state"]
    h = None if h0 is None else cast(h0).detach().requires_grad_()
    with backward_context(name):
        o, ht = fn(*leaves, **dict(kw, initial_state=h))
        torch.autograd.backward((o, ht), (cast(do).to(o.dtype), cast(dht)))
    return [x.grad for x in leaves] + ([h.grad] if h is not None else [])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3,
                    help="time every column this many times per shape, interleaved (benchmarks.rounds); the table "
                         "gives medians over the rounds and per-round paired ratios")
    ap.add_argument("--workers", type=int, default=min(10, os.cpu_count() or 1))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of the reference columns not to run (FLA, FlashQLA), e.g. "
                    "for an A/B call of our columns alone; flashinfer is taken and changes nothing (no backward), "
                    "so one argument list serves both benchmarks")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--gates", default="logsigmoid", choices=GATES,
                    help="g = logsigmoid(N(0,1)) (default) or the qwen-gates distribution's")
    ap.add_argument("--results", default=None, help="append the summary here (default benchmarks/RESULTS.md; "
                    "a dry run appends only when given)")
    ap.add_argument("--ab", default="",
                    help="also time these A/B columns, ours with other plan values (the AB table): 'ours-again' "
                    "(the dispatched plan through the same path as the others: what two equal columns differ by), "
                    "'ours-split' (the split plan where the fused one is dispatched), "
                    "'ours-serial' "
                    "(the recompute not beside dh), 'ours-no-cluster' (the GVA sums by gdn_bwd_group_sum after fp32 "
                    "rows per value head), 'ours-rc-bv32' / 'ours-rc-bv64' / 'ours-rc-bv16o2' / 'ours-rc-bv32o2' "
                    "(the recompute's state kernel shape), 'ours-rc-seq' (the recompute in one sequential pass at BV "
                    "16, not per CP segment), 'ours-no-shared-scan' (the segmented dh's own pass B instead of the "
                    "forward CP scan's maps), 'ours-ks1' (the recompute's K S products on S's hi term alone), "
                    "'ours-no-saved' (the forward keeps no intra tables: prep recomputes Tinv, hi + lo, and Ag), "
                    "'ours-dh-single' (dh's Tinv, dU and F0 dX as single terms on the "
                    "sequential pass), 'ours-dh-regs' (dh's register kernel), 'ours-dh-ws32' (dh "
                    "warp-specialised and key-first, 32 value columns a CTA), 'ours-rc-smem' (the recompute's "
                    "smem state kernel, not the dispatched ws form), 'ours-dqk-plain' (dqk forming its "
                    "intra-term gates at each use and widening its fp8 lo tiles by a shift); the full list: the AB "
                    "table")
    args = ap.parse_args(argv)
    ab = [c for c in args.ab.split(",") if c]
    for col in ab:
        if col not in AB:
            ap.error(f"--ab takes {', '.join(AB)}; got {col!r}")

    from benchmarks import record
    from kernels.autograd import apply as ours_fn
    from parity.metrics import compare

    t_start = time.time()
    table, checks = SHAPES, CHECKS
    if args.dry_run:
        dev = torch.device("cpu")
        table = shrunk(SHAPES)
        checks = []
        for c in CHECKS:
            L2 = [max(1, x // 64) for x in c[5]] if c[5] else None
            checks.append((c[0], c[1], sum(L2) if L2 else c[2] // 64, *c[3:5], L2, *c[6:]))

        def do_bench(fn, warmup, rep, return_mode, grad_to_none=None):
            t = time.time()
            fn()
            return (time.time() - t) * 1e3

        def ours(*a, **k):
            return ours_fn(*a, **k, impl="emulation")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --dry-run on a CPU)")
            return 2
        from triton.testing import do_bench
        dev = torch.device("cuda")
        ours = ours_fn
    devname = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)"
    print(f"device: {devname}  torch {torch.__version__}", flush=True)
    try:
        from parity.backends.fla_common import triton_refuses_gated_dqkwg
        print(f"FLA column: Triton kernels; {triton_refuses_gated_dqkwg() or 'its backward too'}", flush=True)
    except ImportError as e:
        print(f"FLA column: fla not importable ({e})", flush=True)
    shapes = [s for s in args.shapes.split(",") if s]
    skip = {c for c in args.skip.split(",") if c}
    unknown = skip - {"FLA", "FlashQLA", "flashinfer"}
    if unknown:
        ap.error(f"--skip takes FLA, FlashQLA (and flashinfer, which has no column here); got {sorted(unknown)}")
    skip.discard("flashinfer")
    # FlashQLA's column (its JIT is warmed in step 0); the dry run has no reference columns
    fq, fq_why = (None, "--skip") if "FlashQLA" in skip else (None, "dry run") if args.dry_run else flash_qla()

    print("== step 0: compile ==", flush=True)
    if not args.dry_run:
        from kernels.build import precompile
        cfgs = []
        todo = [table[n][:5] for n in shapes]
        todo += [] if args.no_check else [c[1:6] for c in checks]
        for B, T, H, HV, lens in todo:
            cfgs += call_configs(B, T, H, HV, lens, ["ours"] + ab)
        precompile(list(dict.fromkeys(cfgs)), args.workers, log=lambda m: print(m, flush=True))
        if fq is not None:
            from benchmarks.warm_references import warm         # its JIT, forward and backward, one process a shape
            warm("benchmarks.bench_kernels_fwd:flash_qla", shapes, args.workers, gates=args.gates, backward=True,
                 log=lambda m: print(m, flush=True))

    impls = [("ours", ours)]
    for col in ab:
        impls.append((col, lambda *a, f=alter(col), **k: ours(*a, **k, alter=f)))
    skipped = {}
    skipped.update({c: "--skip" for c in sorted(skip)})
    if not args.dry_run:
        fla, why = fla_triton() if "FLA" not in skip else (None, "--skip")
        if fla is None:
            skipped.setdefault("FLA", why)
        else:
            impls.append(("FLA", fla))
        if fq is None:
            skipped.setdefault("FlashQLA", fq_why)
        else:
            impls.append(("FlashQLA", fq))

    if not args.no_check:
        from reference.chunk import chunk_gated_delta_rule as ref
        from reference.emulated import chunk_gated_delta_rule as emu
        for cname, B, T, H, HV, lens, h0std, vfirst in checks:
            print(f"\n== step 1: correctness on {cname} (rel_rmse vs fp64 autograd) ==", flush=True)
            a, kw, do, dht = make(B, T, H, HV, lens, dev, h0std=h0std, vfirst=vfirst, gates=args.gates)
            want = grads(ref, a, kw, do, dht, cast=lambda x: x.double())
            rows = [("fla-like", lambda *x, **k: emu(*x, **k))] + impls
            for name, fn in rows:
                try:
                    got = grads(fn, a, kw, do, dht, name=name)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    ms = [compare(x, r) for x, r in zip(got, want)]
                    parts = [f"{n} {m.rel_rmse:.2e}" for n, m in zip(NAMES, ms)]
                    bad = sum(m.nan_count + m.inf_count for m in ms)
                    print(f"  check {name:<9} " + "  ".join(parts) + f"  nonfinite {bad}", flush=True)
                except Exception as e:
                    print(f"  check {name:<9} FAILED {describe_error(e)[:200]}", flush=True)
            del a, do, dht, want
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    print("\n== step 2: timing (median ms) ==", flush=True)
    results, peaks, alone, hosts = {}, {}, {}, {}
    interrupted = None
    try:
        for name in shapes:
            B, T, H, HV, lens = table[name]
            a, kw, do, dht = make(B, T, H, HV, lens, dev, gates=args.gates)
            leaves = [x.detach().requires_grad_() for x in a]
            row, timers = {}, {}
            for iname, fn in impls:
                t0 = time.time()
                try:
                    def fwd(fn=fn):
                        return fn(*leaves, **kw)

                    def fwdbwd(fn=fn, iname=iname):
                        with backward_context(iname):
                            o, ht = fn(*leaves, **kw)
                            torch.autograd.backward((o, ht), (do, dht))

                    fwdbwd()            # compile / autotune outside the timing
                    peak = None
                    if dev.type == "cuda":
                        # the memory one fwd+bwd call takes above what it starts with (inputs), gradients included: the
                        # columns differ by what the forward keeps for the backward and by the backward's own buffers
                        for x in leaves:
                            x.grad = None
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        fwdbwd()
                        torch.cuda.synchronize()
                        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                    peaks[(name, iname)] = peak

                    def reset_fwdbwd(fwdbwd=fwdbwd):
                        for x in leaves:
                            x.grad = None
                        fwdbwd()
                    hosts.setdefault(name, {})[iname] = enqueue_ms(reset_fwdbwd, dev, reps=10)

                    def one_round(fwd=fwd, fwdbwd=fwdbwd):
                        tf = do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median")
                        # the leaves' gradients reset before each call (as triton's do_bench does with grad_to_none):
                        # without it every call after the first adds its gradients onto the last
                        tfb = do_bench(fwdbwd, warmup=args.warmup, rep=args.rep, return_mode="median",
                                       grad_to_none=leaves)
                        for x in leaves:
                            x.grad = None
                        return tf, tfb, tfb - tf
                    timers[iname] = one_round
                except Exception as e:
                    skipped.setdefault(iname, describe_error(e)[:160])
                    print(f"  {name:<24} {iname:<9} failed  ({time.time() - t0:.1f} s)", flush=True)
                for x in leaves:
                    x.grad = None
            # the backward alone (no autograd, no forward: its launches back to back) of each of our columns, timed
            # in the same rounds: at the few-head shapes forward + backward through autograd moves between equal plans
            # by more than the backward alone does
            sides = {}
            for col in [c for c in ["ours"] + ab if c in timers]:
                try:
                    sides[col] = side = backward_alone_args(col, a, kw, do, dht, emulation=args.dry_run)
                    run = functools.partial(side["fn"], *a, do, dht, **side["kw"])
                    hosts.setdefault(name, {})[f"{col} {ALONE}"] = enqueue_ms(run, dev, reps=10)
                    timers[f"{col} {ALONE}"] = (lambda run=run: (do_bench(
                        run, warmup=args.warmup, rep=args.rep, return_mode="median"),))
                except Exception as e:
                    print(f"  {name:<24} {col} the backward alone: failed {describe_error(e)[:160]}", flush=True)
            samples = interleave(timers, args.rounds,
                                 on_error=lambda c, e: skipped.setdefault(c, describe_error(e)[:160]))
            for iname, got in samples.items():
                if iname.endswith(ALONE):
                    alone.setdefault(name, {})[iname[:-len(ALONE) - 1]] = got
                    continue
                row[iname] = got or None
                sp = spread(got, 1)
                print(f"  {name:<24} {iname:<9} " + (
                    f"fwd {median_of(got, 0):.3f}  fwd+bwd {median_of(got, 1):.3f}  bwd {median_of(got, 2):.3f} ms"
                    + (f"  peak {peaks[(name, iname)]:.0f} MiB" if peaks.get((name, iname)) is not None else "")
                    + (f"  rounds {len(got)}, spread {100 * sp:.0f}%" if sp is not None else "")
                    if got else "failed"), flush=True)
            for col, side in ({} if args.dry_run else sides).items():
                try:              # where the backward's time goes (one call, CUDA events between the launches)
                    from kernels.backward.pipeline import stage_times
                    for _ in range(2):
                        ev = []
                        side["fn"](*a, do, dht, **side["kw"], events=ev)
                        st = stage_times(ev)
                    t = median_of(alone.get(name, {}).get(col) or [], 0)
                    # against the sum of its stages, so that host time between them (and around the first) shows
                    print(f"  {name:<24} {col} bwd stages: " + "  ".join(f"{k} {v:.3f}" for k, v in st.items())
                          + f" ms (sum {sum(st.values()):.3f}; the backward alone "
                          + (f"{t:.3f} ms)" if t is not None else "failed)"), flush=True)
                except Exception as e:
                    print(f"  {name:<24} {col} bwd stages: failed {describe_error(e)[:160]}", flush=True)
            results[name] = row
            del a, kw, do, dht, leaves
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:        # SIGINT (e.g. a timeout): the shapes done so far are still reported
        interrupted = record.interrupted(len(results), len(shapes))
        print(f"\n{interrupted}", flush=True)

    cols = [n for n, _ in impls]
    title = "fwd+bwd (bwd) median ms, bf16" + (", qwen gates" if args.gates == "qwen" else "")
    print(f"\n== summary: {title} [{time.time() - t_start:.0f} s] ==")
    mine = [c for c in cols if c.startswith("ours")]
    table = [title + (f"; median of {args.rounds} interleaved rounds, ratios paired per round" if args.rounds > 1
                      else ""),
             f"{'shape':<26}" + "".join(f"{c:>20}" for c in cols)
             + "".join(f"   FLA/{m}  FQLA/{m} (fwd+bwd; bwd)" for m in mine)]
    for name, row in results.items():
        line = f"{name:<26}"
        for c in cols:
            r = row.get(c)
            line += f"{('%.3f (%.3f)' % (median_of(r, 1), median_of(r, 2))) if r else '-':>20}"
        for m in mine:
            o = row.get(m)
            for c in ("FLA", "FlashQLA"):
                r = row.get(c)
                line += (f"   {paired_ratio(r, o, 1)[0]:.2f}; {paired_ratio(r, o, 2)[0]:.2f}" if (r and o) else "   -")
        table.append(line)
    if args.rounds > 1:
        table += paired_table(results, cols, "ours", i=1, what="fwd+bwd")
    if alone:
        table += ["", "the backward alone (no autograd, its launches back to back), median ms"
                      + (" of the same rounds" if args.rounds > 1 else ""),
                  f"{'shape':<26}" + "".join(f"{c:>20}" for c in mine)]
        for name, per in alone.items():
            table.append(f"{name:<26}" + "".join(f"{('%.3f' % median_of(per[c], 0)) if per.get(c) else '-':>20}"
                                                 for c in mine))
        if args.rounds > 1:
            table += paired_table(alone, mine, "ours", i=0, what="the backward alone")
    if any(h is not None for per in hosts.values() for h in per.values()):
        table += ["", "host ms per call, fwd+bwd (the backward alone): 10 calls enqueued without waiting; * where it "
                      "reaches 0.9 of the median above: there the time is the host's, not the GPU's",
                  f"{'shape':<26}" + "".join(f"{c:>20}" for c in cols)]
        for name, per in hosts.items():
            line = f"{name:<26}"
            for c in cols:
                fb, al = per.get(c), per.get(f"{c} {ALONE}")
                med = median_of(results.get(name, {}).get(c) or [], 1)
                cell = "-" if fb is None else host_cell(fb, med) + (
                    f" ({host_cell(al, median_of(alone.get(name, {}).get(c) or [], 0))})" if al is not None else "")
                line += f"{cell:>20}"
            table.append(line)
    if any(p is not None for p in peaks.values()):
        table += ["", "peak memory of one fwd+bwd above its inputs, MiB (gradients included)",
                  f"{'shape':<26}" + "".join(f"{c:>20}" for c in cols)]
        for name in results:
            mib = [("%.0f" % peaks[(name, c)]) if peaks.get((name, c)) is not None else "-" for c in cols]
            table.append(f"{name:<26}" + "".join(f"{m:>20}" for m in mib))
    if interrupted:
        table += ["", interrupted]
    print("\n".join(table[1:]))
    if not args.dry_run or args.results:
        print("appended to", args.results or record.RESULTS, "as:",
              record.append("benchmarks/bench_kernels_bwd.py", table, **({"path": args.results} if args.results
                                                                            else {})))
    for c, why in skipped.items():
        print(f"column {c} skipped/failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
