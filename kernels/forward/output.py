"""Parallel output kernel ``gdn_output``: one CTA (128 threads) per (``cpb`` chunks, block of ``BV`` value
columns, value head); nothing sequential.
It recomputes the gated, scaled ``P = Q K^T`` in registers instead of reading it from the intra
kernel (no ``Ph, Pl`` tensors)::

    P  = scale rq_t rk_j exp(G_t - G_j) (q_t . k_j)     j <= t  (exact-operand wgmma, fp32)
    O  = F1 * (Q @ (Sch (+ Scl))) + Ph Uh (+ Pl Uh) (+ Ph Ul)                      (fp32)

``prec`` (``precision.Precision``) picks which fp32 values are two-term splits: ``s`` (Scl read),
``p`` (P lo term), ``u`` (Ul read).  Rows past the end of a sequence have zero F rows and are
not stored.
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims, lo_shape, split_into

from .cumsum import LOG2E

BT = 64


@T.macro
def gated_scores(qk, pa, pl, f_s, p_sp):
    """``P = scale rq_t rk_j e^(G_t - G_j) (Q K^T)_tj`` on the lower triangle incl. the diagonal, from ``qk = Q K^T``
    (fp32, overwritten) and the gate table rows 4 (G), 5 (scale rq), 6 (rk) of ``f_s``, split into ``pa`` (+ ``pl``
    where ``p_sp``)."""
    for i, j in T.Parallel(BT, BT):
        # the value first, then a select: no branch per element (masked values, inf or not, are never selected)
        p = f_s[5, i] * f_s[6, j] * T.exp2((f_s[4, i] - f_s[4, j]) * LOG2E) * qk[i, j]
        qk[i, j] = T.if_then_else(j <= i, p, T.float32(0))
    split_into(qk, pa, pl, p_sp)


@T.macro
def _chunk_output(q_s, k_s, f_s, s_s, sl_s, uh_s, ul_s, qk, pa, pl, o_f, o, t0, eos, hv, v0, vt, s_sp, p_sp, u_sp):
    """``o[t0 + i, hv, v0:v0 + BV] = O[i]`` for the rows ``t0 + i < eos`` of one chunk whose tiles are in shared
    memory (the module docstring's formula)."""
    dtype = q_s.dtype
    BV = o_f.shape[1]
    T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
    gated_scores(qk, pa, pl, f_s, p_sp)

    T.gemm(q_s, s_s, o_f, transpose_B=vt, clear_accum=True)
    if s_sp:
        T.gemm(q_s, sl_s, o_f, transpose_B=vt)
    for i, j in T.Parallel(BT, BV):
        o_f[i, j] = o_f[i, j] * f_s[1, i]
    T.gemm(pa, uh_s, o_f, transpose_B=vt)
    if p_sp:
        T.gemm(pl, uh_s, o_f, transpose_B=vt)
    if u_sp:
        T.gemm(pa, ul_s, o_f, transpose_B=vt)
    for i, j in T.Parallel(BT, BV):
        if t0 + i < eos:
            o[t0 + i, hv, v0 + j] = T.cast(o_f[i, j], dtype)


def build_output(DK: int, DV: int, dtype: str, prec, BV: int = 128, vt: bool = True, cpb: int = 8,
                 num_stages: int = 2):
    """``vt``: the chunk tables are value-first (``state_registers.py``: ``Sch [HV, NC, DV, DK]``,
    ``Uh [HV, NC, DV, 64]``); otherwise key-first (``state_smem.py``: ``Sch [HV, NC, DK, DV]``,
    ``Uh [HV, NC, 64, DV]``).  P is kept in registers and used as the register A operand of ``P @ U`` (wgmma_rs).

    One CTA per (``cpb`` consecutive chunks, value block, value head), the chunks in a TileLang ``T.Pipelined`` loop
    (TMA loads of the next chunk's tiles overlap this chunk's products; ``num_stages`` tile sets in shared
    memory).  The last CTA of a head recomputes chunk ``NC - 1`` for its iterations past the end, without
    storing.

    Arguments:
      q, k        [Ttot, H, DK]      dtype
      F           [HV, NC, 8, 64]    fp32   (rows 1 F1, 4 G, 5 scale rq, 6 rk)
      Sch, Scl    [HV, NC, DK, DV]   dtype  (Scl read only when prec.s == "split")
      Uh, Ul      [HV, NC, 64, DV]   dtype  (Ul read only when prec.u == "split")
      cu_seqlens  [N + 1]  int32;  chunk_indices [NC, 2] int32
      o           [Ttot, HV, DV]     dtype  (output)
    """
    assert DK in (64, 128) and DV == DK and DV % BV == 0
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"
    NV = DV // BV
    s_sp = prec.s == "split"
    p_sp = prec.p == "split"
    u_sp = prec.u == "split"
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")

    s_tab = (HV, NC, DV, DK) if vt else (HV, NC, DK, DV)
    u_tab = (HV, NC, DV, BT) if vt else (HV, NC, BT, DV)
    s_tile = (BV, DK) if vt else (DK, BV)
    u_tile = (BV, BT) if vt else (BT, BV)

    @T.macro
    def load_tiles(q, k, F, Sch, Scl, Uh, Ul, q_s, k_s, f_s, s_s, sl_s, uh_s, ul_s, t0, c, h, hv, v0):
        T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
        T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
        T.copy(F[hv, c, 0:8, 0:BT], f_s)
        if vt:
            T.copy(Sch[hv, c, v0:v0 + BV, 0:DK], s_s)
            if s_sp:
                T.copy(Scl[hv, c, v0:v0 + BV, 0:DK], sl_s)
            T.copy(Uh[hv, c, v0:v0 + BV, 0:BT], uh_s)
            if u_sp:
                T.copy(Ul[hv, c, v0:v0 + BV, 0:BT], ul_s)
        else:
            T.copy(Sch[hv, c, 0:DK, v0:v0 + BV], s_s)
            if s_sp:
                T.copy(Scl[hv, c, 0:DK, v0:v0 + BV], sl_s)
            T.copy(Uh[hv, c, 0:BT, v0:v0 + BV], uh_s)
            if u_sp:
                T.copy(Ul[hv, c, 0:BT, v0:v0 + BV], ul_s)

    @T.prim_func
    def gdn_output(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        F: T.Tensor((HV, NC, 8, BT), f32),
        Sch: T.Tensor(s_tab, dtype),
        Scl: T.Tensor(s_tab, dtype),
        Uh: T.Tensor(u_tab, dtype),
        Ul: T.Tensor(u_tab, dtype),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        o: T.Tensor((Ttot, HV, DV), dtype),
    ):
        with T.Kernel(T.ceildiv(NC, cpb), NV, HV, threads=128) as (cb, bv, hv):
            h = hv // (HV // H)
            v0 = bv * BV

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            s_s = T.alloc_shared(s_tile, dtype)
            sl_s = T.alloc_shared(lo_shape(s_tile, s_sp), dtype)
            uh_s = T.alloc_shared(u_tile, dtype)
            ul_s = T.alloc_shared(lo_shape(u_tile, u_sp), dtype)
            pa = T.alloc_fragment((BT, BT), dtype)
            pl = T.alloc_fragment(lo_shape((BT, BT), p_sp), dtype)
            f_s = T.alloc_shared((8, BT), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            o_f = T.alloc_fragment((BT, BV), f32)

            for it in T.Pipelined(cpb, num_stages=num_stages):
                c = T.min(cb * cpb + it, NC - 1)
                eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
                load_tiles(q, k, F, Sch, Scl, Uh, Ul, q_s, k_s, f_s, s_s, sl_s, uh_s, ul_s, t0, c, h, hv, v0)
                # past the last chunk: eos = t0 stores nothing
                _chunk_output(q_s, k_s, f_s, s_s, sl_s, uh_s, ul_s, qk, pa, pl, o_f, o, t0,
                              T.if_then_else(cb * cpb + it < NC, eos, t0), hv, v0, vt, s_sp, p_sp, u_sp)

    return gdn_output
