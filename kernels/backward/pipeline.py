"""Host pipeline of the TileLang GDN backward (Hopper, sm_90a).

``chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, plan=None, saved_tables=None,
stages=None, events=None) -> (dq, dk, dv, dg, dbeta, dh0)``

Shapes and dtypes as the forward (``kernels.forward.pipeline``); ``do`` like the forward's o, ``dht`` like the
final state (fp32, the caller's layout; None = 0).  Returns dq, dk, dv in the input dtype, dg and dbeta in the
dtypes of g and beta, dh0 fp32 in the initial state's layout (None without an initial state).

Stages (kernels in brackets; which ones run is ``kernels.plan``'s ``BackwardPlan``):
  1. ``prep`` [gdn_bwd_prep] (chunk, head): Tinv and Ag = Tinv diag(beta) split, the gate table, dUloc^T; on the
     forward's saved Tinv and Ag (``saved_tables``) only the gate table and dUloc^T;
  2. ``dh`` [gdn_bwd_dh] (64 value cols, head, seq): the reverse sequential pass (dS' tables, dY, dv, dh0); with
     a segment plan one launch over segments of the sequences, each from its warm-up chunks
     [gdn_bwd_dh_warm] (``plan.dh_warm``), or three passes and a scan (``dh_segmented``; the forward's
     gdn_cp_fixup over the segments in reverse order);
  3. ``recompute`` [the forward's smem state kernel, or its ws tables form (``recompute_ws``), precision
     "recompute"; with ``recompute_cp`` per CP segment after the forward's gdn_scan_rv and gdn_cp_fixup; with
     ``recompute_warm`` per dh segment from warm-up chunks, gdn_state_tables_ws_warm]: the
     chunk-start states S and U
     (hi + lo, key-first) from prep's Ag and gate table, launched after dh (which does not read them): on a side
     stream beside it where the plan overlaps them, else after it on the main stream;
  4. ``dqk`` [gdn_bwd_dqk] (chunk, head): the state products and 64x64 terms -> dq~, dk~, row dots, dg / dbeta
     terms; GVA groups of 2, 4, 8 summed in the kernel (clusters), others by [gdn_bwd_group_sum];
  5. ``dg_dbeta`` [gdn_bwd_dg_dbeta] and ``finish.finish`` (torch): dg, dbeta, the L2-norm chain rule.

With ``plan.fused`` (the one-term plan on fp16 operands), stages 2-4 are the recompute, then ``fused``
[gdn_bwd_fused] (value head, seq): dh's and dqk's outputs in one launch, dUloc formed in it (prep's table unread),
no dS' or dY tables; the GVA group sums by [gdn_bwd_group_sum].

``plan``: another plan value (a benchmark's alternative), or a function of the dispatched plan returning the plan
to run; a one-term plan runs on v, dO, h0, dht under powers of two per GVA group (``scales``; the gradients scaled
back) and, where its dtype is not the inputs' (``io_dtype``), on q, k, v, dO converted to it by ``gdn_bwd_convert``,
without saved tables, returning the caller's dtypes.  ``saved_tables``: the
forward's ``{"Th", "Ah", "Al"}`` (each [HV, NC, 64, 64] in the input dtype), used where the plan reads them; a
``HandedTables`` is emptied once prep has run, so that the tables' memory is reused once dh and the recompute have
read them (the call's own buffers are freed likewise where no later stage reads them: dUloc^T before dqk, the chunk
states and their gradients after it).  ``stages`` (debugging): a dict that receives the intermediates in the
emulation's layouts (``STAGE_LAYOUT``).  ``events`` (profiling): a list that receives ``(stage name,
torch.cuda.Event)`` after each stage (the first, "start", before the first launch; "convert" after a plan's
conversion); ``stage_times`` turns it into ms per stage.  No host sync except building a new varlen layout's tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from kernels.forward.pipeline import (ForwardInputs, IntraTables, fix_segment_starts, initial_states, launch_order,
                                     no_states, prepare, segment_maps, segment_starts)
from kernels.interface import side_stream as _side_stream
from kernels.interface import (BT, LO8_DTYPE, TL_DTYPE, TORCH_DTYPE, cached,
                               fp32_state, index_order, max_chunks, pad_rows, tma_ready, token_rows, unused)

from .finish import finish, group_sum
from .scales import scale_states, state_bits, unscale

# layouts of the ``stages`` intermediates, the same in both implementations; every value as fp32 / fp64
STAGE_LAYOUT = {
    "Tinv": "[HV, NC, 64, 64]  (I + A)^-1 (hi + lo)", "Fb": "[HV, NC, 8, 64]  gate table",
    "dUloc": "[HV, NC, 64, DV]  P^T dO", "dY": "[HV, NC, 64, DV]  Tinv^T dU (hi + lo)",
    "U": "[HV, NC, 64, DV]  forward U (hi + lo)", "S": "[HV, NC, DK, DV]  chunk-start state (hi + lo)",
    "dSn": "[HV, NC, DK, DV]  chunk-end state gradient (hi + lo)",
    "qz": "[HV, NC, 64]", "kw": "[HV, NC, 64]", "kr": "[HV, NC, 64]", "yv": "[HV, NC, 64]", "sd": "[HV, NC, DV]",
    "rect": "[HV, NC, 64]", "db2": "[HV, NC, 64]",
    "dqv": "[Ttot, H, DK]  dq~ summed over each group's value heads", "dkv": "[Ttot, H, DK]  dk~ likewise",
}
# the forward's intra tables the backward reads (``saved_tables``' keys)
SAVED_TABLES = ("Th", "Ah", "Al")


class HandedTables(dict):
    """``saved_tables`` handed over to one backward, which empties it once read (its holder keeps no copy)."""


@dataclass
class BackwardInputs:
    x: ForwardInputs                # the forward's inputs of the call
    do: torch.Tensor                # [Ttot, HV, D] input dtype
    dht: torch.Tensor | None        # [N, HV, D, D] fp32 contiguous, the caller's layout


def prepare_backward(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                     use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None) -> BackwardInputs:
    """Check the arguments (``ValueError`` naming the first bad one) and lay them out for the kernels."""
    x = prepare(q, k, v, g, beta, scale, initial_state, False, use_qk_l2norm_in_kernel, state_v_first, cu_seqlens)
    if tuple(do.shape) != (x.B, x.T, x.HV, x.V):
        raise ValueError(f"do must be [B, T, HV, V] = {(x.B, x.T, x.HV, x.V)}, got {tuple(do.shape)}")
    if dht is not None:
        want = (x.N, x.HV, x.V, x.K) if x.v_first else (x.N, x.HV, x.K, x.V)
        if tuple(dht.shape) != want:
            raise ValueError(f"dht must be {want}, got {tuple(dht.shape)}")
    do2 = tma_ready(token_rows(do.reshape(x.B * x.T, x.HV, x.V), x.n_tok).to(q.dtype))
    return BackwardInputs(x, do2, None if dht is None else fp32_state(dht))


def plan_for(b: BackwardInputs):
    """``kernels.plan.backward_plan`` of the call ``b`` (the reverse pass's segment plan cached per layout)."""
    from kernels.plan import backward_plan
    x = b.x
    return backward_plan(TL_DTYPE[x.q.dtype], x.H, x.HV, x.NC, x.N,
                         _dh_plan(x.B, x.T, x.cu_host, x.HV, dh_value_blocks(x.D), x.q.device), DK=x.D,
                         max_chunks=max_chunks(x.B, x.T, x.cu_host))


def with_fused_segments(plan, b: BackwardInputs):
    """``plan`` with ``fused_segments`` for the call ``b``'s layout (cached) where it runs the fused kernel over
    segments (``fused`` with ``fused_warm`` or ``fused_exact``): built only for such plans, since a new layout's
    tables cost host copies."""
    if not (plan.fused and (plan.fused_warm or plan.fused_exact)) or plan.fused_segments is not None:
        return plan
    x = b.x
    return dataclasses.replace(plan, fused_segments=_dh_plan(x.B, x.T, x.cu_host, x.HV, 1, x.q.device))


def runs_fused(q, v, cu_seqlens=None) -> bool:
    """Whether the dispatched backward of a call with these q ([B, T, H, K]), v ([B, T, HV, V]) and ``cu_seqlens``
    is the fused one-term plan (``kernels.plan.dispatches_fused``; from the shapes alone, no host synchronisation)."""
    from kernels.plan import dispatches_fused
    if q.dtype not in TL_DTYPE or q.dim() != 4 or v.dim() != 4:
        return False
    n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return dispatches_fused(TL_DTYPE[q.dtype], v.shape[2], n_seq, q.shape[-1])


def reads_saved_tables(q, v=None, cu_seqlens=None) -> bool:
    """Whether the backward of a call with this q ([B, T, H, K]) reads the forward's intra tables: wherever the
    forward runs, since the dispatched reverse pass (sequential or warm segmented, whatever the layout) reads them
    (``BackwardPlan.takes_saved_tables``), except where the dispatched plan is the fused one (``runs_fused`` of q,
    v [B, T, HV, V] and ``cu_seqlens``, where v is given), which computes its own.  The autograd Function asks before
    its forward, so that it keeps no tables the backward would not read."""
    from kernels.forward.configs import HEAD_DIMS
    if not (q.dtype in TL_DTYPE and q.dim() == 4 and q.shape[-1] in HEAD_DIMS):     # else the forward refuses them
        return False
    return v is None or not runs_fused(q, v, cu_seqlens)


def dh_value_blocks(D: int) -> int:
    """CTAs of ``gdn_bwd_dh`` per (value head, sequence) at head dim ``D``: one per 64 value columns."""
    return D // 64


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                               use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, plan=None,
                               saved_tables: dict | None = None, stages: dict | None = None,
                               events: list | None = None):
    """The backward (module docstring)."""
    b = prepare_backward(q, k, v, g, beta, do, dht, scale, initial_state, use_qk_l2norm_in_kernel, state_v_first,
                         cu_seqlens)
    x = b.x
    if x.NC == 0:
        return _empty_gradients(b, g, beta, initial_state)
    if plan is None or callable(plan):
        plan = plan(plan_for(b)) if plan else plan_for(b)
    plan = with_fused_segments(plan, b)
    if plan.fused and stages is not None:
        raise ValueError("stages: the fused backward (plan.fused) stores no dS' or dY tables to record")
    mark = _marker(events)
    mark("start")
    out_dt = x.q.dtype                  # the caller's
    if plan.dtype != TL_DTYPE[out_dt] and (plan.io_dtype != TL_DTYPE[out_dt] or plan.reads_saved_tables):
        # the plan's kernels take another input dtype: q, k, v, dO converted to it, dv, dq, dk stored in the
        # caller's (``io_dtype``); no saved tables (the forward's are in the caller's dtype)
        raise ValueError(f"a {plan.dtype} plan for {out_dt} inputs needs io_dtype {TL_DTYPE[out_dt]} and no "
                         f"saved tables; got io_dtype={plan.io_dtype!r}, reads_saved_tables="
                         f"{plan.reads_saved_tables}")
    saved = saved_tables if plan.takes_saved_tables else None
    b, f, tables = scaled_prep(b=b, plan=plan, saved=saved, mark=mark)
    x = b.x
    from_saved, saved = saved is not None, None
    if isinstance(saved_tables, HandedTables):
        saved_tables.clear()
    mark("prep")
    maps = None
    if plan.shared_scan:
        maps = segment_maps_of(x=x, plan=plan, tables=tables)
        mark("scan")
    if plan.fused:
        tables = _without(tables, "Tl", "dUl")        # not read (dUloc^T formed in the fused kernel)
        if plan.fused_exact and plan.fused_segments is not None:      # the transfer maps over its segments
            maps = segment_maps_of(x=x, plan=plan, tables=tables, cp=plan.fused_segments)
        states = recompute(x=x, plan=plan, tables=tables, side=None, maps=None)
        mark("recompute")
        tables = _without(tables, "Agh", "Agl")       # read by the recompute only
        states = _without(states, "Scl", "Ul")        # the fused kernel reads S and U hi alone
        grads, terms = fused(b=b, plan=plan, tables=tables, states=states, factors=f, maps=maps)
        maps = None
        # S, U, v and dO are read by the fused kernel last: freed before the group sums allocate
        states, b = None, dataclasses.replace(b, do=None, x=dataclasses.replace(x, v=None))
        x = b.x
        terms = fused_group_sums(x=x, plan=plan, terms=terms, factors=f)
        mark("fused")
    else:
        side = _side_stream(x.q.device) if plan.overlap_recompute else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(x.q.device))   # prep launched: the recompute may follow
        grads = dh(b=b, plan=plan, tables=tables, saved=from_saved, maps=maps, factors=f)
        if stages is None:
            # dUloc^T and Tinv are read by dh alone: their memory is no longer allocated while the recompute's
            # outputs are (main-stream allocations that reuse it run after dh)
            tables = _without(tables, "Th", "Tl", "dUl")
        # the recompute after dh either way, so that its outputs are not allocated beside dh's inputs and outputs:
        # on the main stream, or on the side stream launched after dh (dh's CTAs are placed first), which the main
        # stream waits for before dqk
        if side is None:
            mark("dh")
            states = recompute(x=x, plan=plan, tables=tables, side=None, maps=maps)
            mark("recompute")
        else:
            states = recompute(x=x, plan=plan, tables=tables, side=side, maps=maps)
            mark("dh")
            torch.cuda.current_stream(x.q.device).wait_stream(side)
            mark("recompute (not hidden by dh)")
        maps = None
        if stages is None:
            # Ag is read by the recompute only: its memory serves dqk's outputs
            tables = _without(tables, "Agh", "Agl")
        terms = dqk(b=b, plan=plan, tables=tables, states=states, grads=grads, fp32_sums=stages is not None,
                    factors=f)
        mark("dqk")
        if stages is not None:
            _record_stages(stages, x=x, tables=tables, states=states, grads=grads, terms=terms,
                           from_saved=from_saved)
        states, grads = None, _without(grads, "dSh", "dSl", "dYh", "dYl")      # read by dqk last
    out = dg_dbeta(x=x, plan=plan, tables=tables, grads=grads, terms=terms, g=g, beta=beta,
                   has_h0=initial_state is not None, dt=out_dt)
    if f is not None:
        out = unscale(out, f, x.H, in_kernels=True)     # dq, dk, dv scaled back by dqk and dh_ws
    mark("finish")
    return out


def _io_dtype(plan, dt: torch.dtype) -> torch.dtype:
    """The dtype of dv, dq, dk: the caller's where the plan has an ``io_dtype``, else the kernels' ``dt``."""
    return TORCH_DTYPE[plan.io_dtype] if plan.io_dtype else dt


def scaled_prep(*, b: BackwardInputs, plan, saved: dict | None, mark=None):
    """(``b`` as the kernels after prep read it, the one-term plan's ``scales.factors`` [2, HV] or None, prep's
    tables): for a one-term plan the inputs' scaling (``_scaled``) and ``prep``, or where ``plan.converts_in_prep``
    the maxima and prep's converting form, which does both; else ``prep`` alone.  ``mark``: the stage marker
    ("convert" after the scaling or the maxima)."""
    mark = mark or (lambda name: None)
    if plan.converts_in_prep:
        bits = _maxima(b, plan)
        mark("convert")
        q, k, v, do, sf = _converted(b, plan)
        tables = prep(b=b, plan=plan, saved=None, convert=(bits, q, k, v, do, sf))
        return (*_with_converted(b, q, k, v, do, sf), tables)
    f = None
    if plan.one_term:                   # v, dO (and h0, dht) under powers of two per GVA group, in the plan's dtype
        b, f = _scaled(b, plan)
        mark("convert")
    return b, f, prep(b=b, plan=plan, saved=saved)


def _maxima(b: BackwardInputs, plan) -> torch.Tensor:
    """``bits [2, HV]`` int32: the ``magnitude_bits`` of the largest magnitudes of dO and dht (row 0), v and h0 (row
    1) per value head (``gdn_bwd_amax``; torch reduces h0 and dht where given)."""
    from kernels.build import get_kernel
    x = b.x
    bits = torch.zeros(2, x.HV, device=x.q.device, dtype=torch.int32)
    get_kernel(plan.amax_config())(x.v, b.do, bits)
    for row, s in ((0, b.dht), (1, x.h0)):
        if s is not None:
            torch.maximum(bits[row], state_bits(s), out=bits[row])
    return bits


def _converted(b: BackwardInputs, plan):
    """(q, k, v, dO in the plan's dtype, uninitialised: q, k themselves where already in it; ``sf [4, HV]``)."""
    x = b.x
    dt = TORCH_DTYPE[plan.dtype]
    v, do = torch.empty_like(x.v, dtype=dt), torch.empty_like(b.do, dtype=dt)
    q, k = (x.q, x.k) if dt == x.q.dtype else (torch.empty_like(t, dtype=dt) for t in (x.q, x.k))
    return q, k, v, do, torch.empty(4, x.HV, device=x.q.device, dtype=torch.float32)


def _with_converted(b: BackwardInputs, q, k, v, do, sf):
    """(``b`` on the converted inputs, with h0 and dht scaled by ``sf``'s powers of two; the factors ``sf[2:]``)."""
    x = dataclasses.replace(b.x, q=q, k=k, v=v, h0=scale_states(b.x.h0, sf[1]))
    return BackwardInputs(x, do, scale_states(b.dht, sf[0])), sf[2:]


def _scaled(b: BackwardInputs, plan):
    """(``b`` with v, dO, h0, dht times their GVA groups' powers of two and q, k, v, dO in the plan's dtype, the
    ``scales.factors`` [2, HV] that undo them): ``gdn_bwd_amax`` then ``gdn_bwd_convert``, which forms the
    exponents (no host synchronisation)."""
    from kernels.build import get_kernel
    if plan.converts_in_prep:
        raise ValueError("_scaled: this plan converts its inputs in prep (converts_in_prep); call scaled_prep")
    bits = _maxima(b, plan)
    q, k, v, do, sf = _converted(b, plan)
    x = b.x
    get_kernel(plan.convert_config())(x.q, x.k, x.v, b.do, bits, q, k, v, do, sf)
    return _with_converted(b, q, k, v, do, sf)


def _factors_arg(x: ForwardInputs, factors):
    """The ``factors`` argument of dh_ws, dqk and fused: a one-term plan's (``_scaled``'s), else a [2, HV] fp32
    tensor that their other forms do not read."""
    return factors if factors is not None else unused((2, x.HV), torch.float32, x.q.device)


def _with_last(kern, last, *args):
    """``kern(*args, last)``."""
    return kern(*args, last)


def _without(stage_out, *names):
    """``stage_out`` (a stage's dataclass) without its tensors ``names``, which no later stage reads: the pipeline's
    last references to them.  Their memory returns to the allocator at once; it is reused by later allocations on
    the main stream, which run after every kernel that reads them (the side stream's reads are recorded on it)."""
    return dataclasses.replace(stage_out, **dict.fromkeys(names))


@dataclass
class PrepTables:
    Th: torch.Tensor                # [HV, NC, 64, 64] Tinv hi
    Tl: torch.Tensor                # lo (Th itself, unread: from the forward's tables, or for a one-term plan)
    Agh: torch.Tensor               # [HV, NC, 64, 64] Ag = Tinv diag(beta), hi
    Agl: torch.Tensor               # lo
    Fb: torch.Tensor                # [HV, NC, 8, 64] fp32 gate table
    dUl: torch.Tensor               # [HV, NC, D, 64] fp32 dUloc^T
    Lb: torch.Tensor                # [HV, NC] fp32 the chunks' log2 norm bounds, read by the warm segmented forms
                                    # alone (an unread stand-in where prep stores none): every dh and ws recompute
                                    # form's bounds argument


def prep(*, b: BackwardInputs, plan, saved: dict | None, convert: tuple | None = None) -> PrepTables:
    """``gdn_bwd_prep`` (parallel): on the forward's Tinv and Ag when ``saved``, else computing them; with ``convert``
    (``bits, q2, k2, v2, do2, sf``: ``_maxima``'s bits and ``_converted``'s outputs) its converting form on the
    caller's inputs, its tables in the plan's dtype."""
    from kernels.build import get_kernel
    x = b.x
    dev = x.q.device
    cfg = plan.prep_config(saved is not None)
    if bool(cfg.io) != (convert is not None):
        raise ValueError(f"prep: {cfg.name} takes {'' if cfg.io else 'no '}converting arguments")
    dt = TORCH_DTYPE[plan.dtype] if convert is not None else x.q.dtype
    if saved is not None:       # the forward's Tinv (hi alone) and Ag
        _check_saved(saved, (x.HV, x.NC, BT, BT), dt, dev)
        Th, Agh, Agl = saved["Th"], saved["Ah"], saved["Al"]
        Tl = Th                 # not read: dh on these tables reads Tinv's hi term alone (``dh_config(saved)``)
    else:
        Th = torch.empty(x.HV, x.NC, BT, BT, device=dev, dtype=dt)
        Tl = Th if cfg.tinv_hi else torch.empty_like(Th)    # (Tinv hi alone: Tl neither written nor read)
        Agh, Agl = torch.empty_like(Th), torch.empty_like(Th)
    Fb = torch.empty(x.HV, x.NC, 8, BT, device=dev, dtype=torch.float32)
    if cfg.no_du:       # the fused kernel forms dUloc itself
        dUl = unused((1, 1, x.D, BT), torch.float32, dev)
    else:
        dUl = torch.empty(x.HV, x.NC, x.D, BT, device=dev, dtype=torch.float32)
    # the chunks' log2 norm bounds, read by the warm segmented pass alone: written by prep where it computes Tinv,
    # and on the saved tables where that pass runs
    bounds = saved is None or cfg.bounds
    Lb = (torch.empty(x.HV, x.NC, device=dev, dtype=torch.float32) if bounds
          else unused((x.HV, x.NC), torch.float32, dev))
    pre = ((x.q, x.k, x.v, b.do, x.g, x.beta, x.cu, x.chunk_indices, *convert) if convert is not None
           else (x.q, x.k, b.do, x.g, x.beta, x.cu, x.chunk_indices))
    get_kernel(cfg)(*pre, Th, Tl, Agh, Agl, Fb, dUl, Lb, x.scale, int(x.use_l2))
    return PrepTables(Th, Tl, Agh, Agl, Fb, dUl, Lb)


@dataclass
class RecomputedStates:
    Sch: torch.Tensor               # [HV, NC, D, D] chunk-start states, hi (key-first)
    Scl: torch.Tensor               # lo (Sch itself, unread, where the plan stores S hi alone; fp8 codes with lo8)
    Uh: torch.Tensor                # [HV, NC, 64, D] hi
    Ul: torch.Tensor                # lo (Uh itself, unread, where the plan stores U hi alone: one_term)


def segment_maps_of(*, x: ForwardInputs, plan, tables: PrepTables, cp=None) -> torch.Tensor:
    """``plan.shared_scan``: the forward's CP scan (``forward.pipeline.segment_maps``) on prep's Ag and gate table
    over dh's segments (or ``cp``'s): ZM [NS, HV, 2 D, D] fp32, ``[Z^T ; M^T]`` of every segment but the last."""
    cp = plan.dh_segments if cp is None else cp
    return segment_maps(x=x, plan=plan.recompute_cp_plan(), tables=IntraTables(tables.Agh, tables.Agl, tables.Fb, None),
                        scan_cu=cp.cu[:-1], scan_co=cp.chunk_offsets[:-1], n_seg=cp.cu.numel() - 1)


def recompute(*, x: ForwardInputs, plan, tables: PrepTables, side, maps=None) -> RecomputedStates:
    """The forward's chunk-start states S and U (hi + lo, key-first) by its smem state kernel (or its ws tables form,
    ``plan.recompute_ws``) on prep's Ag and gate table: one pass over every sequence, or with ``plan.recompute_cp``
    one per CP segment from the start states of the forward's exact ``segment_starts`` (the scan and the fp64 fix-up
    on the same tables), or with ``plan.shared_scan`` one per dh segment from the fix-up of ``maps``
    (``segment_maps_of``), or with ``plan.recompute_warm`` one per dh segment from its warm-up chunks (prep's
    bounds ``tables.Lb``); on the stream ``side`` when given: its outputs are then allocated on it (so that none
    reuses a buffer the main stream's pending kernels still read, such as dh's) and recorded on the main stream,
    which reads and frees them; its inputs recorded on it."""
    from kernels.build import get_kernel
    dev, dt, D = x.q.device, x.q.dtype, x.D
    cfg = plan.recompute_configs()[1]
    main = torch.cuda.current_stream(dev) if side is not None else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        Sch = torch.empty(x.HV, x.NC, D, D, device=dev, dtype=dt)
        # neither written nor read without S lo; fp8 codes under Sch's exponents with lo8 (kernels.common.lo8)
        Scl = torch.empty_like(Sch, dtype=LO8_DTYPE if cfg.lo8 else dt) if cfg.prec.s == "split" else Sch
        Uh = torch.empty(x.HV, x.NC, BT, D, device=dev, dtype=dt)
        Ul = torch.empty_like(Uh) if cfg.prec.u == "split" else Uh      # (U hi alone: neither written nor read)
        ht = no_states(x)                                      # the final state: not stored
        intra = IntraTables(tables.Agh, tables.Agl, tables.Fb, None)
        if plan.recompute_on_warm_segments:     # every dh segment from its warm-up chunks or its sequence's start
            cp = plan.dh_segments
            cu, co, use_h0, v_first = cp.cu, cp.warm_co, int(x.h0 is not None), int(x.v_first)
            h0 = initial_states(x)
        elif plan.shared_scan:          # every dh segment from its start state (value-first)
            cp = plan.dh_segments
            h0 = fix_segment_starts(x=x, plan=plan.recompute_cp_plan(), tables=intra, ZM=maps, seg_of=cp.seg_of,
                                    co=cp.seg_of)
            cu, co, use_h0, v_first = cp.cu, cp.chunk_offsets, 1, 1
        elif plan.recompute_cp > 1:     # every segment from its start state (value-first)
            cu, co, _, h0 = segment_starts(x=x, plan=plan.recompute_cp_plan(), tables=intra)
            use_h0, v_first = 1, 1
        else:
            cu, co, use_h0, v_first = x.cu, x.chunk_offsets, int(x.h0 is not None), int(x.v_first)
            h0 = initial_states(x)
        # the ws form's bounds (read by its warm form alone) and its sequences' order
        extra = (tables.Lb, launch_order(x, cu, plan.longest_first)) if cfg.form == "ws" else ()
        get_kernel(cfg)(x.k, x.v, tables.Agh, tables.Agl, tables.Fb, cu, co, h0, Sch, Scl, Uh, Ul, *extra, ht,
                        use_h0, 0, v_first)
    if side is not None:
        for t in (tables.Agh, tables.Agl) + ((maps,) if plan.shared_scan else ()) + extra:   # freed while the side
            t.record_stream(side)                                                           # stream may use them
        for t in (Sch, Scl, Uh, Ul):
            t.record_stream(main)
    return RecomputedStates(Sch, Scl, Uh, Ul)


@dataclass
class StateGradients:
    dSh: torch.Tensor               # [HV, NC, D, D] chunk-end state gradients dS', hi (value-first)
    dSl: torch.Tensor               # lo (fp8 codes with lo8; dSh itself, unwritten, with one_term)
    dYh: torch.Tensor               # [HV, NC, D, 64] dY, hi (value-first)
    dYl: torch.Tensor               # lo (dYh itself, unwritten, with one_term)
    dv: torch.Tensor                # [Ttot, HV, D] input dtype
    dh0: torch.Tensor               # [N or 1, HV, D, D] fp32 (the caller's layout)


def dh(*, b: BackwardInputs, plan, tables: PrepTables, saved: bool, maps=None, factors=None) -> StateGradients:
    """``gdn_bwd_dh``: the reverse sequential pass, or its segmented form (``plan.dh_segments``: in one warm
    launch, ``plan.dh_warm``, on prep's bounds ``tables.Lb``; else three passes, the transfer maps from ``maps``,
    ``segment_maps_of``' ZM, where given, instead of pass B); ``saved``: the tables' Tinv is the
    forward's (hi alone); ``factors`` (a one-term plan's, ``scales.factors``): dv stored times its row 0."""
    from kernels.build import get_kernel
    x = b.x
    dev, dt, D, HV = x.q.device, x.q.dtype, x.D, x.HV
    dSh = torch.empty(HV, x.NC, D, D, device=dev, dtype=dt)
    dYh = torch.empty(HV, x.NC, D, BT, device=dev, dtype=dt)
    if plan.one_term:           # no lo tables: the hi ones stand in, neither written nor read as lo
        dSl, dYl = dSh, dYh
    else:
        dSl = torch.empty_like(dSh, dtype=LO8_DTYPE if plan.lo8 else dt)
        dYl = torch.empty_like(dYh)
    dv = torch.empty(x.n_tok, HV, D, device=dev, dtype=_io_dtype(plan, dt))   # every token row stored (no zero fill)
    use_h0 = x.h0 is not None
    dh0 = torch.empty((x.N if use_h0 else 1), HV, D, D, device=dev, dtype=torch.float32)
    cfg = plan.dh_config(saved)
    kern = get_kernel(cfg)
    if cfg.ws_bv:               # dh_ws's last argument (every call below, the segmented passes' too)
        kern = functools.partial(_with_last, kern, _factors_arg(x, factors))
    t = tables
    if plan.dh_segments is None:
        dht = b.dht if b.dht is not None else unused((1, HV, D, D), torch.float32, dev)
        kern(x.q, x.k, b.do, t.Th, t.Tl, t.Fb, t.dUl, x.cu, x.chunk_offsets, dht, dSh, dSl, dYh, dYl, dv, dh0, t.Lb,
             int(b.dht is not None), int(use_h0), int(x.v_first))
    elif plan.segmented_warm:   # one launch over the segments, dht and dh0 per sequence in the caller's layout
        cp = plan.dh_segments
        dht = b.dht if b.dht is not None else unused((1, HV, D, D), torch.float32, dev)
        kern(x.q, x.k, b.do, t.Th, t.Tl, t.Fb, t.dUl, cp.cu, cp.warm_co, dht, dSh, dSl, dYh, dYl, dv, dh0, t.Lb,
             int(b.dht is not None), int(use_h0), int(x.v_first))
    else:
        dhk = None if b.dht is None else (b.dht.transpose(-1, -2) if x.v_first else b.dht)
        dh0k = _dh_segmented(kern, plan.dh_segments, x.q, x.k, b.do, t.Th, t.Tl, t.Fb, t.dUl, dhk, dSh, dSl, dYh,
                             dYl, dv, t.Lb, maps)
        if use_h0:
            dh0 = (dh0k.transpose(-1, -2) if x.v_first else dh0k).contiguous()
    return StateGradients(dSh, dSl, dYh, dYl, dv, dh0)


@dataclass
class ChunkTerms:
    dqv: torch.Tensor               # [Ttot, H, D] dq~ summed over each GVA group (fp32 or the input dtype)
    dkv: torch.Tensor               # likewise dk~
    qz: torch.Tensor                # [2, HV, NC, 64] row dots by halves (q.Z, k.W, k.R)
    kw: torch.Tensor
    kr: torch.Tensor
    sd: torch.Tensor                # [2, HV, NC, D] S o dS' sums by halves of the key dim
    yv2: torch.Tensor               # [2, HV, NC, 64] dY . v by halves
    rect: torch.Tensor              # [HV, NC, 64]
    db22: torch.Tensor              # [2, HV, NC, 64] the intra dbeta row sums by halves


def dqk(*, b: BackwardInputs, plan, tables: PrepTables, states: RecomputedStates, grads: StateGradients,
        fp32_sums: bool = False, factors=None) -> ChunkTerms:
    """``gdn_bwd_dqk`` (and ``gdn_bwd_group_sum`` where dqk leaves a group's rows per value head): dq~, dk~ summed
    over each GVA group as [Ttot, H, D] rows, in the input dtype (the final dq, dk) unless the L2 norm's chain rule
    follows on the host or ``fp32_sums`` asks for fp32; the row dots and dg / dbeta terms.  ``factors`` (a one-term
    plan's, ``scales.factors``): dq~, dk~ stored times its row 1."""
    from kernels.build import get_kernel
    x = b.x
    dev, dt, D, HV, NC, Ttot = x.q.device, x.q.dtype, x.D, x.HV, x.NC, x.n_tok
    f32 = torch.float32
    qz = torch.empty(2, HV, NC, BT, device=dev, dtype=f32)
    kw, kr = torch.empty_like(qz), torch.empty_like(qz)
    sd = torch.empty(2, HV, NC, D, device=dev, dtype=f32)
    rect = torch.empty(HV, NC, BT, device=dev, dtype=f32)
    yv2 = torch.empty(2, HV, NC, BT, device=dev, dtype=f32)
    db22 = torch.empty(2, HV, NC, BT, device=dev, dtype=f32)
    # the caller's dtype (``io_dtype``) where the kernels' is another: dqk rounds to it, group sums stay fp32
    odt = _io_dtype(plan, dt)
    g32 = x.use_l2 or fp32_sums or (odt != dt and plan.group_sum_config(True) is not None)
    gsum = plan.group_sum_config(g32)
    out32 = gsum is not None or g32
    HO = x.H if plan.cluster_group_sum else HV
    # the kernel stores every token row, either fp32 (dq32, dk32) or in the input dtype (dqo, dko) by ``out32``
    # (``dqk.store_rows``); the pair it leaves unwritten is a view of memory the call holds anyway
    if out32:
        dq32 = torch.empty(Ttot, HO, D, device=dev, dtype=f32)
        dk32 = torch.empty_like(dq32)
        dqo, dko = (t.view(-1).view(odt)[:t.numel()].view(Ttot, HO, D) for t in (dq32, dk32))
    else:
        dqo = torch.empty(Ttot, HO, D, device=dev, dtype=odt)
        dko = torch.empty_like(dqo)
        dq32 = dk32 = _view_over(states.Sch, (Ttot, HO, D), f32)      # never written, never read
    s, gr, t = states, grads, tables
    get_kernel(plan.dqk_config())(x.q, x.k, x.v, b.do, s.Sch, s.Scl, s.Uh, s.Ul, gr.dSh, gr.dSl, gr.dYh, gr.dYl,
                                  t.Fb, x.cu, x.chunk_indices, dq32, dk32, dqo, dko, qz, kw, kr, sd, yv2, rect, db22,
                                  x.scale, int(out32), _factors_arg(x, factors))
    dqv, dkv = (dq32, dk32) if out32 else (dqo, dko)
    if gsum is not None:
        gs = get_kernel(gsum)
        dqv, dkv = (torch.empty(Ttot, x.H, D, device=dev, dtype=f32 if g32 else dt) for _ in range(2))
        gs(dq32, dqv)
        gs(dk32, dkv)
    return ChunkTerms(dqv, dkv, qz, kw, kr, sd, yv2, rect, db22)


def fused(*, b: BackwardInputs, plan, tables: PrepTables, states: RecomputedStates, factors, maps=None):
    """``gdn_bwd_fused`` (``plan.fused``): dh's and dqk's outputs in one launch from the one-term plan's operands,
    the recompute's S, U hi tables and prep's Tinv hi and gate table (dUloc formed in the kernel; no dS' or dY
    tables), over ``plan.fused_segments`` where given: from their warm-up chunks (prep's bounds) with
    ``fused_warm``, from exact end gradients with ``fused_exact`` (``maps``: ``segment_maps_of`` over them;
    ``fused_end_gradients``); the gradients (dv, dh0) and the chunk terms, dq~ and dk~ per value head in fp32
    ``[Ttot, HV, D]`` (fp16 under the group scales with ``fused_dq16``; ``fused_group_sums`` sums them).
    ``factors``: ``_scaled``'s."""
    from kernels.build import get_kernel
    x = b.x
    dev, D, HV, NC, Ttot = x.q.device, x.D, x.HV, x.NC, x.n_tok
    f32 = torch.float32
    dv = torch.empty(Ttot, HV, D, device=dev, dtype=_io_dtype(plan, x.q.dtype))
    qk_t = torch.float16 if plan.fused_dq16 else f32
    dq32, dk32 = (torch.empty(Ttot, HV, D, device=dev, dtype=qk_t) for _ in range(2))
    qz, kw, kr, yv2, db22 = (torch.empty(2, HV, NC, BT, device=dev, dtype=f32) for _ in range(5))
    sd = torch.empty(2, HV, NC, D, device=dev, dtype=f32)
    rect = torch.empty(HV, NC, BT, device=dev, dtype=f32)
    use_h0 = x.h0 is not None
    cp = plan.fused_segments
    # the segmented forms store every segment's start gradient: each sequence's is its first segment's
    dh0 = torch.empty(((x.N if cp is None else cp.cu.numel() - 1) if use_h0 else 1), HV, D, D, device=dev, dtype=f32)
    # the kernel's states are key-first
    dhk = None if b.dht is None else (b.dht.transpose(-1, -2).contiguous() if x.v_first else b.dht)
    outs = (dv, dq32, dk32, qz, kw, kr, yv2, db22, sd, rect)
    args = (x.q, x.k, x.v, b.do, states.Sch, states.Uh, tables.Th, tables.Fb)
    fac = _factors_arg(x, factors)
    if cp is not None and plan.fused_exact:         # every segment from its exact end gradient
        dht = fused_end_gradients(x=x, plan=plan, args=args, tables=tables, outs=outs, dhk=dhk, maps=maps,
                                  factors=fac)
        cu, co, use_dht = cp.cu, cp.chunk_offsets, 1
    else:           # the warm form's dht per segment (its sequence's)
        dht = unused((1, HV, D, D), f32, dev) if dhk is None else dhk
        if cp is not None and dhk is not None:
            dht = dht.index_select(0, cp.warm_co[3 * (cp.cu.numel() - 1) + 1:])
        cu, co = (x.cu, x.chunk_offsets) if cp is None else (cp.cu, cp.warm_co)
        use_dht = int(dhk is not None)
    get_kernel(plan.fused_config())(*args, cu, co, launch_order(x, cu, plan.longest_first), tables.Lb, dht, *outs,
                                    dh0, use_dht, int(use_h0), float(x.scale), fac)
    if use_h0 and cp is not None:
        dh0 = dh0[cp.first]
    if use_h0 and x.v_first:
        dh0 = dh0.transpose(-1, -2).contiguous()
    return (StateGradients(None, None, None, None, dv, dh0),
            ChunkTerms(dq32, dk32, qz, kw, kr, sd, yv2, rect, db22))


def fused_end_gradients(*, x: ForwardInputs, plan, args, tables: PrepTables, outs, dhk, maps, factors):
    """E [NS, HV, D, D] fp32 key-first: the exact state gradient at the end of every segment of
    ``plan.fused_segments`` (``dh_segmented``'s scan): the fused kernel's chain form from zero end gradients (each
    sequence's last segment from its dht ``dhk``, key-first, or zero) gives each segment's start gradient; the
    forward CP scan's maps ``maps`` (rows [D, 2 D), M^T) are the transfer matrices; the fp64 walk joins them.
    ``args``: the fused kernel's inputs before ``cu_seqlens``; ``outs``: its chunk outputs (not written by the chain
    form); ``factors``: its ``factors`` argument."""
    from kernels.build import get_kernel
    from kernels.forward.configs import FixupConfig

    from . import dh_segmented
    cp = plan.fused_segments
    NS, HV, D = cp.cu.numel() - 1, x.HV, x.D
    dht_a = torch.zeros(NS, HV, D, D, device=x.q.device, dtype=torch.float32)
    if dhk is not None:
        dht_a[cp.last] = dhk
    a = torch.empty_like(dht_a)
    get_kernel(plan.fused_chain_config())(*args, cp.cu, cp.chunk_offsets, index_order(NS, x.q.device), tables.Lb,
                                          dht_a, *outs, a, 1, 1, float(x.scale), factors)
    return dh_segmented.end_gradients(cp, a, maps[:, :, D:, :], dhk, get_kernel(FixupConfig(D)))


def fused_group_sums(*, x: ForwardInputs, plan, terms: ChunkTerms, factors) -> ChunkTerms:
    """``terms`` with the fused kernel's dq~, dk~ summed over each GVA group in fp32 (``gdn_bwd_group_sum``; as
    they are where a group is one value head, unless ``fused_dq16``: its scaled form, times ``factors[1]``, the
    one-term plan's), each per-value-head buffer freed once summed: stored in fp32 where the L2 norm's chain
    follows, else as the final dq, dk in the caller's dtype."""
    from kernels.build import get_kernel
    gsum = plan.fused_group_sum_config(x.use_l2)
    if gsum is None:
        return terms
    gs = get_kernel(gsum)
    odt = torch.float32 if x.use_l2 else TORCH_DTYPE[plan.io_dtype or plan.dtype]
    sums = []
    for name in ("dqv", "dkv"):
        out = torch.empty(x.n_tok, x.H, x.D, device=x.q.device, dtype=odt)
        if plan.fused_dq16:
            gs(getattr(terms, name), factors, out)
        else:
            gs(getattr(terms, name), out)
        terms = _without(terms, name)
        sums.append(out)
    return dataclasses.replace(terms, dqv=sums[0], dkv=sums[1])


def _view_over(buf: torch.Tensor, shape, dtype, new=torch.empty) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over ``buf``'s first bytes, for a kernel argument that is not
    written while ``buf`` is alive: unwritten and unread (over any held buffer), or only read (over a zeroed one);
    ``new(shape, ...)`` (``torch.empty`` or ``torch.zeros``) where ``buf`` is too small."""
    n = math.prod(shape) * dtype.itemsize
    raw = buf.view(-1).view(torch.uint8)
    if raw.numel() < n:
        return new(shape, device=buf.device, dtype=dtype)
    return raw[:n].view(dtype).view(shape)


def dg_dbeta(*, x: ForwardInputs, plan, tables: PrepTables, grads: StateGradients, terms: ChunkTerms, g, beta,
             has_h0: bool, dt: torch.dtype | None = None):
    """``gdn_bwd_dg_dbeta`` (dg, dbeta of every token), then ``finish`` (dq, dk: the L2-norm chain rule) and the
    gradients in the caller's shapes and dtypes (dq, dk, dv in ``dt``, default the kernels' input dtype)."""
    from kernels.build import get_kernel

    Ttot, dev = x.n_tok, x.q.device
    tm = terms
    dgdb = tuple(torch.empty(Ttot, x.HV, device=dev, dtype=torch.float32) for _ in range(2))
    get_kernel(plan.dgdb_config())(tables.Fb, tm.qz, tm.kw, tm.kr, tm.yv2, tm.db22, tm.sd, tm.rect, x.cu,
                                   x.chunk_indices, *dgdb)
    dq, dk, dg, db = finish(Fb=tables.Fb, qz=tm.qz, kw=tm.kw, kr=tm.kr, sd=tm.sd, yv=None, rect=tm.rect, db2=None,
                            dqv=tm.dqv, dkv=tm.dkv, q=x.q, k=x.k, H=x.H, use_l2=x.use_l2, tok=None, valid=None,
                            dgdb=dgdb)
    return _outputs(x, dq, dk, grads.dv, dg, db, grads.dh0, g, beta, has_h0, dt)


def _outputs(x: ForwardInputs, dq, dk, dv, dg, db, dh0, g, beta, has_h0: bool, dt: torch.dtype | None = None):
    """The gradients in the caller's shapes and dtypes (zero past the last sequence; dq, dk, dv in ``dt``, default
    the kernels' input dtype)."""
    B, T, H, HV, K, V = x.B, x.T, x.H, x.HV, x.K, x.V
    dt = x.q.dtype if dt is None else dt
    n = B * T
    dq = pad_rows(dq, n).reshape(B, T, H, K).to(dt)
    dk = pad_rows(dk, n).reshape(B, T, H, K).to(dt)
    dv = pad_rows(dv, n).reshape(B, T, HV, V).to(dt)
    dg = pad_rows(dg, n).reshape(B, T, HV).to(g.dtype)
    db = pad_rows(db, n).reshape(B, T, HV).to(beta.dtype)
    return dq, dk, dv, dg, db, dh0 if has_h0 else None


def _empty_gradients(b: BackwardInputs, g, beta, initial_state):
    """The gradients of a call without tokens."""
    x = b.x
    dev, f32, Ttot = x.q.device, torch.float32, x.B * x.T
    z = torch.zeros(Ttot, x.HV, device=dev, dtype=f32)
    dh0 = (b.dht.clone() if b.dht is not None
           else torch.zeros(x.N, x.HV, x.D, x.D, device=dev, dtype=f32))
    return _outputs(x, torch.zeros(Ttot, x.H, x.D, device=dev), torch.zeros(Ttot, x.H, x.D, device=dev),
                    torch.zeros(Ttot, x.HV, x.D, device=dev), z, z.clone(), dh0, g, beta, initial_state is not None)


def _record_stages(stages: dict, *, x, tables, states, grads, terms, from_saved: bool):
    """The intermediates in the emulation's layouts (``STAGE_LAYOUT``), for a stage-by-stage comparison."""
    from .emulation import lo8_decode

    f = lambda t: t.float()   # noqa: E731
    tr = lambda t: t.float().transpose(-1, -2)   # noqa: E731
    t, s, gr, tm = tables, states, grads, terms

    def lo(hi, t):          # a lo table's values (fp8 codes decoded under their hi terms; 0 where none is stored)
        if t.data_ptr() == hi.data_ptr():
            return torch.zeros_like(hi, dtype=torch.float32)
        return lo8_decode(hi, t, hi.dtype).float() if t.dtype == LO8_DTYPE else t.float()

    stages.update(Tinv=f(t.Th) + (0 if from_saved else f(t.Tl)), Fb=t.Fb, dUloc=t.dUl.transpose(-1, -2),
                  dSn=tr(gr.dSh) + lo(gr.dSh, gr.dSl).transpose(-1, -2),
                  dY=tr(gr.dYh) + lo(gr.dYh, gr.dYl).transpose(-1, -2),
                  qz=tm.qz.sum(0), kw=tm.kw.sum(0), kr=tm.kr.sum(0), sd=tm.sd.sum(0), yv=tm.yv2[0] + tm.yv2[1],
                  rect=tm.rect, db2=tm.db22[0] + tm.db22[1], S=f(s.Sch) + lo(s.Sch, s.Scl), U=f(s.Uh) + f(s.Ul),
                  dqv=group_sum(tm.dqv, x.H), dkv=group_sum(tm.dkv, x.H))


def _marker(events):
    def mark(name):
        if events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append((name, ev))
    return mark


def _check_saved(saved, shape, dt, dev):
    """The forward's tables must be this call's: keys Th, Ah, Al, each ``shape`` in ``dt`` on ``dev`` (a
    ValueError names the first that is not)."""
    for name in SAVED_TABLES:
        t = saved.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"saved_tables needs a tensor {name!r}, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dt or t.device != dev or not t.is_contiguous():
            raise ValueError(f"saved_tables[{name!r}] must be a contiguous {shape} {dt} tensor on {dev}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


_PLANS: dict = {}


def _sm_count(dev) -> int:
    """Streaming multiprocessors of ``dev`` (132 off a GPU, the H100 / H200 count, for CPU tests of the plumbing)."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def _dh_plan(B, T, cu_host, HV, n_value_blocks, dev):
    """``dh_segmented.plan_tensors`` of the call's segment plan, or None (sequential), cached per layout and
    device."""
    from . import dh_segmented
    sms = _sm_count(dev)
    key = ((B, T) if cu_host is None else tuple(cu_host), HV, n_value_blocks, str(dev), sms,
           dh_segmented.MIN_CHUNKS, dh_segmented.MIN_SEQ_CHUNKS)
    def build():
        p = dh_segmented.plan([b * T for b in range(B + 1)] if cu_host is None else list(cu_host), HV,
                              n_value_blocks, sms)
        return None if p is None else dh_segmented.plan_tensors(p, dev)
    return cached(_PLANS, key, build)


def _dh_segmented(kern, cp, q2, k2, do2, Th, Tl, Fb, dUl, dhk, dSh, dSl, dYh, dYl, dv2, lb, maps=None):
    """``gdn_bwd_dh`` over the segments of plan ``cp`` (``dh_segmented``): pass A (zero end gradients, the caller's
    dht ``dhk`` [N, HV, D, D] key-first at each sequence's end), pass B (identity, dO = dUloc = 0: the transfer
    matrices; or given: ``maps``' rows [D, 2 D), the forward scan's M^T over the same segments), the scan
    (``gdn_cp_fixup`` over the segments in reverse order: ``dh_segmented.walk_ends``), pass C
    (true end gradients; writes every per-chunk output); ``lb``: the kernel's bounds argument (unread).  Returns
    the start gradient of every sequence [N, HV, D, D] (key-first)."""
    from kernels.build import get_kernel
    from kernels.forward.configs import FixupConfig

    from . import dh_segmented
    NS = cp.cu.numel() - 1
    HV, D = Th.shape[0], q2.shape[-1]
    dev, f32 = q2.device, torch.float32
    dht_a = torch.zeros(NS, HV, D, D, device=dev, dtype=f32)
    if dhk is not None:
        dht_a[cp.last] = dhk
    a = torch.empty_like(dht_a)
    kern(q2, k2, do2, Th, Tl, Fb, dUl, cp.cu, cp.chunk_offsets, dht_a, dSh, dSl, dYh, dYl, dv2, a, lb, 1, 1, 0)
    if maps is not None:        # read for every segment but each sequence's first and last (end_gradients)
        P = maps[:, :, D:, :]
    else:
        eye = torch.eye(D, device=dev, dtype=f32).expand(NS, HV, D, D).contiguous()
        P = torch.empty_like(dht_a)
        # pass B's zero dUloc and dO: one zero buffer, dO a view of its first bytes (both only read)
        zero = torch.zeros_like(dUl)
        kern(q2, k2, _view_over(zero, do2.shape, do2.dtype, torch.zeros), Th, Tl, Fb, zero, cp.cu, cp.chunk_offsets,
             eye, dSh, dSl, dYh, dYl, dv2, P, lb, 1, 1, 0)
        zero = None
    E = dh_segmented.end_gradients(cp, a, P, dhk, get_kernel(FixupConfig(D)))
    start = torch.empty_like(dht_a)
    kern(q2, k2, do2, Th, Tl, Fb, dUl, cp.cu, cp.chunk_offsets, E, dSh, dSl, dYh, dYl, dv2, start, lb, 1, 1, 0)
    return start[cp.first]


def stage_times(events) -> dict:
    """{stage: ms} from the ``events`` list of one call (synchronises)."""
    torch.cuda.synchronize()
    return {name: prev[1].elapsed_time(ev) for prev, (name, ev) in zip(events, events[1:])}
