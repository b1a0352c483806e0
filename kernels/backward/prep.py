"""Backward kernel 1 ``gdn_bwd_prep`` (parallel, one CTA of 128 threads per (chunk, value head)).

Recomputes what the backward needs of the intra-chunk forward and the local part of dU:

* ``Tinv = (I + A)^-1`` exactly like ``forward/intra_chunk.py`` (fp32 16x16 forward substitution, two merge
  levels in the forward's ``merge``: fp32 on the CUDA cores, single-term or split wgmma operands; its macros),
  stored as a two-term split ``Th + Tl``.  The forward
  stores ``Ag = Tinv diag(beta)``; the backward needs ``Tinv^T`` itself (dY = Tinv^T dU) and undoing
  ``diag(beta)`` would divide by beta.
* ``Ag = Tinv diag(beta)`` as the same two-term split as ``gdn_intra`` with ``ag="split"`` (the same
  operations on the same values: bitwise its ``Ah, Al``), so that the backward's forward recompute runs the
  state kernel alone, on ``Agh, Agl`` and ``Fb`` (rows 0-3 are the intra kernel's ``F`` rows);
* the gate table ``Fb [HV, NC, 8, 64]`` (rows in ``finish.py``), every exponent of a value <= 0;
* ``Lb [HV, NC]``: each chunk's log2 norm bound ``L_c`` (``forward.cp_warm``; the intra kernel's row 7 at its last
  row, the same operations), read by the warm-up starts of the segmented reverse pass;
* ``dUloc^T = dO^T P`` with ``P = scale rq_t rk_j e^(G_t - G_j) (q_t . k_j)`` (j <= t, fp32, exact-operand
  wgmma) split into ``Ph + Pl``: 2 wgmma with the transposed dO tile from shared memory, fp32 result
  stored value-first ``[HV, NC, DV, 64]`` for the sequential kernel.

k, q and dO arrive by TMA copies of whole chunks (k and q while the gates load), rows past the sequence zeroed
in shared memory after.
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims, zero_rows_past
from kernels.forward.cumsum import BT, LOG2E, load_chunk_gate_cumsum
from kernels.forward.intra_chunk import (MERGES, _merge, _merge_fp32, bound_terms, diagonal, fp32_tile, gate_kkt,
                                         l2_row_factors, solve_diag16)

from .convert import group_scales, store_scales

THREADS = 128


@T.macro
def load_qk_gates(q, k, g, beta, q_s, k_s, g_s, b_s, kq_ready, tx, h, hv, t0, nv):
    """k and q of the chunk by TMA (as gdn_intra's k), in flight while the gates load (``load_chunk_gate_cumsum``),
    rows past the sequence zeroed after."""
    if tx < 32:
        T.tma_copy(k[t0:t0 + BT, h, 0:k_s.shape[1]], k_s, barrier=kq_ready)
        T.tma_copy(q[t0:t0 + BT, h, 0:q_s.shape[1]], q_s, barrier=kq_ready)
        T.barrier_arrive(kq_ready)
    load_chunk_gate_cumsum(g, beta, hv, t0, nv, g_s, b_s)
    T.barrier_wait(kq_ready, 0)
    zero_rows_past(k_s, nv)
    zero_rows_past(q_s, nv)


def build_bwd_prep(DK: int, DV: int, dtype: str, saved: bool = False, merge: str = "bf16", bounds: bool = False,
                   du: bool = True, tinv_lo: bool = True, io: str = ""):
    """``saved``: Tinv and Ag come from the forward (the autograd Function keeps the intra kernel's ``Th``, ``Ah``,
    ``Al``: the same operations on the same values, so bitwise this kernel's): no solve, and ``Th``, ``Tl``,
    ``Agh``, ``Agl`` are not accessed; ``Lb`` is stored where ``bounds`` (K K^T for its diagonal alone, the same
    operations as without ``saved``), else not accessed; the gate table and dUloc^T as without it.  ``merge``: the
    block merges as the intra kernel's of that name ("fp32", "bf16", or "split": 24 KiB more shared memory).
    ``du`` False (the fused backward's, which forms dUloc itself): no P, dO not loaded, dUl not accessed.
    ``tinv_lo`` False (the one-term plans', whose kernels read Tinv's hi term alone): ``Tl`` not accessed.
    ``io`` (without ``du``, not ``saved``; the converting form): q, k, v, dO arrive in ``io`` and the kernel also does
    ``gdn_bwd_convert``'s work on its chunk (``convert.py``): value head ``hv``'s rows of v and dO times its GVA
    group's powers of two (from ``bits``, ``gdn_bwd_amax``'s) into ``v2``, ``do2``, q's and k's rows into ``q2``,
    ``k2`` (by the group's first value head; not written where ``io == dtype``), all in ``dtype``, and the powers
    of two and their factors into ``sf`` (chunk 0); rows of the chunk's sequence alone, so every token is written
    once.  The tables are computed from the ``io`` tiles, as the forward's intra kernel computes its own: bitwise
    those of prep on the ``dtype`` copies except in chunks where a q or k element's copy is inexact (outside fp16's
    normal range).  Its arguments: ``q, k, v, do, g, beta, cu_seqlens, chunk_indices, bits, q2, k2, v2, do2, sf,
    Th, Tl, Agh, Agl, Fb, dUl, Lb, scale, use_l2`` (``bits [2, HV]`` int32, ``sf [4, HV]`` fp32).

    Arguments:
      q, k          [Ttot, H, DK]     dtype (``io`` in the converting form)
      do            [Ttot, HV, DV]    dtype (``io``)
      g, beta       [Ttot, HV]        fp32
      cu_seqlens    [N + 1] int32;  chunk_indices [NC, 2] int32
      Th, Tl        [HV, NC, 64, 64]  dtype  (out, Tinv split; Tl where ``tinv_lo``)
      Agh, Agl      [HV, NC, 64, 64]  dtype  (out, Tinv diag(beta) split, for the state kernel)
      Fb            [HV, NC, 8, 64]   fp32   (out)
      dUl           [HV, NC, DV, 64]  fp32   (out, dUloc^T; without ``du`` any [*, *, DV, 64], not accessed)
      Lb            [HV, NC]          fp32   (out, each chunk's log2 norm bound; with ``saved``, where ``bounds``)
      scale fp32, use_l2 int32
    """
    assert DK in (64, 128) and DV in (64, 128)
    assert dtype in ("bfloat16", "float16")
    assert merge in MERGES and not (saved and merge != "bf16"), "with the forward's tables prep computes no merge"
    assert saved or not bounds, "prep computing Tinv always stores the bounds"
    assert tinv_lo or not saved, "on the forward's tables prep stores no Tinv"
    assert not io or (not du and not saved and io in ("bfloat16", "float16")), "the converting form: no dUloc^T"
    src = io or dtype                               # q, k (and v, dO) as they arrive
    cv, qk_copy = bool(io), bool(io) and io != dtype
    merge_split = merge == "split"
    f32 = "float32"
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")
    # without du, dUl is a placeholder of any leading dims (not accessed)
    du_dims = (HV, NC) if du else dynamic_dims("HVu NCu")

    @T.macro
    def scale_rows(x, x2, xb, hv, t0, nv, sx):
        """``x2 = rd(x sx)`` on rows ``[t0, t0 + nv)`` of value head ``hv`` (``xb`` a [64, DV] fragment)."""
        for i, d in T.Parallel(BT, DV):
            xb[i, d] = x[T.min(t0 + i, Ttot - 1), hv, d]
        for i, d in T.Parallel(BT, DV):
            if i < nv:
                x2[t0 + i, hv, d] = T.cast(T.cast(xb[i, d], f32) * sx, dtype)

    @T.macro
    def convert_chunk(q_s, k_s, v, do, bits, q2, k2, v2, do2, sf, hv, h, c, t0, nv, tx):
        """``gdn_bwd_convert``'s work on the chunk's ``nv`` rows: v's and dO's of value head ``hv`` scaled, q's and
        k's from their tiles; ``sf`` by chunk 0."""
        m = T.alloc_local((2,), "int32")
        e = T.alloc_local((2,), "int32")
        s = T.alloc_local((2,), f32)
        h0 = T.alloc_local((1,), "int32")
        group_scales(bits, hv, HV // H, m, e, s, h0)
        if c == 0 and tx == 0:
            store_scales(sf, hv, e, s)
        # v's tile, then dO's: each tile's loads issued before its first store (the rows clamped to the tensor: rows
        # past ``nv`` are read, not stored; no branch around a load), one tile's registers at a time
        xb = T.alloc_fragment((BT, DV), src)
        scale_rows(v, v2, xb, hv, t0, nv, s[1])
        scale_rows(do, do2, xb, hv, t0, nv, s[0])
        if qk_copy:
            if hv % (HV // H) == 0:
                for i, d in T.Parallel(BT, DK):
                    if i < nv:
                        q2[t0 + i, h, d] = T.cast(q_s[i, d], dtype)
                        k2[t0 + i, h, d] = T.cast(k_s[i, d], dtype)

    @T.macro
    def prep_chunks(q, k, do, g, beta, cu_seqlens, chunk_indices, Th, Tl, Agh, Agl, Fb, dUl, Lb, scale, use_l2, v,
                    bits, q2, k2, v2, do2, sf):
        # value heads fastest: a GVA group's CTAs of one chunk launch together and share its q / k tiles in L2
        with T.Kernel(HV, NC, threads=THREADS) as (hv, c):
            h = hv // (HV // H)
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, True)
            nv = T.min(eos - t0, BT)

            q_s = T.alloc_shared((BT, DK), src)
            k_s = T.alloc_shared((BT, DK), src)
            do_s = T.alloc_shared((BT, DV), dtype)
            g_s = T.alloc_shared((BT,), f32)
            b_s = T.alloc_shared((BT,), f32)
            rq_s = T.alloc_shared((BT,), f32)
            rk_s = T.alloc_shared((BT,), f32)
            kn_s = T.alloc_shared((BT,), f32)        # ||k_r||^2, then the bound's terms
            f_s = T.alloc_shared((8, BT), f32)
            a_s = fp32_tile()
            l_s = fp32_tile()
            if merge != "fp32":                          # the wgmma merges' operand tiles
                lh_s = T.alloc_shared((BT, BT), dtype)
                oh_s = T.alloc_shared((BT, BT), dtype)
                xh_s = T.alloc_shared((BT, BT), dtype)
                x_f = T.alloc_fragment((BT, BT), f32)
            if merge_split:                              # the merges' lo tiles
                ll_s = T.alloc_shared((BT, BT), dtype)
                ol_s = T.alloc_shared((BT, BT), dtype)
                xl_s = T.alloc_shared((BT, BT), dtype)
            elif merge == "bf16":                        # one placeholder, never accessed (bf16 merges)
                dummy = T.alloc_shared((8, 8), dtype)
                ll_s = dummy
                ol_s = dummy
                xl_s = dummy
            else:
                xr = T.alloc_local((8,), f32)
            ph_s = T.alloc_shared((BT, BT), dtype)
            pl_s = T.alloc_shared((BT, BT), dtype)

            sq = T.alloc_fragment((BT, DK), f32)
            ss = T.alloc_fragment((BT,), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            du_f = T.alloc_fragment((DV, BT), f32)
            t16 = T.alloc_local((16,), f32)
            kq_ready = T.alloc_barrier(arrive_count=32)
            do_ready = T.alloc_barrier(arrive_count=32)
            tx = T.get_thread_binding()

            # The order keeps few tiles live at a time, so that TileLang's shared-memory allocator can reuse the dead
            # ones: P (from q, k) and dUloc^T = dO^T P first, so q, dO and P die before the fp32 tiles of the solve
            # are born; k dies with K K^T.  The same operations on the same values as a load-everything-first
            # order: 60 instead of 111 KiB of shared memory, 164 registers: three CTAs per SM instead of one.
            load_qk_gates(q, k, g, beta, q_s, k_s, g_s, b_s, kq_ready, tx, h, hv, t0, nv)
            if cv:
                convert_chunk(q_s, k_s, v, do, bits, q2, k2, v2, do2, sf, hv, h, c, t0, nv, tx)

            if use_l2 != 0:
                l2_row_factors(q_s, sq, ss, rq_s)
                l2_row_factors(k_s, sq, ss, rk_s)
            else:
                for r in T.Parallel(BT):
                    rq_s[r] = T.float32(1)
                    rk_s[r] = T.float32(1)

            for r in T.Parallel(BT):
                f_s[0, r] = T.if_then_else(r < nv, T.exp2(g_s[r] * LOG2E) * rk_s[r], T.float32(0))
                f_s[1, r] = T.if_then_else(r < nv, scale * T.exp2(g_s[r] * LOG2E) * rq_s[r], T.float32(0))
                f_s[2, r] = T.if_then_else(r < nv, T.exp2((g_s[BT - 1] - g_s[r]) * LOG2E) * rk_s[r], T.float32(0))
                f_s[3, r] = T.exp2(g_s[BT - 1] * LOG2E)
                f_s[4, r] = g_s[r]
                f_s[5, r] = T.if_then_else(r < nv, scale * rq_s[r], T.float32(0))
                f_s[6, r] = T.if_then_else(r < nv, rk_s[r], T.float32(0))
                f_s[7, r] = b_s[r]
            T.copy(f_s, Fb[hv, c, 0:8, 0:BT])

            if du:
                # P = scale causal(E o Q~K~^T), split (the operand of dUloc^T = dO^T P)
                T.gemm(q_s, k_s, kk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BT):
                    # the value first, then a select: no branch per element (masked values, inf or not, are never
                    # selected)
                    p = f_s[5, i] * f_s[6, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E) * kk[i, j]
                    kk[i, j] = T.if_then_else(j <= i, p, T.float32(0))
                for i, j in T.Parallel(BT, BT):
                    ph_s[i, j] = T.cast(kk[i, j], dtype)
                    pl_s[i, j] = T.cast(kk[i, j] - T.cast(T.cast(kk[i, j], dtype), f32), dtype)

                # dUloc^T = dO^T P (then P and dO die, before the fp32 tiles of the solve are born)
                if tx < 32:
                    T.tma_copy(do[t0:t0 + BT, hv, 0:DV], do_s, barrier=do_ready)
                    T.barrier_arrive(do_ready)
                T.barrier_wait(do_ready, 0)
                zero_rows_past(do_s, nv)
                T.gemm(do_s, ph_s, du_f, transpose_A=True, clear_accum=True)
                T.gemm(do_s, pl_s, du_f, transpose_A=True)
                T.copy(du_f, dUl[hv, c, 0:DV, 0:BT])

            # K K^T; its diagonal gives the chunk's log2 norm bound as the intra kernel's row 7 (``cp_warm``), and
            # with the gates A, unless the forward's tables are given (``saved``; then the bound alone, ``bounds``)
            if not saved or bounds:
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                diagonal(kk, kn_s)
                if not saved:
                    gate_kkt(kk, a_s, b_s, rk_s, g_s)
                bound_terms(kn_s, b_s, rk_s)
                if tx == 0:
                    Lb[hv, c] = g_s[BT - 1] * LOG2E + kn_s[BT - 1]
            # A's inverse (as gdn_intra with the same merge)
            if not saved:
                solve_diag16(a_s, l_s, t16)
                if merge == "fp32":
                    _merge_fp32(a_s, l_s, xr)
                else:
                    _merge(16, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype, merge_split)
                    _merge(32, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype, merge_split)
                for r, j in T.Parallel(BT, BT):
                    Th[hv, c, r, j] = T.cast(l_s[r, j], dtype)
                    if tinv_lo:
                        Tl[hv, c, r, j] = T.cast(l_s[r, j] - T.cast(T.cast(l_s[r, j], dtype), f32), dtype)
                    Agh[hv, c, r, j] = T.cast(l_s[r, j] * b_s[j], dtype)
                    Agl[hv, c, r, j] = T.cast(
                        l_s[r, j] * b_s[j] - T.cast(T.cast(l_s[r, j] * b_s[j], dtype), f32), dtype)

    if not io:
        @T.prim_func
        def gdn_bwd_prep(
            q: T.Tensor((Ttot, H, DK), dtype),
            k: T.Tensor((Ttot, H, DK), dtype),
            do: T.Tensor((Ttot, HV, DV), dtype),
            g: T.Tensor((Ttot, HV), f32),
            beta: T.Tensor((Ttot, HV), f32),
            cu_seqlens: T.Tensor((N + 1,), "int32"),
            chunk_indices: T.Tensor((NC, 2), "int32"),
            Th: T.Tensor((HV, NC, BT, BT), dtype),
            Tl: T.Tensor((HV, NC, BT, BT), dtype),
            Agh: T.Tensor((HV, NC, BT, BT), dtype),
            Agl: T.Tensor((HV, NC, BT, BT), dtype),
            Fb: T.Tensor((HV, NC, 8, BT), f32),
            dUl: T.Tensor((*du_dims, DV, BT), f32),
            Lb: T.Tensor((HV, NC), f32),
            scale: T.float32,
            use_l2: T.int32,
        ):
            prep_chunks(q, k, do, g, beta, cu_seqlens, chunk_indices, Th, Tl, Agh, Agl, Fb, dUl, Lb, scale, use_l2,
                        None, None, None, None, None, None, None)

        return gdn_bwd_prep

    @T.prim_func
    def gdn_bwd_prep_convert(
        q: T.Tensor((Ttot, H, DK), src),
        k: T.Tensor((Ttot, H, DK), src),
        v: T.Tensor((Ttot, HV, DV), src),
        do: T.Tensor((Ttot, HV, DV), src),
        g: T.Tensor((Ttot, HV), f32),
        beta: T.Tensor((Ttot, HV), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        bits: T.Tensor((2, HV), "int32"),
        q2: T.Tensor((Ttot, H, DK), dtype),
        k2: T.Tensor((Ttot, H, DK), dtype),
        v2: T.Tensor((Ttot, HV, DV), dtype),
        do2: T.Tensor((Ttot, HV, DV), dtype),
        sf: T.Tensor((4, HV), f32),
        Th: T.Tensor((HV, NC, BT, BT), dtype),
        Tl: T.Tensor((HV, NC, BT, BT), dtype),
        Agh: T.Tensor((HV, NC, BT, BT), dtype),
        Agl: T.Tensor((HV, NC, BT, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        dUl: T.Tensor((*du_dims, DV, BT), f32),
        Lb: T.Tensor((HV, NC), f32),
        scale: T.float32,
        use_l2: T.int32,
    ):
        prep_chunks(q, k, do, g, beta, cu_seqlens, chunk_indices, Th, Tl, Agh, Agl, Fb, dUl, Lb, scale, use_l2, v,
                    bits, q2, k2, v2, do2, sf)

    return gdn_bwd_prep_convert
