"""Host pipeline of the TileLang GDN chunked forward (Hopper, sm_90a).

``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, plan=None, keep_tables=None)
-> (o, final_state)`` with the semantics of FLA's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``:

* q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``: bf16 or fp16 (all the same dtype), ``K == V`` in {64, 128},
  ``HV % H == 0`` (value head j reads q/k head ``j // (HV // H)``);
* g, beta ``[B, T, HV]``: fp32 or the input dtype (g is the log decay; the cumsum and every exponent are fp32);
* initial_state ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with ``state_v_first=True``), N = B, or
  ``len(cu_seqlens) - 1`` with varlen;
* cu_seqlens: int32/int64 ``[N + 1]``, requires B == 1; the state restarts at every boundary; tokens past
  ``cu_seqlens[-1] <= T`` are padding: never read, o and every gradient there are zero;
* returns o ``[B, T, HV, V]`` in the input dtype and the final state (fp32, same layout as initial_state) or
  None.

Bad input raises ``ValueError`` naming the problem.  Dense input is run as varlen (B sequences of length T).
Stages: ``intra_chunk`` (parallel), ``state`` (sequential; or, with CP, ``state_segmented``: ``segment_starts``, the
scan and the fp64 fix-up, then the state kernel per segment), ``output`` (parallel); or, for the plan form "ws",
``intra_chunk``, with CP ``segment_starts``, and ``state_output`` (the state and o in one kernel, no chunk tables),
or with ``split_heads`` ``state_output_split`` (two such kernels side by side); which kernels run is
``kernels.plan``'s ``ForwardPlan`` (``plan``: another plan value, e.g. a benchmark's alternative, or a function of
the dispatched plan returning the plan to run). ``keep_tables``: a dict that receives the intra kernel's Tinv and Ag
tables for the backward (``Th``, ``Ah``, ``Al``, each [HV, NC, 64, 64] in the input dtype) where the plan keeps
them. Every kernel is built for the call's head dim (K == V in {64, 128}; the plan's ``DK``): nothing is padded.
This module imports tilelang only when a kernel is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.interface import (BT, TL_DTYPE, TORCH_DTYPE, cached, call_tables, check_inputs, fp32_state, host_list,
                               index_order, max_chunks, pad_rows, require_sm90, side_stream, tma_ready, token_count,
                               token_rows, unused)


@dataclass
class ForwardInputs:
    """One call's tensors as the kernels take them (token-flattened, the ``n_tok`` tokens in sequences only;
    ``D`` = K = V, the kernels' head dim) and its tables."""
    q: torch.Tensor                 # [Ttot, H, D] input dtype, Ttot = n_tok
    k: torch.Tensor                 # [Ttot, H, D]
    v: torch.Tensor                 # [Ttot, HV, D]
    g: torch.Tensor                 # [Ttot, HV] fp32
    beta: torch.Tensor              # [Ttot, HV] fp32
    h0: torch.Tensor | None         # [N, HV, D, D] fp32 contiguous, the caller's layout
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    D: int
    scale: float
    use_l2: bool
    v_first: bool
    store_ht: bool
    cu_seqlens: torch.Tensor | None
    cu_host: list | None            # cu_seqlens as a host list (None for dense input)
    cu: torch.Tensor                # [N + 1] int32
    chunk_indices: torch.Tensor     # [NC, 2] int32
    chunk_offsets: torch.Tensor     # [N + 1] int32
    NC: int
    n_tok: int                      # tokens in sequences (B * T, or cu_seqlens[-1] <= T with padding)
    seq_order: torch.Tensor         # [N] int32: the sequences by decreasing chunk count (``longest_first``)


def prepare(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None) -> ForwardInputs:
    """Check the arguments (``ValueError`` naming the first bad one; ``RuntimeError`` off sm_90) and lay them out
    for the kernels (one host sync for a new varlen layout, none for the previous call's ``cu_seqlens``)."""
    B, T, H, HV, K, V, N = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    require_sm90(q.device, "kernels.chunk_gated_delta_rule")
    Ttot = B * T
    cu_host, (cu, chunk_indices, chunk_offsets, NC, seq_order) = call_tables(B, T, cu_seqlens, q.device)
    n = token_count(B, T, cu_host)

    def rows(x, width):
        return token_rows(x.reshape(Ttot, *width), n)

    return ForwardInputs(
        q=tma_ready(rows(q, (H, K))), k=tma_ready(rows(k, (H, K))), v=tma_ready(rows(v, (HV, V))),
        g=rows(g, (HV,)).to(torch.float32).contiguous(), beta=rows(beta, (HV,)).to(torch.float32).contiguous(),
        h0=None if initial_state is None else fp32_state(initial_state), B=B, T=T, H=H, HV=HV, K=K, V=V,
        N=N, D=K, scale=K ** -0.5 if scale is None else float(scale), use_l2=bool(use_qk_l2norm_in_kernel),
        v_first=bool(state_v_first), store_ht=bool(output_final_state), cu_seqlens=cu_seqlens, cu_host=cu_host,
        cu=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, NC=NC, n_tok=n, seq_order=seq_order)


def plan_for(x: ForwardInputs, keep_tables: bool = False):
    """``kernels.plan.forward_plan`` of the call ``x``."""
    from kernels.plan import forward_plan
    return forward_plan(TL_DTYPE[x.q.dtype], x.N, x.HV, max_chunks(x.B, x.T, x.cu_host),
                        keep_tables=keep_tables, DK=x.D)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, plan=None,
                           keep_tables: dict | None = None):
    """GDN chunked forward (module docstring)."""
    x = prepare(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens)
    if x.NC == 0:
        return empty_output(x, initial_state)
    if plan is None or callable(plan):
        dispatched = plan_for(x, keep_tables is not None)
        plan = plan(dispatched) if plan else dispatched
    tables = intra_chunk(x=x, plan=plan)
    if keep_tables is not None and plan.keep_tables:
        keep_tables.update(Th=tables.Th, Ah=tables.Ah, Al=tables.Al)
    if plan.split_heads:
        o, ht = state_output_split(x=x, plan=plan, tables=tables)
        return finish(x=x, o=o, ht=ht)
    if plan.state_form == "ws":
        segments = segment_starts(x=x, plan=plan, tables=tables) if plan.cp > 1 else None
        o, ht = state_output(x=x, plan=plan, tables=tables, segments=segments)
        return finish(x=x, o=o, ht=ht)
    states = state(x=x, plan=plan, tables=tables) if plan.cp <= 1 else state_segmented(x=x, plan=plan, tables=tables)
    o = output(x=x, plan=plan, tables=tables, states=states)
    return finish(x=x, o=o, ht=states.ht)


def empty_output(x: ForwardInputs, initial_state):
    """(o, final state) of a call without tokens."""
    dev = x.q.device
    o = torch.zeros(x.B, x.T, x.HV, x.V, device=dev, dtype=x.q.dtype)
    if not x.store_ht:
        return o, None
    if initial_state is None:
        shape = (x.N, x.HV, x.V, x.K) if x.v_first else (x.N, x.HV, x.K, x.V)
        return o, torch.zeros(shape, device=dev, dtype=torch.float32)
    return o, initial_state.to(torch.float32).clone()


@dataclass
class IntraTables:
    Ah: torch.Tensor                # [HV, NC, 64, 64] Ag = Tinv diag(beta), hi
    Al: torch.Tensor                # lo (Ah itself unless the precision splits Ag)
    F: torch.Tensor                 # [HV, NC, 8, 64] fp32 gate table
    Th: torch.Tensor | None         # [HV, NC, 64, 64] Tinv (only where the plan keeps the tables)
    Ph: torch.Tensor | None = None  # [HV, NC, 64, 64] the gated scores P, hi (only with the plan's p_table)
    Pl: torch.Tensor | None = None  # lo
    qo: torch.Tensor | None = None  # [Ttot, H, D] q, k in the operand type (fp16 operands of bf16 inputs alone)
    ko: torch.Tensor | None = None


def intra_chunk(*, x: ForwardInputs, plan) -> IntraTables:
    """``gdn_intra``: the per-chunk tables (parallel over chunks and value heads)."""
    from kernels.build import get_kernel
    dev, prec = x.q.device, plan.precision
    op = TORCH_DTYPE[prec.operand_dtype(TL_DTYPE[x.q.dtype])]             # the Ag and P tables' type
    Ah = torch.empty(x.HV, x.NC, BT, BT, device=dev, dtype=op)
    Al = torch.empty_like(Ah) if prec.ag == "split" else Ah                # not read unless split
    F = torch.empty(x.HV, x.NC, 8, BT, device=dev, dtype=torch.float32)
    Th = torch.empty_like(Ah) if plan.keep_tables else Ah                  # not accessed unless kept
    Ph = torch.empty_like(Ah) if plan.p_table else Ah                      # not accessed without P tables
    Pl = torch.empty_like(Ah) if plan.p_table and not prec.half else Ah   # (P one fp16 term: no lo)
    cv = op != x.q.dtype
    qo, ko = (torch.empty_like(x.q, dtype=op), torch.empty_like(x.k, dtype=op)) if cv else (x.q, x.k)
    get_kernel(plan.configs()[0])(x.q, x.k, x.g, x.beta, x.cu, x.chunk_indices, Ah, Al, F, Th, Ph, Pl, qo, ko,
                                  x.scale, int(x.use_l2))
    return IntraTables(Ah, Al, F, Th if plan.keep_tables else None, Ph if plan.p_table else None,
                       Pl if plan.p_table else None, qo if cv else None, ko if cv else None)


@dataclass
class ChunkStates:
    Sch: torch.Tensor               # [HV, NC, D, D] chunk-start states, hi ([.., DV, DK] value-first for "rv")
    Scl: torch.Tensor               # lo (Sch itself unless the precision splits S)
    Uh: torch.Tensor                # [HV, NC, 64, D] (key-first) or [HV, NC, D, 64] (value-first), hi
    Ul: torch.Tensor                # lo (Uh itself unless the precision splits U)
    ht: torch.Tensor | None         # [N, HV, D, D] fp32 final states in the caller's layout, or None


def _state_tables(x: ForwardInputs, plan):
    dev, dt, D = x.q.device, x.q.dtype, x.D
    vt = plan.state_form == "rv"
    Sch = torch.empty(x.HV, x.NC, D, D, device=dev, dtype=dt)
    Scl = torch.empty_like(Sch) if plan.precision.s == "split" else Sch
    Uh = torch.empty((x.HV, x.NC, D, BT) if vt else (x.HV, x.NC, BT, D), device=dev, dtype=dt)
    Ul = torch.empty_like(Uh) if plan.precision.u == "split" else Uh
    return Sch, Scl, Uh, Ul


def launch_order(x: ForwardInputs, cu: torch.Tensor, longest_first: bool) -> torch.Tensor:
    """The ``seq_order`` [N'] int32 of a kernel with one CTA row per sequence of ``cu`` [N' + 1] (the call's
    ``x.cu``, or its segments'): the call's sequences longest first (``x.seq_order``) where ``longest_first`` and
    ``cu`` is ``x.cu``, else the index order."""
    return x.seq_order if longest_first and cu is x.cu else index_order(cu.numel() - 1, cu.device)


def no_states(x: ForwardInputs) -> torch.Tensor:
    """The [1, HV, D, D] fp32 stand-in of a state argument that is neither read nor written."""
    return unused((1, x.HV, x.D, x.D), torch.float32, x.q.device)


def initial_states(x: ForwardInputs) -> torch.Tensor:
    """The initial states the state kernels read: ``x.h0``, or ``no_states`` (unread)."""
    return x.h0 if x.h0 is not None else no_states(x)


def _final_states(x: ForwardInputs) -> torch.Tensor:
    """The state kernels' final-state output: [N, HV, D, D] fp32, or ``no_states`` (not written) without
    ``store_ht``."""
    if not x.store_ht:
        return no_states(x)
    return torch.empty((x.N, x.HV, x.D, x.D), device=x.q.device, dtype=torch.float32)


def state(*, x: ForwardInputs, plan, tables: IntraTables) -> ChunkStates:
    """The sequential state kernel over every sequence: chunk-start states, U, and the final states."""
    from kernels.build import get_kernel
    Sch, Scl, Uh, Ul = _state_tables(x, plan)
    h0, ht = initial_states(x), _final_states(x)
    get_kernel(plan.configs()[1])(x.k, x.v, tables.Ah, tables.Al, tables.F, x.cu, x.chunk_offsets, h0, Sch, Scl,
                                  Uh, Ul, ht, int(x.h0 is not None), int(x.store_ht), int(x.v_first))
    return ChunkStates(Sch, Scl, Uh, Ul, ht if x.store_ht else None)


def _p_tables(tables: IntraTables):
    """(Ph, Pl) as the ws kernel takes them: the intra kernel's P tables, or Ah where there are none (not read)."""
    return (tables.Ph if tables.Ph is not None else tables.Ah), (tables.Pl if tables.Pl is not None else tables.Ah)


def state_output(*, x: ForwardInputs, plan, tables: IntraTables, segments=None):
    """``gdn_state_output_ws`` (the "ws" form): (o [Ttot, HV, D] in the input dtype, the final states or None);
    no chunk tables; one pass issues its sequences longest first with ``plan.longest_first``.  ``segments``:
    ``segment_starts``' result, the kernel run per CP segment from its start state."""
    from kernels.build import get_kernel
    o = torch.empty(x.n_tok, x.HV, x.D, device=x.q.device, dtype=x.q.dtype)
    Ph, Pl = _p_tables(tables)
    q = tables.qo if tables.qo is not None else x.q                       # fp16 copies with fp16 operands
    k = tables.ko if tables.ko is not None else x.k
    if segments is None:
        h0, ht = initial_states(x), _final_states(x)
        get_kernel(plan.configs()[1])(q, k, x.v, tables.Ah, tables.Al, tables.F, Ph, Pl, x.cu, x.chunk_offsets,
                                      launch_order(x, x.cu, plan.longest_first), h0, o, ht, int(x.h0 is not None),
                                      int(x.store_ht), int(x.v_first))
        return o, (ht if x.store_ht else None)
    seg_cu, seg_co, seg_of, h0s = segments
    hts = _segment_final_states(x, h0s)
    get_kernel(plan.configs()[1])(q, k, x.v, tables.Ah, tables.Al, tables.F, Ph, Pl, seg_cu, seg_co,
                                  index_order(seg_cu.numel() - 1, x.q.device), h0s, o, hts, 1, int(x.store_ht), 1)
    return o, _last_segment_states(x, hts, seg_of)


def state_output_split(*, x: ForwardInputs, plan, tables: IntraTables):
    """``plan.split_heads``: the ws kernel per CP segment with warm-up starts on the main stream and the ws kernel
    over whole sequences at ``SPLIT_EXACT_BV`` columns on the side stream beside it, each running the (sequence,
    value head) pairs the GPU gives it (``state_output_ws``'s ``split``), both writing o and the final states; no
    scan, no fix-up.  (o [Ttot, HV, D], the final states or None), as ``state_output``."""
    from kernels.build import get_kernel
    dev = x.q.device
    o = torch.empty(x.n_tok, x.HV, x.D, device=dev, dtype=x.q.dtype)
    Ph, Pl = _p_tables(tables)
    seg_cu, warm_co, seq_co = _split_tables(x.B, x.T, x.cu_seqlens, x.cu_host, plan.cp, dev)
    h0, ht = initial_states(x), _final_states(x)
    flags = (int(x.h0 is not None), int(x.store_ht), int(x.v_first))
    main, side = torch.cuda.current_stream(dev), side_stream(dev)
    side.wait_stream(main)                      # the intra kernel's tables, o and ht allocated
    get_kernel(plan.configs()[1])(x.q, x.k, x.v, tables.Ah, tables.Al, tables.F, Ph, Pl, seg_cu, warm_co,
                                  index_order(seg_cu.numel() - 1, dev), h0, o, ht, *flags)
    with torch.cuda.stream(side):
        get_kernel(plan.configs()[2])(x.q, x.k, x.v, tables.Ah, tables.Al, tables.F, Ph, Pl, x.cu, seq_co,
                                      index_order(x.N, dev), h0, o, ht, *flags)
    main.wait_stream(side)                      # (so every tensor the side stream read is freed after it)
    return o, (ht if x.store_ht else None)


_SPLIT_TABLES: dict = {}


def _split_tables(B, T, cu_seqlens, cu_host, n_seg, dev):
    """The tables of ``state_output_split`` (int32, device): the CP segments as sequences [Nseg + 1], the warm
    kernel's ``chunk_offsets`` (``cp_warm``'s table, then each segment's sequence: [4 Nseg + 1]) and the whole
    sequences' (the chunk offsets [N + 1], each sequence's first segment [N + 1], then the warm kernel's table).
    Cached for dense input."""
    def build():
        from .cp_warm import warm_offsets
        from .emulation import chunk_tables, cp_segments
        host = _host_bounds(B, T, cu_seqlens, cu_host)
        seg_cu, seg_co, seg_of = cp_segments(host, n_seg)
        warm = warm_offsets(seg_co, seg_of) + [n for n in range(len(host) - 1) for _ in range(seg_of[n], seg_of[n + 1])]
        seq = list(chunk_tables(host)[1]) + list(seg_of) + warm
        return tuple(torch.tensor(t, dtype=torch.int32).to(dev, non_blocking=True) for t in (seg_cu, warm, seq))
    return build() if cu_seqlens is not None else cached(_SPLIT_TABLES, (B, T, n_seg, str(dev)), build)


def segment_starts(*, x: ForwardInputs, plan, tables: IntraTables):
    """CP phases 1 and 2: the scan of every segment from zero with its transition product (``gdn_scan_rv``; all
    but the last segment of the last sequence, which no segment follows), then the fp64 fix-up of the segment start
    states (``gdn_cp_fixup``); with ``plan.warm`` both only where a segment needs its exact start state
    (``cp_warm``).  Returns (seg_cu, seg_co: the segments as sequences, int32 [Nseg + 1] (``cp_warm``'s [3 Nseg +
    1] table with ``plan.warm``); seg_of: each sequence's first segment, host list [N + 1]; h0s [Nseg, HV, D, D]
    fp32 value-first start states)."""
    seg_cu, seg_co, seg_of, seg_of_d, Nseg, scan_cu, scan_co, warm_co = _cp_tables(x.B, x.T, x.cu_seqlens,
                                                                                    x.cu_host, plan.cp, x.q.device,
                                                                                    plan.warm)
    if plan.warm:   # every segment's CTAs: those a later segment's exact start does not need return at once
        scan_cu, scan_co, seg_co = seg_cu, warm_co, warm_co
    ZM = segment_maps(x=x, plan=plan, tables=tables, scan_cu=scan_cu, scan_co=scan_co, n_seg=Nseg)
    co = warm_co if plan.warm else seg_of_d                                # (read with warm-up starts alone)
    return seg_cu, seg_co, seg_of, fix_segment_starts(x=x, plan=plan, tables=tables, ZM=ZM, seg_of=seg_of_d, co=co)


def segment_maps(*, x: ForwardInputs, plan, tables: IntraTables, scan_cu, scan_co, n_seg: int) -> torch.Tensor:
    """CP phase 1 (``gdn_scan_rv``, ``plan``'s scan): ZM [n_seg, HV, 2 D, D] fp32, ``[Z^T ; M^T]`` of the segments
    ``scan_cu`` / ``scan_co`` (int32, every segment but the table's last, whose rows are left unwritten: no
    segment follows it)."""
    from kernels.build import get_kernel
    dev, D = x.q.device, x.D
    ZM = torch.empty((n_seg, x.HV, 2 * D, D), device=dev, dtype=torch.float32)
    if n_seg > 1:
        none = unused((1, 1, 1, 1), x.q.dtype, dev)                        # the scan writes no chunk table
        get_kernel(plan.configs()[-2])(x.k, x.v, tables.Ah, tables.Al, tables.F, scan_cu, scan_co, no_states(x),
                                       none, none, none, none, ZM, 0, 1, 0)
    return ZM


def fix_segment_starts(*, x: ForwardInputs, plan, tables: IntraTables, ZM, seg_of, co) -> torch.Tensor:
    """CP phase 2 (``gdn_cp_fixup``, ``plan``'s fix-up): every segment's start state h0s [Nseg, HV, D, D] fp32
    value-first from ``segment_maps``' ZM and the call's initial states; ``seg_of`` int32 [N + 1] each sequence's
    first segment; ``co`` ``cp_warm``'s table with ``plan.warm`` (else unread)."""
    from kernels.build import get_kernel
    h0s = torch.empty((ZM.shape[0], x.HV, x.D, x.D), device=x.q.device, dtype=torch.float32)
    get_kernel(plan.configs()[-1])(ZM, initial_states(x), seg_of, co, tables.F, h0s, int(x.h0 is not None),
                                   int(x.v_first))
    return h0s


def _segment_final_states(x: ForwardInputs, h0s: torch.Tensor) -> torch.Tensor:
    """The state kernels' final-state output per CP segment: like ``h0s``, or ``no_states`` (not written) without
    ``store_ht``."""
    return torch.empty_like(h0s) if x.store_ht else no_states(x)


def _last_segment_states(x: ForwardInputs, hts: torch.Tensor, seg_of) -> torch.Tensor | None:
    """Every sequence's final state (its last segment's, value-first in ``hts``) in the caller's layout; None
    without ``store_ht``."""
    if not x.store_ht:
        return None
    return (hts if x.v_first else hts.transpose(-1, -2)).index_select(0, _last_segments(seg_of, x.q.device))


def state_segmented(*, x: ForwardInputs, plan, tables: IntraTables) -> ChunkStates:
    """CP ("rv" form): ``segment_starts``, then the state kernel per segment, value-first."""
    from kernels.build import get_kernel
    seg_cu, seg_co, seg_of, h0s = segment_starts(x=x, plan=plan, tables=tables)
    Sch, Scl, Uh, Ul = _state_tables(x, plan)
    hts = _segment_final_states(x, h0s)
    get_kernel(plan.configs()[1])(x.k, x.v, tables.Ah, tables.Al, tables.F, seg_cu, seg_co, h0s, Sch, Scl, Uh, Ul,
                                  hts, 1, int(x.store_ht), 1)
    return ChunkStates(Sch, Scl, Uh, Ul, _last_segment_states(x, hts, seg_of))


def output(*, x: ForwardInputs, plan, tables: IntraTables, states: ChunkStates) -> torch.Tensor:
    """``gdn_output``: o [Ttot, HV, D] in the input dtype (parallel over chunks)."""
    from kernels.build import get_kernel
    o = torch.empty(x.n_tok, x.HV, x.D, device=x.q.device, dtype=x.q.dtype)
    get_kernel(plan.configs()[2])(x.q, x.k, tables.F, states.Sch, states.Scl, states.Uh, states.Ul, x.cu,
                                  x.chunk_indices, o)
    return o


def finish(*, x: ForwardInputs, o: torch.Tensor, ht):
    """(o [B, T, HV, V], final state or None), o zero past the last sequence."""
    return pad_rows(o, x.B * x.T).reshape(x.B, x.T, x.HV, x.V), ht


def _host_bounds(B, T, cu_seqlens, cu_host) -> list:
    """The sequences' token bounds as a host list [N + 1]: ``cu_host``, else the dense layout's, else
    ``cu_seqlens`` read back."""
    if cu_host is not None:
        return cu_host
    return [b * T for b in range(B + 1)] if cu_seqlens is None else host_list(cu_seqlens)


_SEG_TABLES: dict = {}


def _cp_tables(B, T, cu_seqlens, cu_host, n_seg, dev, warm=False):
    """Segment tables of the CP path: seg_cu, seg_co (int32, device), seg_of (host list [N + 1]: each sequence's
    first segment id), seg_of on the device (int32), Nseg, seg_cu and seg_co without their last segment (the
    scan's), and with ``warm`` ``cp_warm``'s table (int32, device; else None).  Cached for dense input."""
    def build():
        from .cp_warm import warm_offsets
        from .emulation import cp_segments
        host = _host_bounds(B, T, cu_seqlens, cu_host)
        seg_cu, seg_co, seg_of = cp_segments(host, n_seg)
        tables = (seg_cu, seg_co, seg_of) + ((warm_offsets(seg_co, seg_of),) if warm else ())
        out = tuple(torch.tensor(t, dtype=torch.int32).to(dev, non_blocking=True) for t in tables)
        return (out[0], out[1], seg_of, out[2], len(seg_cu) - 1, out[0][:-1], out[1][:-1],
                out[3] if warm else None)
    return build() if cu_seqlens is not None else cached(_SEG_TABLES, (B, T, n_seg, str(dev), warm), build)


_LAST: dict = {}


def _last_segments(seg_of, dev):
    return cached(_LAST, (tuple(seg_of), str(dev)),
                  lambda: torch.tensor([seg_of[n + 1] - 1 for n in range(len(seg_of) - 1)],
                                       dtype=torch.long).to(dev, non_blocking=True))
