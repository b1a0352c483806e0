"""Forward benchmark of our TileLang GDN kernels vs FLA Triton vs FlashQLA (H200 / sm_90).

    python benchmarks/bench_kernels_fwd.py [--shapes NAME,...] [--variants NAME,...] [--rep 100]
                                          [--gates logsigmoid|qwen]

Forward with the final state, bf16 q/k/v, fp32 g/beta, no initial state; inputs are
random (q ~ N(0,1), k L2-normalised N(0,1), v ~ N(0,1), g = logsigmoid(N(0,1)),
beta ~ U(0,1)).  ``--gates qwen``: g of the ``qwen-gates`` distribution instead (Qwen3-Next's gate with the Mamba
initialisation, ``cases.distributions.qwen_gates``; per 64-token chunk a log-decay of about -1 on many heads where
logsigmoid(N(0,1)) gives about -52), the other inputs unchanged: a state that carries across many chunks.  Times
are ``triton.testing.do_bench`` medians (ms) in this one run, each the median of ``--rounds`` interleaved rounds
(``benchmarks.rounds``: the column order reversed every other round); with more than one round a table of per-round
paired ratios against ``default`` follows.

Step 0 compiles every TileLang kernel the variants need in parallel processes (fills
TileLang's disk cache; the timed processes then load them), and FlashQLA's for every shape, one process a shape
(``benchmarks.warm_references``).  Step 1 prints one correctness line per variant and check case
(B1_T8192_H4_HV8 without h0, and a varlen case with h0 and the value-first state layout): rel_rmse of o and of
the final state vs the fp64 reference, the bf16 rounding floor of o, and the same for FLA / FlashQLA, so a fast but
wrong variant is visible.  Step 2 times every variant on every shape.  Variants (columns):

* ``default``   - what ``kernels.chunk_gated_delta_rule`` dispatches, timed through the public API
                  (``kernels.plan.forward_plan``);
* the other columns are plan values (``ForwardPlan`` fields, ``VARIANTS``) run by the same pipeline:
  ``rv`` - the register-operand state kernel, CP off; ``rvcp`` - the same with CP segments by
  ``plan.cp_segments``; ``cp4`` - forced to 4 segments per sequence; ``bv128`` - the rv state kernel with
  128 value columns per CTA, CP off; ``smem`` - the shared-memory-operand state kernel, BV by
  ``plan.block_v``, one CTA per SM; ``smem16`` / ``smem32`` / ``smem64`` - the same with BV forced;
  ``occ`` - two resident CTAs per SM (BV by ``block_v(.., occ=2)``); ``occ16`` / ``occ32`` - with BV forced;
  ``ws`` - the fused warp-specialised state-output kernel (state form "ws": no chunk tables, no output kernel; BV
  by ``block_v``); ``ws16`` / ``ws32`` / ``ws64`` - with BV forced; ``wscp`` - the ws form with
  CP segments by ``plan.ws_cp_segments`` (BV 64), ``wscp2`` / ``wscp4`` / ``wscp8`` / ``wscp16`` / ``wscp32`` -
  forced to that many segments per sequence, ``wscp8b32`` / ``wscp16b32`` - at BV 32, all with exact start states;
  ``warm`` / ``warm2`` ... ``warm16`` - the same with the warm-up starts of ``kernels.forward.cp_warm``
  (``ForwardPlan.warm``); ``split2`` - ``warm2`` per (sequence, value head) where every segment start takes a
  warm-up, else the whole sequence at BV 32 in a kernel beside it (``ForwardPlan.split_heads``: no exact scan);
  ``exactcp`` - the dispatched plan with exact start states; ``seqorder`` - the dispatched plan with the ws kernel's
  sequences issued in index order (``ForwardPlan.longest_first`` off; the one-pass ws form reads it); ``again`` - the
  dispatched plan itself through the variants' path (its plan found once per layout, as theirs): what two equal
  columns differ by; ``noptab`` - the dispatched plan at the split precision with the ws kernel's P warpgroup
  computing P instead of reading the intra kernel's P tables (``ForwardPlan.p_table``; against ``split``);
  ``s1`` - the chunk-start state one term in both K S and Q S; ``ks1`` - one term in K S alone; ``ag1`` / ``x1`` /
  ``u1`` / ``upd1`` / ``p1`` - that one operand one term (``kernels.forward.precision``); ``single`` - every
  operand after the intra kernel one term (what the splits cost; the merges stay fp32); ``half`` - every such
  operand one fp16 term (precision "half": the ws form with P tables, BV by ``block_v``; not dispatched),
  ``half128`` - the same at 128 value columns a CTA (one CTA a value head), ``half128np`` - that without P tables (the
  ws kernel's WG1 forms P from the fp16 copies, once a value head);
  ``split`` - the dispatched plan at the split precision (``PRESETS["default"]``, what every other form
  runs); ``m1`` - the intra kernel's block merges as one-term wgmma operands, ``msplit`` - as 3-term splits (the
  dispatch's are fp32); these precision columns replace fields of the split precision;
* ``intra``, ``state``, ``output`` - the dispatched plan's three stages, timed in every run (``--variants``
                  accepts their names), each alone on the tables the stages
                  before it made once (``state``: the sequential state kernel, or with CP the scan, the fix-up and
                  the state kernel per segment; for the "ws" form the fused state-output kernel, and no
                  ``output``); where the time of ``default`` goes; ``cp`` - with CP, the part of ``state`` before
                  the state kernel (``segment_starts``: the scan and the fp64 fix-up);
* ``FLA``       - FLA's Triton kernels (every FLA dispatch backend off: ``parity.backends.fla_common``);
* ``FlashQLA``  - ``flash_qla.chunk_gated_delta_rule`` (skipped with the reason if unavailable);
* ``flashinfer`` / ``flashinfer-cake`` / ``cudnn`` - FlashInfer's GDN prefill paths as the engines call them
                  (parity.backends.flashinfer: checked through the adapter; timed on inputs converted once, the
                  call alone), each where it runs on this GPU (else skipped with the backend's reason).

TFLOP/s use one algorithmic count for everyone (per 64-token chunk and value head, K = V = D):
KK^T + QK^T + Tinv K + Tinv V + P U (2 C^2 (3 D + 2 D)) and W S, Q S, K^T U (3 x 2 C D^2), i.e.
~11.5 MFLOP per chunk-head at D = 128.  The summary's ratios are FLA/x and FlashQLA/x for the
best of our variants and for ``default`` (> 1: ours faster).

The summary table is appended to ``benchmarks/RESULTS.md`` (``benchmarks/record.py``) unless ``--dry-run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.inputs import D, DEFAULT_SHAPES, GATES, SHAPES, make, shrunk  # noqa: E402
from benchmarks.rounds import host_cell, interleave, median_of, paired_table, spread  # noqa: E402
from kernels.forward.precision import PRESETS, Precision  # noqa: E402
from parity.execute import describe_error  # noqa: E402

C = 64


def flops(B, T, HV, lens):
    n_chunks = sum(-(-L // C) for L in lens) if lens else B * -(-T // C)
    per = 2 * C * C * (3 * D + 2 * D) + 3 * 2 * C * D * D
    return n_chunks * HV * per


def fla_triton():
    """(FLA's chunk_gated_delta_rule on its Triton kernels, ``parity.backends.fla_common``, None) or (None, why)."""
    from parity.backends.fla_common import triton_chunk_gated_delta_rule

    try:
        return triton_chunk_gated_delta_rule(), None
    except Exception as e:  # noqa: BLE001 - a column that cannot run is skipped with the reason
        return None, describe_error(e)


def flash_qla():
    """(flash_qla.chunk_gated_delta_rule, None) where parity's ``flash-qla`` backend is available here, else
    (None, why)."""
    from parity.backends import get_backend

    ok, why = get_backend("flash-qla").available()
    if not ok:
        return None, why
    try:
        import flash_qla as fq
    except Exception as e:  # noqa: BLE001
        return None, describe_error(e)
    return fq.chunk_gated_delta_rule, None


def _rv(cp=None, bv=64):        # (the split precision: fp16 operands are a form of the ws kernel)
    return lambda p, n, HV, mc: dict(state_form="rv", block_v=bv, ctas_per_sm=1, p_table=False, warm=False,
                                     cp=cp if cp is not None else cp_segments(n, HV, mc), precision=PRESETS["default"])


def _smem(bv=None, occ=1):
    return lambda p, n, HV, mc: dict(state_form="smem", block_v=bv or block_v(n, HV, occ), ctas_per_sm=occ, cp=1,
                                     p_table=False, warm=False, precision=PRESETS["default"])


def _ws(bv=None, cp=1, warm=False):
    return lambda p, n, HV, mc: dict(state_form="ws", block_v=bv or block_v(n, HV), ctas_per_sm=1, cp=cp,
                                     p_table=True, warm=warm and cp > 1)


def _wscp(cp=None, bv=64, warm=False):  # (the split precision: fp16 operands' value scales are per sequence)
    return lambda p, n, HV, mc: dict(_ws(bv, cp or ws_cp_segments(n, HV, mc), warm)(p, n, HV, mc),
                                     precision=PRESETS["default"])


def _prec(**fields):
    """The dispatched plan at the split precision (``PRESETS["default"]``) with ``fields`` replaced."""
    return lambda p, n, HV, mc: dict(precision=dataclasses.replace(PRESETS["default"], **fields))


def cp_segments(n, HV, mc):
    from kernels.plan import cp_segments as f
    return f(n, HV, mc)


def ws_cp_segments(n, HV, mc):
    from kernels.plan import ws_cp_segments as f
    return f(n, HV, mc)


def block_v(n, HV, occ=1):
    from kernels.plan import block_v as f
    return f(n, HV, occ)


VARIANTS = {
    # name: (dispatched plan, sequences, value heads, most chunks of a sequence) -> ForwardPlan fields to replace
    "rv": _rv(cp=1),
    "rvcp": _rv(),
    "cp4": _rv(cp=4),
    "bv128": _rv(cp=1, bv=128),
    "smem": _smem(),
    "smem16": _smem(16),
    "smem32": _smem(32),
    "smem64": _smem(64),
    "occ": _smem(occ=2),
    "occ16": _smem(16, 2),
    "occ32": _smem(32, 2),
    "ws": _ws(),
    "ws16": _ws(16),
    "ws32": _ws(32),
    "ws64": _ws(64),
    "wscp": _wscp(),
    "wscp2": _wscp(2),
    "wscp4": _wscp(4),
    "wscp8": _wscp(8),
    "wscp16": _wscp(16),
    "wscp32": _wscp(32),
    "wscp8b32": _wscp(8, 32),
    "wscp16b32": _wscp(16, 32),
    "warm": _wscp(warm=True),
    "warm2": _wscp(2, warm=True),
    "warm4": _wscp(4, warm=True),
    "warm8": _wscp(8, warm=True),
    "warm16": _wscp(16, warm=True),
    "split2": lambda p, n, HV, mc: dict(_wscp(2, warm=True)(p, n, HV, mc), split_heads=True),
    "exactcp": lambda p, n, HV, mc: dict(warm=False),
    "seqorder": lambda p, n, HV, mc: dict(longest_first=False),
    "again": lambda p, n, HV, mc: {},         # the dispatched plan through this path: the variants' noise floor
    "noptab": lambda p, n, HV, mc: dict(p_table=False, precision=PRESETS["default"]),
    "s1": _prec(s="bf16", ks="bf16"),
    "ks1": _prec(ks="bf16"),
    "ag1": _prec(ag="bf16"),
    "x1": _prec(x="bf16"),
    "u1": _prec(u="bf16"),
    "upd1": _prec(upd="bf16"),
    "p1": _prec(p="bf16"),
    "split": _prec(),
    # every Precision field but the intra kernel's merges
    "single": _prec(**{f.name: "bf16" for f in dataclasses.fields(Precision) if f.name != "merge"}),
    "half": lambda p, n, HV, mc: dict(_ws()(p, n, HV, mc), precision=PRESETS["half"]),
    "half128": lambda p, n, HV, mc: dict(_ws(128)(p, n, HV, mc), precision=PRESETS["half"]),
    "half128np": lambda p, n, HV, mc: dict(_ws(128)(p, n, HV, mc), precision=PRESETS["half"], p_table=False),
    "m1": _prec(merge="bf16"),
    "msplit": lambda p, n, HV, mc: dict(_prec(merge="split")(p, n, HV, mc), p_table=False),  # no q tile for P
}
DEFAULT_VARIANTS = "default,rv,rvcp,smem"   # the others on request
STAGE_COLUMNS = ("intra", "cp", "state", "output")   # the dispatched plan's stages, timed in every run


def planned(impl, prepare, plan_for, change):
    """``impl`` with the plan ``change`` makes of the dispatched one, computed once per input layout (outside the
    timed calls)."""
    from kernels.interface import max_chunks
    cache = {}

    def run(*a, **k):
        cu = k.get("cu_seqlens")
        key = (tuple(a[0].shape), tuple(a[2].shape), id(cu), k.get("initial_state") is not None)
        if key not in cache:
            x = prepare(*a, **k)
            p = plan_for(x)
            cache[key] = dataclasses.replace(p, **change(p, x.N, x.HV, max_chunks(x.B, x.T, x.cu_host)))
        return impl(*a, **k, plan=cache[key])
    return run


# correctness cases of step 1: (name, B, T, H, HV, varlen lengths, h0 std, state_v_first)
CHECKS = [
    ("B1_T8192_H4_HV8", 1, 8192, 4, 8, None, None, False),
    ("varlen4_h0_vfirst_H4_HV8", 1, 8192, 4, 8, [5000, 63, 3000, 129], 1.0, True),
]


def enqueue_ms(fn, dev, reps: int = 20) -> float | None:
    """Host time per call (ms) of ``reps`` calls issued back to back without synchronising (CUDA only): the
    Python, argument checking and launch cost a call puts on the host.  When it reaches the call's GPU time, the
    GPU waits for the host and do_bench measures the host."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    return dt * 1e3


def _needed_configs(variants, shapes):
    from kernels.plan import forward_plan
    cfgs = []
    todo = [(SHAPES[name][0], SHAPES[name][1], SHAPES[name][3], SHAPES[name][4]) for name in shapes]
    todo += [(c[1], c[2], c[4], c[5]) for c in CHECKS]
    for B, T, HV, lens in todo:
        n = len(lens) if lens else B
        mc = max(-(-x // C) for x in lens) if lens else -(-T // C)
        p = forward_plan("bfloat16", n, HV, mc)
        cfgs += p.configs()
        for v in variants:
            if v in VARIANTS:
                cfgs += dataclasses.replace(p, **VARIANTS[v](p, n, HV, mc)).configs()
    return list(dict.fromkeys(cfgs))


def precompile(cfgs, workers):
    from kernels.build import precompile as _pre
    _pre(cfgs, workers, log=lambda m: print(m, flush=True))


FLASHINFER_PATHS = ("flashinfer", "flashinfer-cake", "cudnn")


def flashinfer_columns(dev) -> tuple[dict, dict]:
    """({column: backend} of the FlashInfer paths that run here, {column: reason} of the others)."""
    from cases.case import Case
    from parity.backends import get_backend

    cols, why = {}, {}
    for name in FLASHINFER_PATHS:
        b = get_backend(name)
        ok, reason = b.available()
        if ok:
            ok, reason = b.supports(Case(K=D, V=D), dev)
        if ok:
            cols[name] = b
        else:
            why[name] = reason
    return cols, why


def gdn_inputs(q, k, v, g, beta, initial_state=None, output_final_state=True, state_v_first=False, cu_seqlens=None):
    """The benchmark's call arguments as parity's GDNInputs (what the FlashInfer adapters take)."""
    from cases.inputs import GDNInputs

    return GDNInputs(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                     state_v_first=state_v_first)


def _outputs(res):
    return res.o, res.final_state


def ratio_table(rows: dict, refs: list, ours: str = "default") -> list[str]:
    """Lines of reference ms / ``ours`` ms per shape (> 1: ours faster) for each reference column in ``refs``, and
    against the fastest of them (named): the targets' form.  ``rows``: {shape: {column: ms or None}}."""
    if not refs:
        return []
    out = ["", f"{ours} against each reference: reference ms / ours ms (> 1: ours faster)",
           f"{'shape':<24}" + "".join(f"{c:>12}" for c in refs) + "   fastest"]
    for name, row in rows.items():
        mine = row.get(ours)
        have = {c: row[c] for c in refs if row.get(c)}
        line = f"{name:<24}" + "".join(f"{('%.2f' % (have[c] / mine)) if mine and c in have else '-':>12}"
                                       for c in refs)
        if mine and have:
            best = min(have, key=have.get)
            line += f"   {have[best] / mine:.2f} ({best} {have[best]:.3f} ms)"
        out.append(line)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3,
                    help="time every column this many times per shape, interleaved (benchmarks.rounds): medians "
                         "over the rounds, and per-round paired ratios against default")
    ap.add_argument("--workers", type=int, default=min(10, os.cpu_count() or 1))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of the reference columns not to run (FLA, FlashQLA, "
                    "flashinfer: every FlashInfer path), e.g. when only our stages are timed")
    ap.add_argument("--results", default=None, help="append the summary here (default benchmarks/RESULTS.md; "
                    "a dry run appends only when given)")
    ap.add_argument("--gates", default="logsigmoid", choices=GATES,
                    help="g = logsigmoid(N(0,1)) (default) or the qwen-gates distribution's (module docstring)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU plumbing test: the torch emulation stands in for the kernels, shapes shrink 256x, "
                         "no compile, FLA/FlashQLA off")
    args = ap.parse_args(argv)

    from benchmarks import record
    from kernels.forward.pipeline import plan_for, prepare
    from parity.metrics import compare
    from reference import chunk_gated_delta_rule as fp64_reference

    if args.dry_run:
        from kernels.forward import emulation as E
        from kernels.forward.precision import preset
        dev = torch.device("cpu")
        table = shrunk(SHAPES)

        def do_bench(fn, warmup, rep, return_mode):
            t = time.time()
            fn()
            return (time.time() - t) * 1e3

        class kernels:  # noqa: N801 - stands in for the package
            chunk_gated_delta_rule = staticmethod(E.chunk_gated_delta_rule)

        def ours_impl(*a, **kw):
            return E.chunk_gated_delta_rule(*a, **kw)

        def stage_fns(q, k, v, g, beta, cu_seqlens=None):
            Bq, Tq = q.shape[:2]
            cu = [int(x) for x in cu_seqlens.tolist()] if cu_seqlens is not None else [b * Tq for b in range(Bq + 1)]
            offs = E.chunk_tables(cu)[1]
            rows = lambda x: x.reshape(Bq * Tq, *x.shape[2:])   # noqa: E731
            q2, k2, v2 = rows(q), rows(k), rows(v)
            prec = preset()

            def intra():
                return E.intra_chunk(q2, k2, rows(g).float(), rows(beta).float(), cu, q.shape[-1] ** -0.5, False,
                                     q.dtype, prec)
            Ah, Al, F = intra()

            def state():
                return E.chunk_states(k2, v2, Ah, Al, F, cu, offs, None, q.dtype, prec)
            Sch, Scl, Uh, Ul, _ = state()
            return {"intra": intra, "state": state,
                    "output": lambda: E.output(q2, k2, F, Sch, Scl, Uh, Ul, cu, q.dtype, prec)}

        def plan_for(x):                     # the emulation's plan: no CUDA device to prepare for
            from kernels.plan import forward_plan
            return forward_plan("bfloat16", x.N, x.HV, x.mc)

        def prepare(q, k, v, g, beta, **kw):
            from types import SimpleNamespace
            cu = kw.get("cu_seqlens")
            cu_host = None if cu is None else [int(x) for x in cu.tolist()]
            from kernels.interface import max_chunks
            B, T, HV = q.shape[0], q.shape[1], v.shape[2]
            return SimpleNamespace(N=B if cu is None else len(cu_host) - 1, HV=HV, B=B, T=T, cu_host=cu_host,
                                   mc=max_chunks(B, T, cu_host))

    else:
        table = SHAPES
        if not torch.cuda.is_available():
            print("no CUDA device")
            return 2
        from triton.testing import do_bench

        import kernels
        from kernels.forward import pipeline as fp
        from kernels.forward.pipeline import chunk_gated_delta_rule as ours_impl
        dev = torch.device("cuda")

        def stage_fns(q, k, v, g, beta, cu_seqlens=None):
            x = prepare(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)
            plan = plan_for(x)
            tables = fp.intra_chunk(x=x, plan=plan)
            cp = {"cp": lambda: fp.segment_starts(x=x, plan=plan, tables=tables)} if plan.cp > 1 else {}
            if plan.state_form == "ws":         # o comes from the fused state kernel: no output stage
                def state_output():
                    segments = fp.segment_starts(x=x, plan=plan, tables=tables) if plan.cp > 1 else None
                    return fp.state_output(x=x, plan=plan, tables=tables, segments=segments)
                return {"intra": lambda: fp.intra_chunk(x=x, plan=plan), **cp, "state": state_output}

            def state():
                return (fp.state if plan.cp <= 1 else fp.state_segmented)(x=x, plan=plan, tables=tables)
            states = state()
            return {"intra": lambda: fp.intra_chunk(x=x, plan=plan), **cp, "state": state,
                    "output": lambda: fp.output(x=x, plan=plan, tables=tables, states=states)}

    t_start = time.time()
    print(f"device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (dry run)'}  "
          f"torch {torch.__version__}", flush=True)
    shapes = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v != "default" and v not in VARIANTS and v not in STAGE_COLUMNS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; --variants takes default, {', '.join(VARIANTS)} (the "
                 f"stage columns {', '.join(STAGE_COLUMNS)} are timed in every run)")
    variants = [v for v in variants if v not in STAGE_COLUMNS]    # (timed in every run)

    skip = {c for c in args.skip.split(",") if c}
    if skip - {"FLA", "FlashQLA", "flashinfer"}:
        ap.error(f"--skip takes FLA, FlashQLA, flashinfer; got {sorted(skip - {'FLA', 'FlashQLA', 'flashinfer'})}")
    off = "dry run" if args.dry_run else None
    fla, fla_reason = (None, off or "--skip") if off or "FLA" in skip else fla_triton()
    fqla, fqla_reason = (None, off or "--skip") if off or "FlashQLA" in skip else flash_qla()
    print("== step 0: compile ==", flush=True)
    if not args.dry_run:
        precompile(_needed_configs(variants, shapes), args.workers)
        if fqla is not None:            # FlashQLA's JIT, one process per shape
            from benchmarks.warm_references import warm
            warm("benchmarks.bench_kernels_fwd:flash_qla", shapes, args.workers, gates=args.gates)
    skipped = {}
    if fla is None:
        skipped["FLA"] = fla_reason
    if fqla is None:
        skipped["FlashQLA"] = fqla_reason
    fi_cols, fi_why = ({}, {}) if off or "flashinfer" in skip else flashinfer_columns(dev)
    skipped.update(fi_why)

    def ours_fn(v):
        if v == "default":
            return kernels.chunk_gated_delta_rule
        return planned(ours_impl, prepare, plan_for, VARIANTS[v])

    if not args.no_check:
        checks = [(x, ours_fn(x)) for x in variants]
        if fla is not None:
            checks.append(("FLA", fla))
        if fqla is not None:
            checks.append(("FlashQLA", fqla))
        for col, b in fi_cols.items():
            checks.append((col, lambda *a, _b=b, **kw: _outputs(_b.run(gdn_inputs(*a, **kw)))))
        for cname, B, T, H, HV, lens, h0std, vfirst in CHECKS:
            if args.dry_run:
                T = T // 256
                lens = [max(1, x // 256) for x in lens] if lens else None
                T = sum(lens) if lens else T
            print(f"\n== step 1: correctness on {cname} (rel_rmse vs fp64 reference) ==", flush=True)
            q, k, v, g, beta, cu = make(B, T, H, HV, lens, dev, gates=args.gates)
            h0 = None
            if h0std is not None:
                gen = torch.Generator(device=dev).manual_seed(1)
                n = len(lens) if lens else B
                h0 = h0std * torch.randn(n, HV, D, D, device=dev, generator=gen)
            kw = dict(initial_state=h0, output_final_state=True, state_v_first=vfirst, cu_seqlens=cu)
            o_ref, s_ref = fp64_reference(q, k, v, g, beta, **kw)
            floor = compare(o_ref.to(torch.bfloat16), o_ref).rel_rmse
            print(f"  bf16 rounding floor of o: {floor:.3e}")
            for name, fn in checks:
                try:
                    o, st = fn(q, k, v, g, beta, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    mo, ms = compare(o, o_ref), compare(st, s_ref)
                    bad = mo.nan_count + mo.inf_count + ms.nan_count + ms.inf_count
                    print(f"  check {name:<9} o {mo.rel_rmse:.3e} ({mo.rel_rmse / floor:.2f}x floor)"
                          f"  state {ms.rel_rmse:.3e}  nonfinite {bad}", flush=True)
                except Exception as e:
                    print(f"  check {name:<9} FAILED {describe_error(e)[:200]}", flush=True)
            del q, k, v, g, beta, o_ref, s_ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    print("\n== step 2: timing ==", flush=True)
    stage_cols = list(STAGE_COLUMNS)
    cols = variants + stage_cols + ["FLA", "FlashQLA"] + list(fi_cols)
    results, rounds_of = {}, {}
    hosts = {}
    interrupted = None
    try:
        for name in shapes:
            B, T, H, HV, lens = table[name]
            q, k, v, g, beta, cu = make(B, T, H, HV, lens, dev, gates=args.gates)
            fns = {}
            for x in variants:
                fns[x] = (lambda f=ours_fn(x): f(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu))
            try:
                fns.update(stage_fns(q, k, v, g, beta, cu_seqlens=cu))
            except Exception as e:
                for c in stage_cols:
                    skipped.setdefault(c, describe_error(e)[:160])
            if fla is not None:
                fns["FLA"] = lambda: fla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
            if fqla is not None:
                fns["FlashQLA"] = lambda: fqla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
            for col, b in fi_cols.items():
                fns[col] = b.prepared_call(gdn_inputs(q, k, v, g, beta, cu_seqlens=cu))
            row, host, timers = {}, {}, {}
            for col, fn in fns.items():
                t0 = time.time()
                try:
                    with torch.no_grad():
                        fn()  # compile / autotune outside the timing
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                        host[col] = enqueue_ms(fn, dev)
                    timers[col] = (lambda fn=fn: (do_bench(fn, warmup=args.warmup, rep=args.rep,
                                                           return_mode="median"),))
                except Exception as e:
                    skipped.setdefault(col, describe_error(e)[:160])
                    print(f"  {name:<24} {col:<9} failed (setup {time.time() - t0:.1f} s)", flush=True)
            with torch.no_grad():
                per_round = interleave(timers, args.rounds,
                                       on_error=lambda c, e: skipped.setdefault(c, describe_error(e)[:160]))
            for col in fns:
                got = per_round.get(col) or []
                row[col] = median_of(got, 0)
                hms, sp = host.get(col), spread(got, 0)
                print(f"  {name:<24} {col:<9} {('%.3f ms' % row[col]) if row[col] else 'failed':>10} "
                      f"{('host %.3f ms' % hms) if hms else '':>15}"
                      + (f"  rounds {len(got)}, spread {100 * sp:.0f}%" if sp is not None else ""), flush=True)
            rounds_of[name] = per_round
            n = len(lens) if lens else B
            results[name] = (row, flops(B, T, HV, lens), block_v(n, HV))     # the smem kernel's dispatched BV
            hosts[name] = host
            del q, k, v, g, beta, cu
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:        # SIGINT (e.g. a timeout): the shapes done so far are still reported
        interrupted = record.interrupted(len(results), len(shapes))
        print(f"\n{interrupted}", flush=True)

    title = "forward with final state, bf16" + (", qwen gates" if args.gates == "qwen" else "")
    print(f"\n== summary: {title}, median ms (TFLOP/s) [{time.time() - t_start:.0f} s] ==")
    table = [f"{title}, median ms (TFLOP/s)",
             f"{'shape':<24}{'autoBV':>7}" + "".join(f"{c:>15}" for c in cols)]
    for name, (row, fl, bv) in results.items():
        line = f"{name:<24}{bv:>7}"
        for c in cols:
            ms = row.get(c)
            line += f"{('%.3f (%.0f)' % (ms, fl / ms / 1e9)) if ms else '-':>15}"
        table.append(line)
    refs = [c for c in ["FLA", "FlashQLA"] + list(fi_cols) if any(r.get(c) for r, _, _ in results.values())]
    table += ratio_table({name: row for name, (row, _, _) in results.items()}, refs)
    if args.rounds > 1:
        table += paired_table(rounds_of, [c for c in cols if c not in stage_cols], "default")
    if interrupted:
        table += ["", interrupted]
    print("\n".join(table[1:]))
    if not args.dry_run or args.results:
        print("appended to", args.results or record.RESULTS, "as:",
              record.append("benchmarks/bench_kernels_fwd.py", table, **({"path": args.results} if args.results
                                                                            else {})))
    print("\nhost ms per call (launches enqueued without waiting; * where it reaches 0.9 of the median above: there "
          "the time is the host's, not the GPU's)")
    print(f"{'shape':<24}{'':>7}" + "".join(f"{c:>15}" for c in cols))
    for name, host in hosts.items():
        row = results.get(name, ({},))[0]
        print(f"{name:<24}{'':>7}" + "".join(f"{host_cell(host.get(c), row.get(c)):>15}" for c in cols))
    print("\nratios (> 1: ours faster): FLA/x and FlashQLA/x")
    for name, (row, fl, bv) in results.items():
        ours = {c: row[c] for c in variants if row.get(c)}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        parts = []
        for c in ("default", best):
            if c in ours:
                r1 = row["FLA"] / ours[c] if row.get("FLA") else None
                r2 = row["FlashQLA"] / ours[c] if row.get("FlashQLA") else None
                parts.append(f"{c}: FLA/x {('%.2f' % r1) if r1 else '-'}  FQLA/x {('%.2f' % r2) if r2 else '-'}")
        print(f"  {name:<24} best={best:<8} " + " | ".join(parts))
    for c, why in skipped.items():
        print(f"column {c} skipped/failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
