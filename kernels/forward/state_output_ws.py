"""Fused state-output kernel, warp-specialised: ``gdn_state_output_ws`` (shared-memory operands, key-first).

The state kernel's chain and the output kernel's products in one kernel, so that no chunk-start state and no U
table goes through global memory and the output's products run beside the chain instead of after it.  One CTA of
four warpgroups per (block of ``BV`` value columns, value head, sequence):

* WG0, the chain (``gdn_state_smem``'s, in one warpgroup): ``S [DK, BV]`` fp32 in registers; per chunk
  ``Sh (+ Sl) = split(S)`` (to WG2), ``KS = K Sh (+ K Sl)``, ``X = V - F0 KS``, ``U = Ah Xh (+ Al Xh) (+ Ah Xl)``,
  ``Uh (+ Ul) = split(U)`` (to WG2), ``S = F3 S + K^T (rd(F2 U) (+ lo))``;
* WG1, the gated scores: ``P = scale rq_t rk_j e^(G_t - G_j) Q K^T`` (j <= t), ``Ph (+ Pl)`` to WG2; with ``pt``
  the intra kernel has stored them (the same product and expression) and the producer loads them: WG1 idles;
* WG2, the output: ``O = F1 (Q Sh (+ Q Sl))``, ``O += Ph Uh (+ Pl Uh) (+ Ph Ul)``, ``o = rd(O)`` stored from
  registers;
* WG3, the producer: one warp issues the TMA loads of q, k, v, Ah (+ Al), F (and Ph (+ Pl) with ``pt``) into two
  stages.

With fp16 operands (``Precision.half``; BV 128 allowed, U then in K S's registers) every shared operand tile is
fp16, q and k come as the intra kernel's row-scaled fp16 copies (for bf16 inputs), and WG1 keeps each value
column's running maximum magnitude (h0's, then each chunk's v; without ``pt`` it then forms P from the copies):
chunk c runs column j scaled by ``sigma_cj = 2^-ceil(log2 max)``, the state entering it still at
``sigma_(c-1)j`` (K S and Q S times the ratio, S times it with F3 before its update; exact powers of two; h0 enters
at its own columns' scales) and o divided by it when stored, so that no value or state overflows fp16's range;
the chain waits for the scales only after its first product.

With ``tables`` (``gdn_state_tables_ws``, the backward recompute's form, ``BackwardPlan.recompute_ws``) the kernel
takes ``gdn_state_smem``'s arguments and stores its chunk tables instead of o: WG2 copies each chunk's hand-off tiles
Sh (+ Sl, or Sl's fp8 codes with ``lo8``) and Uh (+ Ul) to global memory, WG1 idles and no q is loaded, so that the
chain's warpgroup does no table store.

Every product and rounding is the one ``gdn_state_smem`` and ``gdn_output`` make (``prec``:
``precision.Precision``), in the same order on the same accumulators, so o and the final state are those of the
two kernels run one after the other.  Hand-offs through single shared tiles and mbarriers, each completed once a
chunk (waited on at parity ``c % 2``; a tile's "free" barrier at ``(c + 1) % 2``, which a fresh barrier passes).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.lo8 import LO8, lo8_code_of
from kernels.common.prologue import (dynamic_dims, lo_shape, load_state_kt, seq_span, split_into, split_products,
                                     store_state_kt)

from .cp_warm import MAX_SEGMENTS, WARM_CHUNKS, backward_macros, macros
from .cumsum import LOG2E

warm_chunks, exact_after = macros()
_, warm_or_start = backward_macros()

BT = 64
THREADS = 512
WG = 128


def build_state_output_ws(DK: int, DV: int, BV: int, dtype: str, prec, pt: bool = False, warm: bool = False,
                          tables: bool = False, lo8: bool = False, split: str = ""):
    """TileLang prim_func of ``gdn_state_output_ws``.

    Arguments:
      q, k     [Ttot, H, DK]          op      (op: prec.operand_dtype(dtype); fp16 copies with prec.half)
      v        [Ttot, HV, DV]         dtype
      Ah, Al   [HV, NCg, 64, 64]      op      (Al read only when prec.ag == "split")
      F        [HV, NCg, 8, 64]       fp32    (rows 0 F0, 1 F1, 2 F2, 3 F3, 4 G, 5 scale rq, 6 rk)
      Ph, Pl   [HV, NCg, 64, 64]      op      (read only with ``pt``; Pl only when prec.p == "split")
      cu_seqlens    [N + 1]  int32;  chunk_offsets [N + 1] int32 ([3 N + 1] with ``warm``: ``cp_warm``'s
                    table of the N CP segments, each started from its warm-up or from h0[n] / h0[its first
                    segment] as ``cp_warm`` says; o written from the segment's own first chunk)
      seq_order     [N] int32: CTA (bv, hv, i) runs sequence ``seq_order[i]`` (``ForwardPlan.longest_first``: the
                    order in which the sequences' CTAs are issued); read in the one-pass form alone (not with
                    ``warm`` or ``split``, whose CTA i runs segment or sequence i)
      h0       [Nh, HV, DK, DV]       fp32 (read as [.., DV, DK] when v_first)
      o        [Ttot, HV, DV]         dtype   (output)
      ht       [Nt, HV, DK, DV]       fp32    (output; [.., DV, DK] when v_first)
      use_h0, store_ht, v_first       int32

    ``tables``: ``gdn_state_tables_ws`` with ``gdn_state_smem``'s arguments and ``Lb [HV, NCg]`` fp32 after ``Ul``
    (k, v, Ah, Al, F, cu_seqlens, chunk_offsets, h0, Sch, Scl, Uh, Ul, Lb, seq_order, ht, use_h0, store_ht,
    v_first) and its
    tables, Scl fp8 with ``lo8``; ``Lb`` read by ``warm`` alone.  With ``warm`` (the backward's recompute per
    segment, ``gdn_state_tables_ws_warm``): ``Lb`` each chunk's log2 norm bound (prep's), ``chunk_offsets``
    ``[4 N + 1]`` (``cp_warm``'s table, then each segment's
    sequence); a segment starts ``cp_warm.warm_or_start`` chunks early, from zero or, reaching its sequence's first
    chunk, from the sequence's h0 (exact); its own chunks' tables alone are stored, ht never.

    ``split`` (``ForwardPlan.split_heads``): each (sequence, value head) runs in one of two kernels launched side by
    side, chosen on the GPU by ``cp_warm``'s rule over the sequence's CP segments.  "warm" (with ``warm``): the
    segments of the sequences whose every segment start takes a warm-up, ``chunk_offsets`` ``[4 N + 1]``
    (``cp_warm``'s table, then each segment's sequence), h0 [N_seq, ..] and ht [N_seq, ..] the call's (in
    ``v_first``), ht stored by a sequence's last segment; "exact": the whole sequence of the others, without CP,
    ``chunk_offsets`` the call's ``[N + 1]``, then each sequence's first segment ``[N + 1]``, then the "warm"
    kernel's table.  The CTAs of the other kind run no chunk.
    """
    assert DK in (64, 128) and DV == DK
    assert DV % BV == 0 and (BV in (16, 32, 64) or (BV == 128 and prec.half)), "BV 128: fp16 operands alone"
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"
    op = prec.operand_dtype(dtype)
    assert not (warm and prec.half), "warm-up starts are CP segments' (fp16 operands' column scales: no CP)"
    assert not tables or not (pt or prec.half), "tables: the recompute's form (P, fp16 operands: o's)"
    assert not lo8 or (tables and prec.s == "split"), "lo8: S's lo table as fp8, a form of the split S tables"
    assert split in ("", "warm", "exact") and (split != "warm" or warm) and (split != "exact" or not warm)
    assert not split or not (tables or prec.half), "split: the o form of the split precision"
    NV = DV // BV
    ks_sp, s_sp, x_sp, ag_sp, u_sp, upd_sp = prec.state_splits()
    p_sp = prec.p == "split"
    half = prec.half
    sl_need = ks_sp or s_sp
    sw, sx = split == "warm", split == "exact"     # (build-time bools)
    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")
    tw = tables and warm                            # (build-time bool)
    n_co = (4 * N + 1 if split == "warm" or tw else dynamic_dims("NCO")[0] if split else 3 * N + 1 if warm
            else N + 1)

    @T.macro
    def gated_scores(q_s, k_s, f_s, st, qk):
        """``qk = P`` of stage ``st``: ``F5_i F6_j e^(G_i - G_j) (q_i . k_j)`` where j <= i, else 0."""
        T.gemm(q_s[st, :, :], k_s[st, :, :], qk, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(BT, BT):
            # the value, then a select: branch-free (masked values are never selected)
            p = (f_s[st, 5, i] * f_s[st, 6, j] * T.exp2((f_s[st, 4, i] - f_s[st, 4, j]) * LOG2E)
                 * qk[i, j])
            qk[i, j] = T.if_then_else(j <= i, p, T.float32(0))

    @T.macro
    def store_s(sh_s, sl_s, Sch, Scl, hv, cg, v0):
        """The tables form's S hi (+ lo; fp8 codes with lo8) of chunk ``cg`` from the hand-off tiles."""
        T.copy(sh_s, Sch[hv, cg, 0:DK, v0:v0 + BV], disable_tma=True)
        if lo8:
            for i, j in T.Parallel(DK, BV):
                Scl[hv, cg, i, v0 + j] = lo8_code_of(sl_s[i, j], sh_s[i, j], dtype)
        elif s_sp:
            T.copy(sl_s, Scl[hv, cg, 0:DK, v0:v0 + BV], disable_tma=True)

    @T.macro
    def store_u(uh_s, ul_s, Uh, Ul, hv, cg, v0):
        """The tables form's U hi (+ lo) of chunk ``cg`` from the hand-off tiles."""
        T.copy(uh_s, Uh[hv, cg, 0:BT, v0:v0 + BV], disable_tma=True)
        if u_sp:
            T.copy(ul_s, Ul[hv, cg, 0:BT, v0:v0 + BV], disable_tma=True)

    @T.macro
    def store_rows(o_f, o, t0, eos, hv, v0):
        for i, j in T.Parallel(BT, BV):
            if t0 + i < eos:
                o[t0 + i, hv, v0 + j] = T.cast(o_f[i, j], dtype)

    @T.macro
    def fused(q, k, v, Ah, Al, F, Ph, Pl, cu_seqlens, chunk_offsets, seq_order, h0, o, ht, Sch, Scl, Uh, Ul,
              use_h0, store_ht, v_first, Lb=None):
        """The kernel body of the prim_funcs: ``q, Ph, Pl, o`` None with ``tables``, ``Sch, Scl, Uh, Ul``
        None without, ``Lb`` None but with ``tables`` and ``warm``."""
        with T.Kernel(NV, HV, N, threads=THREADS) as (bv, hv, i_n):
            n = i_n if warm or split else seq_order[i_n]
            h = hv // (HV // H)
            v0 = bv * BV
            if sw or sx:   # whether this kernel runs the (sequence, value head): none of its segment starts exact
                mix = T.alloc_local((1,), "int32")
                macc = T.alloc_local((1,), f32)
                wl_s = T.alloc_shared((MAX_SEGMENTS * WARM_CHUNKS,), f32)
                ca_s = T.alloc_shared((MAX_SEGMENTS,), "int32")
                if sw:
                    s_first = chunk_offsets[N + 1 + n]
                    exact_after(F, chunk_offsets, N + 1, s_first + 1, chunk_offsets[2 * N + 1 + n] - s_first, hv,
                                mix, macc, wl_s, ca_s)
                    runs = mix[0] == 0
                    seq = chunk_offsets[3 * N + 1 + n]
                    last = n == chunk_offsets[2 * N + 1 + n]
                else:
                    s_first = chunk_offsets[N + 1 + n]
                    exact_after(F, chunk_offsets, chunk_offsets[2 * N + 1] + 1, s_first + 1,
                                chunk_offsets[N + 2 + n] - s_first - 1, hv, mix, macc, wl_s, ca_s, base=2 * N + 2)
                    runs = mix[0] != 0
            if tw:      # the segment from its warm-up chunks, or from its sequence's first chunk
                ws = T.alloc_local((1,), "int32")
                wacc = T.alloc_local((1,), f32)
                wlv = T.alloc_shared((WARM_CHUNKS,), f32)
                sbos, eos, sc0, snchunks = seq_span(cu_seqlens, chunk_offsets, n)
                warm_or_start(Lb, hv, sc0, chunk_offsets[chunk_offsets[N + 1 + n]], ws, wacc, wlv)
                skip = ws[0]
                bos = sbos - skip * BT
                c0 = sc0 - skip
                nchunks = snchunks + skip
            elif warm:  # the segment from its warm-up chunks (ws of them; -1: from its exact start state)
                ws = T.alloc_local((1,), "int32")
                wacc = T.alloc_local((1,), f32)
                wlv = T.alloc_local((WARM_CHUNKS,), f32)
                warm_chunks(F, chunk_offsets, N + 1, n, hv, ws, wacc, wlv)
                sbos, eos, sc0, snchunks = seq_span(cu_seqlens, chunk_offsets, n)
                skip = T.max(ws[0], 0)
                bos = sbos - skip * BT
                c0 = sc0 - skip
                nchunks = T.if_then_else(runs, snchunks + skip, 0) if sw else snchunks + skip
            else:
                bos, eos, c0, snchunks = seq_span(cu_seqlens, chunk_offsets, n)
                nchunks = T.if_then_else(runs, snchunks, 0) if sx else snchunks

            # the inputs, two stages
            if not tables:
                q_s = T.alloc_shared((2, BT, DK), op)
            k_s = T.alloc_shared((2, BT, DK), op)
            v_s = T.alloc_shared((2, BT, BV), dtype)
            ah_s = T.alloc_shared((2, BT, BT), op)
            al_s = T.alloc_shared(lo_shape((2, BT, BT), ag_sp), op)
            f_s = T.alloc_shared((2, 8, BT), f32)
            # the chain's own operands (X, then rd(F2 U)) and the hand-offs to WG2, one tile each
            xh_s = T.alloc_shared((BT, BV), op)
            xl_s = T.alloc_shared(lo_shape((BT, BV), x_sp or upd_sp), op)
            sh_s = T.alloc_shared((DK, BV), op)
            sl_s = T.alloc_shared(lo_shape((DK, BV), sl_need), op)
            uh_s = T.alloc_shared((BT, BV), op)
            ul_s = T.alloc_shared(lo_shape((BT, BV), u_sp), op)
            if pt:      # P by TMA with the other inputs of its stage
                ph_s = T.alloc_shared((2, BT, BT), op)
                pl_s = T.alloc_shared(lo_shape((2, BT, BT), p_sp), op)
            elif not tables:
                ph_s = T.alloc_shared((BT, BT), op)
                pl_s = T.alloc_shared(lo_shape((BT, BT), p_sp), op)
            if tables:  # U is no wgmma operand there: swizzled, the chain's fragment stores have no bank conflicts
                swz = {v_s: make_swizzled_layout(v_s), uh_s: make_swizzled_layout(uh_s)}
                if u_sp:
                    swz[ul_s] = make_swizzled_layout(ul_s)
                T.annotate_layout(swz)
            else:
                T.annotate_layout({v_s: make_swizzled_layout(v_s)})
            if half:    # each stage's column scales and their ratios to the previous chunk's
                sc_s = T.alloc_shared((2, BV), f32)
                rt_s = T.alloc_shared((2, BV), f32)
                hs_s = T.alloc_shared((BV,), f32)                    # h0's column scales

            full = T.alloc_barrier(arrive_count=[32] * 2)          # a stage's loads landed (the loading warp)
            readers = 1 if tables else 2 if pt and not half else 3   # the warpgroups that read a stage
            empty = T.alloc_barrier(arrive_count=[readers * WG] * 2)  # a stage read by its consumers
            s_ready = T.alloc_barrier(arrive_count=WG)             # Sh (+ Sl) written (WG0)
            s_free = T.alloc_barrier(arrive_count=WG)              # Sh (+ Sl) read by Q S (WG2)
            u_ready = T.alloc_barrier(arrive_count=WG)             # Uh (+ Ul) written (WG0)
            u_free = T.alloc_barrier(arrive_count=WG)              # Uh (+ Ul) read (WG2)
            if not tables:
                p_ready = T.alloc_barrier(arrive_count=WG)         # Ph (+ Pl) written (WG1)
                p_free = T.alloc_barrier(arrive_count=WG)          # Ph (+ Pl) read (WG2)
            if half:
                sc_ready = T.alloc_barrier(arrive_count=[WG] * 2)  # a stage's column scales written (WG1)
                h0_ready = T.alloc_barrier(arrive_count=WG)        # h0's column scales written (WG1, with h0)

            tx = T.get_thread_binding()

            if tx < WG:
                # WG0: the chain
                T.set_max_nreg(240, 1)
                s_f = T.alloc_fragment((DK, BV), f32)
                ks_f = T.alloc_fragment((BT, BV), f32)
                # (at BV 128 U takes K S's registers: K S is dead once X is staged)
                u_f = ks_f if BV == 128 else T.alloc_fragment((BT, BV), f32)
                if sw:
                    # the sequence's first segment, or warm-up to its first chunk: the call's initial state of the
                    # sequence; else zero (no segment start of the sequence is exact here)
                    if c0 == chunk_offsets[chunk_offsets[N + 1 + n]] and use_h0 != 0:
                        load_state_kt(h0, s_f, v_first, seq, hv, v0, BV, DK)
                    else:
                        T.clear(s_f)
                elif tw:
                    # from the sequence's first chunk: its initial state; else zero
                    if c0 == chunk_offsets[chunk_offsets[N + 1 + n]] and use_h0 != 0:
                        load_state_kt(h0, s_f, v_first, chunk_offsets[3 * N + 1 + n], hv, v0, BV, DK)
                    else:
                        T.clear(s_f)
                elif warm:
                    # exact (ws 0 or -1): its start state; warm-up to the sequence's first chunk: the sequence's
                    # initial state (its first segment's); else zero
                    if ws[0] <= 0:
                        load_state_kt(h0, s_f, v_first, n, hv, v0, BV, DK)
                    elif c0 == chunk_offsets[chunk_offsets[N + 1 + n]]:
                        load_state_kt(h0, s_f, v_first, chunk_offsets[N + 1 + n], hv, v0, BV, DK)
                    else:
                        T.clear(s_f)
                elif use_h0 != 0:
                    load_state_kt(h0, s_f, v_first, n, hv, v0, BV, DK)
                    if half:    # h0 at its own column scales: the "previous chunk's" of chunk 0
                        T.barrier_wait(h0_ready, 0)
                        for i, j in T.Parallel(DK, BV):
                            s_f[i, j] = s_f[i, j] * hs_s[j]
                else:
                    T.clear(s_f)
                for c in T.serial(nchunks):
                    st = c % 2
                    T.barrier_wait(full[st], (c // 2) % 2)
                    T.barrier_wait(s_free, (c + 1) % 2)
                    split_into(s_f, sh_s, sl_s, sl_need)
                    T.fence_proxy_async()
                    T.barrier_arrive(s_ready)
                    # X = V - F0 (K S)
                    split_products(k_s[st, :, :], None, sh_s, sl_s, ks_f, False, ks_sp, True, False)
                    if half:
                        # this chunk's column scales (S, so K S, is still at the previous chunk's: times the ratio)
                        T.barrier_wait(sc_ready[st], (c // 2) % 2)
                        for i, j in T.Parallel(BT, BV):
                            ks_f[i, j] = (T.cast(v_s[st, i, j], f32) * sc_s[st, j]
                                          - f_s[st, 0, i] * ks_f[i, j] * rt_s[st, j])
                    else:
                        for i, j in T.Parallel(BT, BV):
                            ks_f[i, j] = T.cast(v_s[st, i, j], f32) - f_s[st, 0, i] * ks_f[i, j]
                    split_into(ks_f, xh_s, xl_s, x_sp)
                    T.fence_proxy_async()
                    # U = Ag X
                    split_products(ah_s[st, :, :], al_s[st, :, :], xh_s, xl_s, u_f, ag_sp, x_sp, True, False)
                    T.barrier_wait(u_free, (c + 1) % 2)
                    split_into(u_f, uh_s, ul_s, u_sp)
                    T.fence_proxy_async()
                    T.barrier_arrive(u_ready)
                    # S = F3 S + K^T (F2 U)
                    for i, j in T.Parallel(BT, BV):
                        u_f[i, j] = f_s[st, 2, i] * u_f[i, j]
                    split_into(u_f, xh_s, xl_s, upd_sp)
                    T.fence_proxy_async()
                    for i, j in T.Parallel(DK, BV):     # (with fp16 operands, S to this chunk's column scales)
                        s_f[i, j] = s_f[i, j] * (f_s[st, 3, 0] * rt_s[st, j] if half else f_s[st, 3, 0])
                    split_products(k_s[st, :, :], None, xh_s, xl_s, s_f, False, upd_sp, False, True)
                    T.barrier_arrive(empty[st])
                if not tw and store_ht != 0:
                    if half:
                        if nchunks > 0:     # the last chunk's scales (its stage is not loaded again)
                            for i, j in T.Parallel(DK, BV):
                                s_f[i, j] = s_f[i, j] / sc_s[(nchunks - 1) % 2, j]
                    if sw:                  # the sequence's final state: its last segment's, if it runs here
                        if runs and last:
                            store_state_kt(s_f, ht, v_first, seq, hv, v0, BV, DK)
                    elif sx:
                        if runs:
                            store_state_kt(s_f, ht, v_first, n, hv, v0, BV, DK)
                    else:
                        store_state_kt(s_f, ht, v_first, n, hv, v0, BV, DK)
            elif tx < 2 * WG:
                if half:
                    # WG1: the value columns' running maxima and each chunk's scales, then (without ``pt``) P from
                    # the fp16 copies (F5, F6 with their row scales undone)
                    T.set_max_nreg(120 if not pt else 112 if BV == 128 else 80, 0)
                    if not pt:
                        qk = T.alloc_fragment((BT, BT), f32)
                    v_f = T.alloc_fragment((BT, BV), f32)
                    cm_f = T.alloc_fragment((BV,), f32)
                    m_f = T.alloc_fragment((BV,), f32)
                    pv_f = T.alloc_fragment((BV,), f32)
                    for j in T.Parallel(BV):
                        m_f[j] = T.float32(0)
                        pv_f[j] = T.float32(1)
                    if use_h0 != 0:     # h0's column maxima, 64 of its rows at a time
                        for r0 in T.serial(DK // BT):
                            if v_first != 0:
                                for i, j in T.Parallel(BT, BV):
                                    v_f[i, j] = h0[n, hv, v0 + j, r0 * BT + i]
                            else:
                                for i, j in T.Parallel(BT, BV):
                                    v_f[i, j] = h0[n, hv, r0 * BT + i, v0 + j]
                            T.reduce_absmax(v_f, cm_f, dim=0)
                            for j in T.Parallel(BV):
                                m_f[j] = T.max(m_f[j], cm_f[j])
                        for j in T.Parallel(BV):
                            pv_f[j] = T.exp2(-T.ceil(T.log2(T.max(m_f[j], T.float32(2.0 ** -60)))))
                            hs_s[j] = pv_f[j]
                        T.barrier_arrive(h0_ready)
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * BT
                        T.barrier_wait(full[st], (c // 2) % 2)
                        for i, j in T.Parallel(BT, BV):     # (rows past the sequence: 0; loaded, then selected)
                            x = T.cast(v_s[st, i, j], f32)
                            v_f[i, j] = T.if_then_else(t0 + i < eos, x, T.float32(0))
                        T.reduce_absmax(v_f, cm_f, dim=0)
                        for j in T.Parallel(BV):
                            m_f[j] = T.max(m_f[j], cm_f[j])
                            sc = T.exp2(-T.ceil(T.log2(T.max(m_f[j], T.float32(2.0 ** -60)))))
                            sc_s[st, j] = sc
                            rt_s[st, j] = sc / pv_f[j]
                            pv_f[j] = sc
                        T.barrier_arrive(sc_ready[st])
                        if not pt:
                            gated_scores(q_s, k_s, f_s, st, qk)
                        T.barrier_arrive(empty[st])
                        if not pt:
                            T.barrier_wait(p_free, (c + 1) % 2)
                            split_into(qk, ph_s, pl_s, p_sp)
                            T.fence_proxy_async()
                            T.barrier_arrive(p_ready)
                elif pt or tables:
                    # WG1 idles: P comes from the intra kernel's tables, or no o is computed
                    T.set_max_nreg(24, 0)
                else:
                    # WG1: the gated scores P
                    T.set_max_nreg(104, 0)
                    qk = T.alloc_fragment((BT, BT), f32)
                    for c in T.serial(nchunks):
                        st = c % 2
                        T.barrier_wait(full[st], (c // 2) % 2)
                        gated_scores(q_s, k_s, f_s, st, qk)
                        T.barrier_arrive(empty[st])
                        T.barrier_wait(p_free, (c + 1) % 2)
                        split_into(qk, ph_s, pl_s, p_sp)
                        T.fence_proxy_async()
                        T.barrier_arrive(p_ready)
            elif tx < 3 * WG:
                if tables:
                    # WG2: the chunk tables, S hi (+ lo) and U hi (+ lo) from the hand-off tiles, as the smem kernel
                    # stores them (S lo as fp8 codes with lo8)
                    T.set_max_nreg(56, 0)
                    for c in T.serial(nchunks):
                        cg = c0 + c
                        # (warm-up chunks: the previous segment's tables; True, a build-time constant: no branch)
                        own = c >= skip if tw else True
                        T.barrier_wait(s_ready, c % 2)
                        if own:
                            store_s(sh_s, sl_s, Sch, Scl, hv, cg, v0)
                        T.barrier_arrive(s_free)
                        T.barrier_wait(u_ready, c % 2)
                        if own:
                            store_u(uh_s, ul_s, Uh, Ul, hv, cg, v0)
                        T.barrier_arrive(u_free)
                else:
                    # WG2: the output
                    T.set_max_nreg(128 if half and not pt else 136, 1)   # (with WG1's P and scales: 128)
                    o_f = T.alloc_fragment((BT, BV), f32)
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * BT
                        T.barrier_wait(full[st], (c // 2) % 2)
                        T.barrier_wait(s_ready, c % 2)
                        split_products(q_s[st, :, :], None, sh_s, sl_s, o_f, False, s_sp, True, False)
                        T.barrier_arrive(s_free)
                        if half:    # Q S at the previous chunk's column scales, to this chunk's
                            T.barrier_wait(sc_ready[st], (c // 2) % 2)
                            for i, j in T.Parallel(BT, BV):
                                o_f[i, j] = o_f[i, j] * (f_s[st, 1, i] * rt_s[st, j])
                        else:
                            for i, j in T.Parallel(BT, BV):
                                o_f[i, j] = o_f[i, j] * f_s[st, 1, i]
                        if pt:
                            T.barrier_wait(u_ready, c % 2)
                            split_products(ph_s[st, :, :], pl_s[st, :, :], uh_s, ul_s, o_f, p_sp, u_sp, False, False)
                            T.barrier_arrive(u_free)
                        else:
                            if not half:    # (the stage is read no further; with fp16 operands its scales are)
                                T.barrier_arrive(empty[st])
                            T.barrier_wait(p_ready, c % 2)
                            T.barrier_wait(u_ready, c % 2)
                            split_products(ph_s, pl_s, uh_s, ul_s, o_f, p_sp, u_sp, False, False)
                            T.barrier_arrive(u_free)
                            T.barrier_arrive(p_free)
                        if half:    # O from this chunk's column scales
                            for i, j in T.Parallel(BT, BV):
                                o_f[i, j] = o_f[i, j] / sc_s[st, j]
                        if pt or half:
                            T.barrier_arrive(empty[st])
                        if warm:
                            if c >= skip:   # (warm-up chunks: o is the previous segment's)
                                store_rows(o_f, o, t0, eos, hv, v0)
                        else:
                            store_rows(o_f, o, t0, eos, hv, v0)
            else:
                # WG3: the producer (its first warp loads; the others wait out the kernel): 48 registers in the
                # tables form, within its budget (WG1 idles at 24), where 24 spilled (the load loop at BV 32 without
                # fp8 lo tables: 8 B)
                T.set_max_nreg(48 if tables else 24, 0)
                if tx < 3 * WG + 32:
                    for c in T.serial(nchunks):
                        st = c % 2
                        t0 = bos + c * BT
                        cg = c0 + c
                        T.barrier_wait(empty[st], (c // 2 + 1) % 2)
                        if not tables:
                            T.tma_copy(q[t0:t0 + BT, h, 0:DK], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[t0:t0 + BT, h, 0:DK], k_s[st, :, :], barrier=full[st])
                        T.tma_copy(v[t0:t0 + BT, hv, v0:v0 + BV], v_s[st, :, :], barrier=full[st])
                        T.tma_copy(Ah[hv, cg, 0:BT, 0:BT], ah_s[st, :, :], barrier=full[st])
                        if ag_sp:
                            T.tma_copy(Al[hv, cg, 0:BT, 0:BT], al_s[st, :, :], barrier=full[st])
                        T.tma_copy(F[hv, cg, 0:8, 0:BT], f_s[st, :, :], barrier=full[st])
                        if pt:
                            T.tma_copy(Ph[hv, cg, 0:BT, 0:BT], ph_s[st, :, :], barrier=full[st])
                            if p_sp:
                                T.tma_copy(Pl[hv, cg, 0:BT, 0:BT], pl_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])


    if tables:
        @T.prim_func
        def gdn_state_tables_ws(
            k: T.Tensor((Ttot, H, DK), dtype),
            v: T.Tensor((Ttot, HV, DV), dtype),
            Ah: T.Tensor((HV, NCg, BT, BT), dtype),
            Al: T.Tensor((HV, NCg, BT, BT), dtype),
            F: T.Tensor((HV, NCg, 8, BT), f32),
            cu_seqlens: T.Tensor((N + 1,), "int32"),
            chunk_offsets: T.Tensor((n_co,), "int32"),
            h0: T.Tensor((Nh, HV, DK, DV), f32),
            Sch: T.Tensor((HV, NCg, DK, DV), dtype),
            Scl: T.Tensor((HV, NCg, DK, DV), LO8 if lo8 else dtype),
            Uh: T.Tensor((HV, NCg, BT, DV), dtype),
            Ul: T.Tensor((HV, NCg, BT, DV), dtype),
            Lb: T.Tensor((HV, NCg), f32),
            seq_order: T.Tensor((N,), "int32"),
            ht: T.Tensor((Nt, HV, DK, DV), f32),
            use_h0: T.int32,
            store_ht: T.int32,
            v_first: T.int32,
        ):
            fused(None, k, v, Ah, Al, F, None, None, cu_seqlens, chunk_offsets, seq_order, h0, None, ht, Sch, Scl, Uh,
                  Ul, use_h0, store_ht, v_first, Lb if warm else None)
        # the warm form under its own kernel name
        return (gdn_state_tables_ws.with_attr("global_symbol", "gdn_state_tables_ws_warm") if warm
                else gdn_state_tables_ws)

    @T.prim_func
    def gdn_state_output_ws(
        q: T.Tensor((Ttot, H, DK), op),
        k: T.Tensor((Ttot, H, DK), op),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NCg, BT, BT), op),
        Al: T.Tensor((HV, NCg, BT, BT), op),
        F: T.Tensor((HV, NCg, 8, BT), f32),
        Ph: T.Tensor((HV, NCg, BT, BT), op),
        Pl: T.Tensor((HV, NCg, BT, BT), op),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((n_co,), "int32"),
        seq_order: T.Tensor((N,), "int32"),
        h0: T.Tensor((Nh, HV, DK, DV), f32),
        o: T.Tensor((Ttot, HV, DV), dtype),
        ht: T.Tensor((Nt, HV, DK, DV), f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        fused(q, k, v, Ah, Al, F, Ph, Pl, cu_seqlens, chunk_offsets, seq_order, h0, o, ht, None, None, None, None,
              use_h0, store_ht, v_first)
    return gdn_state_output_ws
