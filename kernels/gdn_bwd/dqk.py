"""Backward kernels 3 and 4: the parallel per-chunk gradients of q, k, g, beta (after ``gdn_bwd_dh``).

``gdn_bwd_dqk_inter`` - grid (chunk, 64-column block of DK, value head), 128 threads.  The products
that contract over the value dim with a state (S = the chunk-start state from the forward recompute,
key-first like the forward's smem state kernel writes it; dS' = the chunk-end state gradient from
``gdn_bwd_dh``, value-first; both two-term splits)::

    Z = dO S^T (2 wgmma)     W = dY S^T (3)     R = U dS'^T (3)                [64 x 64] fp32
    dq~ = scale e^G Z,   dk~ = -beta e^G W + e^(GL-G) R       (stored fp32, per value head)
    row dots q.Z, k.W, k.R, sum_d S o dS', dY . V             (for dg / dbeta, finished on the host)

``gdn_bwd_dqk_intra`` - grid (chunk, value head), 128 threads.  The 64x64 (intra-chunk) terms::

    QK = Q K^T, KK = K K^T (exact operands), dPU = dO U^T (2), dYU = dY U^T (3)
    dQK = scale e^(G_t-G_j) dPU (j <= t);  dA = -dYU (j < t);  dBk = beta_t e^(G_t-G_j) dA
    dq~ += (dQK diag(rk)) K                      (2 wgmma, split operand)
    dk~ += (diag(rq) dQK)^T Q + (dBk diag(rk)) K + (diag(rk) dBk)^T K          (6)
    dbeta += rowsum(dA o B),  B = e^(G_t-G_j) rk_t rk_j KK
    dg    += rect_s = sum_{t >= s > j} m_tj,  m = dQK o (q~ k~^T) + beta dA o B   (no cancellation)

It adds its dq~, dk~ to the inter kernel's (fp32 atomic adds onto the same rows: one addition per element).
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims, lo_shape
from kernels.gdn_fwd.cumsum import LOG2E

BT = 64
# the row dots' reductions (``T.reduce_sum(batch=)``): a thread's two rows (wgmma accumulator layout) in one batched
# all-reduce, so that a row dot across the two warpgroups of the fused kernel waits on one shared-memory exchange
# instead of two (the same additions: bitwise the same sums); ablation "dots_b1" of the fused kernel: one row at a time
ROW_DOT_BATCH = 2


@T.macro
def load_u_dy(Uh, Ul, dYh, dYl, hv, c, uh_s, ul_s, dyh_s, dyl_s, lo=True):
    """Chunk ``c``'s U (key-first) and dY (value-first) tiles of value head ``hv``, both two-term splits (the hi
    terms alone unless ``lo``)."""
    T.copy(Uh[hv, c, 0:BT, 0:uh_s.shape[1]], uh_s)
    if lo:
        T.copy(Ul[hv, c, 0:BT, 0:ul_s.shape[1]], ul_s)
    T.copy(dYh[hv, c, 0:dyh_s.shape[0], 0:BT], dyh_s)
    if lo:
        T.copy(dYl[hv, c, 0:dyl_s.shape[0], 0:BT], dyl_s)


class _GateRows:
    """``fv[r, x]``: row ``r``, column ``x`` of chunk ``c``'s gate table, read from global memory (L1) where it is
    used (a Python object, so the kernel body can name it)."""

    def __init__(self, Fb, hv, c):
        self.Fb, self.hv, self.c = Fb, hv, c

    def __getitem__(self, rx):
        r, x = rx
        return self.Fb[self.hv, self.c, r, x]


@T.macro
def inter_epilogue(q_s, k_s, f_s, z_f, w_f, r_f, tmp, rs, dqv, dkv, qz, kw, kr, t0, nv, hv, c, kb, k0, scale,
                   dots=True, store=True):
    """The inter kernels' per-chunk outputs from ``Z, W, R [64, BK]`` (fp32 fragments): the rows ``t < nv`` of
    dq~, dk~ (``dqv, dkv``, fp32) and the row dots q.Z, k.W, k.R of key block ``kb`` (``qz, kw, kr``) from the
    chunk's q and k tiles ``q_s, k_s [64, BK]`` in shared memory (rows past ``nv`` masked).  Until session 7 the
    dots read q and k from global memory element by element: with the 64-bit index arithmetic of the GVA head
    (``hv // (HV // H)``) per element they took 4.1 of the kernel's 7.0 ms (B1 T32768 H16 HV32,
    ``benchmarks/ablate_bwd.py``)."""
    f32 = "float32"
    BK = z_f.shape[1]
    for t, d in T.Parallel(BT, BK):
        if store and t < nv:
            dqv[t0 + t, hv, k0 + d] = scale * T.exp2(f_s[4, t] * LOG2E) * z_f[t, d]
            dkv[t0 + t, hv, k0 + d] = (-f_s[7, t] * T.exp2(f_s[4, t] * LOG2E) * w_f[t, d]
                                       + T.exp2((f_s[4, BT - 1] - f_s[4, t]) * LOG2E) * r_f[t, d])
    if dots:
        masked_row_dot(z_f, q_s, tmp, rs, nv, qz, kb, hv, c)
        masked_row_dot(w_f, k_s, tmp, rs, nv, kw, kb, hv, c)
        masked_row_dot(r_f, k_s, tmp, rs, nv, kr, kb, hv, c)


@T.macro
def masked_row_dot(src_f, rows_s, tmp, rs, nv, out, kb, hv, c, batch=ROW_DOT_BATCH):
    """``out[kb, hv, c, t] = sum_d [t < nv] rows_s[t, d] src_f[t, d]`` (``src_f, tmp [64, D]`` fp32 fragments of
    one layout, ``tmp`` the scratch and may be ``src_f``; ``rows_s [64, D]`` input dtype in shared memory; ``out
    [NK, HV, NC, 64]`` fp32): the inter kernels' q.Z, k.W, k.R row dots."""
    f32 = "float32"
    for t, d in T.Parallel(BT, src_f.shape[1]):
        tmp[t, d] = T.if_then_else(t < nv, T.cast(rows_s[t, d], f32), T.float32(0)) * src_f[t, d]
    T.reduce_sum(tmp, rs, dim=1, batch=batch)
    for t in T.Parallel(BT):
        out[kb, hv, c, t] = rs[t]


@T.macro
def half_row_dots(src_f, rows_s, tmp2, rs2, nv, out, hv, c):
    """``out[h, hv, c, t] = sum_{d in half h} [t < nv] rows_s[t, d] src_f[t, d]``, the two halves of the key (column)
    dim apart (``src_f [64, D]`` fp32 fragment, ``rows_s [64, D]`` input dtype in shared memory, ``tmp2 [2, 64, D/2]``
    and ``rs2 [2, 64]`` fp32 fragments, ``out [2, HV, NC, 64]``; ``finish`` adds the halves).  In the fused
    kernel's 256-thread wgmma layout each warpgroup holds one half of every row, so each half is summed within its
    warpgroup (a quad of shuffles) with no shared-memory exchange or block barrier between the warpgroups: the q.Z,
    k.W, k.R row dots of ``dqk_fused``."""
    f32 = "float32"
    DH = tmp2.shape[2]
    for hf, t, d in T.Parallel(2, BT, DH):
        tmp2[hf, t, d] = T.if_then_else(t < nv, T.cast(rows_s[t, hf * DH + d], f32), T.float32(0)) * src_f[
            t, hf * DH + d]
    store_half_sums(tmp2, rs2, out, hv, c)


@T.macro
def store_half_sums(tmp2, rs2, out, hv, c):
    """``out[h, hv, c, t] = sum_d tmp2[h, t, d]`` (``tmp2 [2, 64, D/2]``, ``rs2 [2, 64]`` fp32 fragments): the
    reduction and store of every row-dot-by-halves (``half_row_dots``, ``v_dy_half_row_dots``, the dbeta row sums
    of ``intra_terms``)."""
    T.reduce_sum(tmp2, rs2, dim=2)
    for hf, t in T.Parallel(2, BT):
        out[hf, hv, c, t] = rs2[hf, t]


@T.macro
def v_dy_half_row_dots(v_s, dyh_s, dyl_s, tmp2, rs2, nv, yv2, hv, c):
    """``yv2[h, hv, c, t] = sum_{i in half h} [t < nv] v[t, i] (dYh + dYl)[i, t]``: ``v_dy_row_dots`` with the two
    halves of the value dim apart as in ``half_row_dots`` (``tmp2`` the same fragment, so the same thread map)."""
    f32 = "float32"
    DH = tmp2.shape[2]
    for hf, t, i in T.Parallel(2, BT, DH):
        tmp2[hf, t, i] = T.if_then_else(t < nv, T.cast(v_s[t, hf * DH + i], f32), T.float32(0)) * (
            T.cast(dyh_s[hf * DH + i, t], f32) + T.cast(dyl_s[hf * DH + i, t], f32))
    store_half_sums(tmp2, rs2, yv2, hv, c)


@T.macro
def v_dy_row_dots(v_s, dyh_s, dyl_s, tmp, rs, nv, yv, hv, c, batch=ROW_DOT_BATCH, half=None):
    """``yv[hv, c, t] = sum_i [t < nv] v[t, i] (dYh + dYl)[i, t]`` (a dbeta term) from ``v_s [64, DV]`` and the split
    ``dyh_s, dyl_s [DV, 64]`` in shared memory, through the fp32 fragment ``tmp [64, DV]`` and ``rs [64]``: the fused
    kernel's and the lean state-dots kernel's dY . v dots (the two-kernel inter kernel sums them per key block)."""
    f32 = "float32"
    for t, i in T.Parallel(BT, v_s.shape[1]):
        tmp[t, i] = T.if_then_else(t < nv, T.cast(v_s[t, i], f32), T.float32(0)) * (
            T.cast(dyh_s[i, t], f32) + T.cast(dyl_s[i, t], f32))
    T.reduce_sum(tmp, rs, dim=1, batch=batch)
    if half is None:
        for t in T.Parallel(BT):
            yv[hv, c, t] = rs[t]
    else:       # ``yv [2, HV, NC, 64]``, into half ``half`` (the fused kernel's whole-row ablations)
        for t in T.Parallel(BT):
            yv[half, hv, c, t] = rs[t]


@T.macro
def split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx, xh=None, xl=None, d0=0, nd=None):
    """``acc[0] += sum_d (Sh + Sl)[d, tx] (dSh' + dSl')[tx, d]`` over one key block: the ``S o dS'`` row dot of value
    column ``tx`` (a dg term, from hi + lo) by the thread ``tx`` alone, a serial fp32 sum (``sh_s, sl_s [BK, DV]``,
    ``dsh_s, dsl_s [DV, BK]``, input dtype; ``acc`` a local fp32 [1]; callers guard ``tx < DV``).  Until session 7
    the products went to a [DV, BK] fragment and ``T.reduce_sum``, whose inferred layout spread every row over 64
    threads: 64 block-wide all-reduces in a row, each behind a ``__syncthreads``.

    With ``xh, xl`` (local buffers of 8, input dtype) the row ``tx`` of dS' is read 8 elements (16 bytes) at a time
    into them: the same products summed in the same order.  Read element by element (``xh`` None), each 2-byte load
    of the 32 lanes' rows (128 bytes apart, the swizzle spreading 8 rows over the banks) was a 4-way bank conflict:
    the S o dS' dots took 0.38 of the inter kernel's 3.19 ms (session 8, call 3).

    ``d0, nd``: only the key rows ``d0 .. d0 + nd`` of the tiles (all of them by default; ``nd`` a multiple of 8)."""
    f32 = "float32"
    nd = sh_s.shape[0] if nd is None else nd
    if xh is None:
        for d in T.serial(nd):
            acc[0] = acc[0] + ((T.cast(sh_s[d0 + d, tx], f32) + T.cast(sl_s[d0 + d, tx], f32))
                               * (T.cast(dsh_s[tx, d0 + d], f32) + T.cast(dsl_s[tx, d0 + d], f32)))
    else:
        for d8 in T.serial(nd // 8):
            for j in T.vectorized(8):
                xh[j] = dsh_s[tx, d0 + d8 * 8 + j]
            for j in T.vectorized(8):
                xl[j] = dsl_s[tx, d0 + d8 * 8 + j]
            for j in T.serial(8):
                acc[0] = acc[0] + ((T.cast(sh_s[d0 + d8 * 8 + j, tx], f32) + T.cast(sl_s[d0 + d8 * 8 + j, tx], f32))
                                   * (T.cast(xh[j], f32) + T.cast(xl[j], f32)))


@T.macro
def split_dot_rows_reduce(sh_s, sl_s, dsh_s, dsl_s, prod, part):
    """Session 6's form of ``split_dot_rows`` (a [DV, BK] fragment and ``T.reduce_sum``), kept for the timing
    ablation alone (``build_bwd_dqk_inter(_ablate={"sd_reduce"})``)."""
    f32 = "float32"
    for i, d in T.Parallel(prod.shape[0], prod.shape[1]):
        prod[i, d] = ((T.cast(sh_s[d, i], f32) + T.cast(sl_s[d, i], f32))
                      * (T.cast(dsh_s[i, d], f32) + T.cast(dsl_s[i, d], f32)))
    T.reduce_sum(prod, part, dim=1)


ABLATIONS = ("sd_reduce", "no_sd", "no_yv", "no_dots", "no_lo", "no_store", "sd_scalar")


def build_bwd_dqk_inter(DK: int, DV: int, dtype: str, BK: int = 64, _ablate: frozenset = frozenset()):
    """``_ablate`` (timing studies only, ``benchmarks/ablate_bwd.py``; wrong gradients): names from
    ``ABLATIONS`` - "sd_reduce" the session-6 form of the S o dS' dots, "no_sd" / "no_yv" / "no_dots" without the
    S o dS' dots / the dY . v dots / the epilogue's row dots, "no_lo" without the lo-term products, "no_store"
    without the dq~ / dk~ stores, "sd_scalar" session 7's S o dS' dots (dS' read element by element; same results).

    Arguments:
      q, k            [Ttot, H, DK]     dtype
      v, do           [Ttot, HV, DV]    dtype
      Sch, Scl        [HV, NC, DK, DV]  dtype  (forward recompute, key-first: the smem state kernel)
      Uh, Ul          [HV, NC, 64, DV]  dtype
      dSh, dSl        [HV, NC, DV, DK]  dtype  (gdn_bwd_dh, value-first)
      dYh, dYl        [HV, NC, DV, 64]  dtype
      Fb              [HV, NC, 8, 64]   fp32
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32
      dqv, dkv        [Ttot, HV, DK]    fp32   (out)
      qz, kw, kr      [NK, HV, NC, 64]  fp32   (out; NK = DK / BK)
      sd              [NK, HV, NC, DV]  fp32   (out)
      yv              [HV, NC, 64]      fp32   (out)
      scale fp32
    """
    assert DK in (64, 128) and DV in (64, 128) and DK % BK == 0
    assert set(_ablate) <= set(ABLATIONS), _ablate
    f32 = "float32"
    NK = DK // BK
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")
    lo = "no_lo" not in _ablate

    @T.prim_func
    def gdn_bwd_dqk_inter(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        dSh: T.Tensor((HV, NC, DV, DK), dtype),
        dSl: T.Tensor((HV, NC, DV, DK), dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        dYl: T.Tensor((HV, NC, DV, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dqv: T.Tensor((Ttot, HV, DK), f32),
        dkv: T.Tensor((Ttot, HV, DK), f32),
        qz: T.Tensor((NK, HV, NC, BT), f32),
        kw: T.Tensor((NK, HV, NC, BT), f32),
        kr: T.Tensor((NK, HV, NC, BT), f32),
        sd: T.Tensor((NK, HV, NC, DV), f32),
        yv: T.Tensor((HV, NC, BT), f32),
        scale: T.float32,
    ):
        with T.Kernel(NC, NK, HV, threads=128) as (c, kb, hv):
            h = hv // (HV // H)
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)
            k0 = kb * BK

            do_s = T.alloc_shared((BT, DV), dtype)
            sh_s = T.alloc_shared((BK, DV), dtype)
            sl_s = T.alloc_shared((BK, DV), dtype)
            dsh_s = T.alloc_shared((DV, BK), dtype)
            dsl_s = T.alloc_shared((DV, BK), dtype)
            uh_s = T.alloc_shared((BT, DV), dtype)
            ul_s = T.alloc_shared((BT, DV), dtype)
            dyh_s = T.alloc_shared((DV, BT), dtype)
            dyl_s = T.alloc_shared((DV, BT), dtype)
            f_s = T.alloc_shared((8, BT), f32)
            qd_s = T.alloc_shared((BT, BK), dtype)
            kd_s = T.alloc_shared((BT, BK), dtype)
            v_s = T.alloc_shared((BT, DV), dtype)

            z_f = T.alloc_fragment((BT, BK), f32)
            w_f = T.alloc_fragment((BT, BK), f32)
            r_f = T.alloc_fragment((BT, BK), f32)
            tmp = T.alloc_fragment((BT, BK), f32)
            rs = T.alloc_fragment((BT,), f32)
            tmp2 = T.alloc_fragment(lo_shape((DV, BK), "sd_reduce" in _ablate), f32)
            rs2 = T.alloc_fragment(lo_shape((DV,), "sd_reduce" in _ablate), f32)
            acc = T.alloc_local((1,), f32)
            xh = T.alloc_local((8,), dtype)
            xl = T.alloc_local((8,), dtype)
            tx = T.get_thread_binding()

            # Four phases, each loading only what it needs, so that at most four 16 KiB tiles are live at a time
            # and TileLang's shared-memory allocator reuses the dead ones (66 instead of 146 KiB: two CTAs per SM,
            # then limited by registers, instead of one).  The same products and dots on the same values as the
            # single-phase form (session 5), in another order.
            # 1. Z = dO S^T (S hi + lo)
            T.copy(do[t0:t0 + BT, hv, 0:DV], do_s)
            T.copy(Sch[hv, c, k0:k0 + BK, 0:DV], sh_s)
            T.copy(Scl[hv, c, k0:k0 + BK, 0:DV], sl_s)
            T.copy(Fb[hv, c, 0:8, 0:BT], f_s)
            T.gemm(do_s, sh_s, z_f, transpose_B=True, clear_accum=True)
            if lo:
                T.gemm(do_s, sl_s, z_f, transpose_B=True)
            # 2. W = dY S^T (dY, S hi + lo); the dY . v row dots (key block 0 only)
            T.copy(dYh[hv, c, 0:DV, 0:BT], dyh_s)
            T.copy(dYl[hv, c, 0:DV, 0:BT], dyl_s)
            T.gemm(dyh_s, sh_s, w_f, transpose_A=True, transpose_B=True, clear_accum=True)
            if lo:
                T.gemm(dyl_s, sh_s, w_f, transpose_A=True, transpose_B=True)
                T.gemm(dyh_s, sl_s, w_f, transpose_A=True, transpose_B=True)
            if kb == 0 and "no_yv" not in _ablate:
                T.copy(v[t0:t0 + BT, hv, 0:DV], v_s)
                for t, i in T.Parallel(BT, BK):
                    tmp[t, i] = T.float32(0)
                for j in T.serial(DV // BK):
                    for t, i in T.Parallel(BT, BK):
                        tmp[t, i] = tmp[t, i] + T.if_then_else(
                            t < nv, T.cast(v_s[t, j * BK + i], f32), T.float32(0)) * (
                            T.cast(dyh_s[j * BK + i, t], f32) + T.cast(dyl_s[j * BK + i, t], f32))
                T.reduce_sum(tmp, rs, dim=1)
                for t in T.Parallel(BT):
                    yv[hv, c, t] = rs[t]
            # 3. the S o dS' row dots (S, dS' hi + lo)
            T.copy(dSh[hv, c, 0:DV, k0:k0 + BK], dsh_s)
            T.copy(dSl[hv, c, 0:DV, k0:k0 + BK], dsl_s)
            if "sd_reduce" in _ablate:
                split_dot_rows_reduce(sh_s, sl_s, dsh_s, dsl_s, tmp2, rs2)
                for i in T.Parallel(DV):
                    sd[kb, hv, c, i] = rs2[i]
            elif "no_sd" not in _ablate:
                if tx < DV:
                    acc[0] = T.float32(0)
                    if "sd_scalar" in _ablate:
                        split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx)
                    else:
                        split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx, xh, xl)
                    sd[kb, hv, c, tx] = acc[0]
            # 4. R = U dS'^T (U, dS' hi + lo); then the epilogue
            T.copy(Uh[hv, c, 0:BT, 0:DV], uh_s)
            T.copy(Ul[hv, c, 0:BT, 0:DV], ul_s)
            T.copy(q[t0:t0 + BT, h, k0:k0 + BK], qd_s)
            T.copy(k[t0:t0 + BT, h, k0:k0 + BK], kd_s)
            T.gemm(uh_s, dsh_s, r_f, clear_accum=True)
            if lo:
                T.gemm(ul_s, dsh_s, r_f)
                T.gemm(uh_s, dsl_s, r_f)

            inter_epilogue(qd_s, kd_s, f_s, z_f, w_f, r_f, tmp, rs, dqv, dkv, qz, kw, kr, t0, nv, hv, c, kb, k0,
                           scale, "no_dots" not in _ablate, "no_store" not in _ablate)

    return gdn_bwd_dqk_inter


@T.macro
def put_split(hi, lo, t, j, x, with_lo):
    """``hi[t, j] = rd(x)`` and, where ``with_lo`` (a build-time bool), ``lo[t, j] = rd(x - rd(x))``: one element of
    a two-term split (``x`` an fp32 expression, ``hi``, ``lo`` input-dtype tiles)."""
    hi[t, j] = T.cast(x, hi.dtype)
    if with_lo:
        lo[t, j] = T.cast(x - T.cast(T.cast(x, hi.dtype), "float32"), hi.dtype)


@T.macro
def intra_terms(q_s, k_s, do_s, uh_s, ul_s, dyh_s, dyl_s, fv, mqh, mql, m1h, m1l, m2h, m2l, m3h, m3l, m_s,
                qk, kk, dpu, dyu, x_f, rs, dq_f, dk_f, db2, nv, hv, c, scale, lean=False, mlo=True, db2_on=True,
                clear=True, batch=ROW_DOT_BATCH, t2=None, r2=None, m_copy=False):
    """The intra-chunk (64x64) terms of chunk ``c``, value head ``hv`` (module docstring): the dbeta row sums to
    ``db2``, the dg rectangle's summands to ``m_s [64, 64]`` fp32 (``rect_sums`` finishes them), and the products
    into ``dq_f, dk_f [64, DK]`` (fp32 fragments; cleared first if ``clear``, else added to what they hold).
    ``fv[r, t]`` the gate table (shared tile or ``_GateRows``); ``qk .. x_f`` [64, 64] fp32 fragments and ``rs``
    [64] scratch; ``mqh .. m3l`` [64, 64] input-dtype shared tiles.  ``lean``: U and dY hi terms alone; ``mlo``
    False: the four 64x64 operands single (their lo tiles neither written nor read, so they may be None: a tile
    written but never read could share a live tile's memory, as dh's unread Tl tile did in session 13); ``db2_on``
    False only for timing ablations.  With ``t2 [2, 64, 32], r2 [2, 64]`` fp32 fragments the dbeta row
    sums go out by halves of the columns into ``db2 [2, HV, NC, 64]`` (``half_row_dots``; the fused kernel), else
    whole into ``db2 [HV, NC, 64]``.  ``m_copy``: the dg summands go to ``m_s`` through ``x_f`` and one fragment
    copy (vector stores; element by element otherwise: the masked value does not vectorise), the same values."""
    f32 = "float32"
    dtype = mqh.dtype
    T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
    T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
    T.gemm(do_s, uh_s, dpu, transpose_B=True, clear_accum=True)
    if not lean:
        T.gemm(do_s, ul_s, dpu, transpose_B=True)
    T.gemm(dyh_s, uh_s, dyu, transpose_A=True, transpose_B=True, clear_accum=True)
    if not lean:
        T.gemm(dyl_s, uh_s, dyu, transpose_A=True, transpose_B=True)
        T.gemm(dyh_s, ul_s, dyu, transpose_A=True, transpose_B=True)

    # (t, j) = (row, col); F5 = scale rq, F6 = rk, F7 = beta (0 on rows past the end)
    for t, j in T.Parallel(BT, BT):
        # dQK (rows t < nv) times rk_j -> dq~ operand
        x_f[t, j] = T.if_then_else((j <= t) & (t < nv),
                                   scale * T.exp2((fv[4, t] - fv[4, j]) * LOG2E) * dpu[t, j] * fv[6, j],
                                   T.float32(0))
    for t, j in T.Parallel(BT, BT):      # without mlo the lo tiles are neither written nor read
        put_split(mqh, mql, t, j, x_f[t, j], mlo)
    for t, j in T.Parallel(BT, BT):
        # rq_t dQK_tj (-> dk~ operand, transposed) ; dpu <- its product with q~ k~^T for dg
        x_f[t, j] = T.if_then_else(j <= t, fv[5, t] * T.exp2((fv[4, t] - fv[4, j]) * LOG2E) * dpu[t, j],
                                   T.float32(0))
    for t, j in T.Parallel(BT, BT):
        put_split(m1h, m1l, t, j, x_f[t, j], mlo)
        dpu[t, j] = x_f[t, j] * fv[6, j] * qk[t, j]
    for t, j in T.Parallel(BT, BT):
        # braw = e rk_t rk_j KK (j < t);  kk <- braw
        kk[t, j] = T.if_then_else(j < t, T.exp2((fv[4, t] - fv[4, j]) * LOG2E) * fv[6, t] * fv[6, j]
                                  * kk[t, j], T.float32(0))
    for t, j in T.Parallel(BT, BT):
        dyu[t, j] = T.if_then_else(j < t, -dyu[t, j], T.float32(0))          # dA
    if db2_on and t2 is not None:   # by halves of the columns (``half_row_dots``): db2 [2, HV, NC, 64]
        for hf, t, j in T.Parallel(2, BT, BT // 2):
            t2[hf, t, j] = dyu[t, hf * (BT // 2) + j] * kk[t, hf * (BT // 2) + j]
        store_half_sums(t2, r2, db2, hv, c)
    elif db2_on:
        for t, j in T.Parallel(BT, BT):
            x_f[t, j] = dyu[t, j] * kk[t, j]
        T.reduce_sum(x_f, rs, dim=1, batch=batch)
        for t in T.Parallel(BT):
            db2[hv, c, t] = rs[t]
    m_tj = lambda t, j: T.if_then_else(j < t, dpu[t, j] + fv[7, t] * dyu[t, j] * kk[t, j], T.float32(0))  # noqa: E731
    if m_copy:
        for t, j in T.Parallel(BT, BT):
            x_f[t, j] = m_tj(t, j)
        T.copy(x_f, m_s[:, 0:BT])
    else:
        for t, j in T.Parallel(BT, BT):
            m_s[t, j] = m_tj(t, j)
    for t, j in T.Parallel(BT, BT):
        # dBk = beta_t e dA
        x_f[t, j] = T.if_then_else(j < t, fv[7, t] * dyu[t, j] * T.exp2((fv[4, t] - fv[4, j]) * LOG2E),
                                   T.float32(0))
    for t, j in T.Parallel(BT, BT):
        put_split(m2h, m2l, t, j, x_f[t, j] * fv[6, j], mlo)
        put_split(m3h, m3l, t, j, x_f[t, j] * fv[6, t], mlo)

    T.gemm(mqh, k_s, dq_f, clear_accum=clear)
    if mlo:
        T.gemm(mql, k_s, dq_f)
    T.gemm(m1h, q_s, dk_f, transpose_A=True, clear_accum=clear)
    if mlo:
        T.gemm(m1l, q_s, dk_f, transpose_A=True)
    T.gemm(m2h, k_s, dk_f)
    if mlo:
        T.gemm(m2l, k_s, dk_f)
    T.gemm(m3h, k_s, dk_f, transpose_A=True)
    if mlo:
        T.gemm(m3l, k_s, dk_f, transpose_A=True)


@T.macro
def rect_sums(m_s, acc, rect, hv, c, part=None):
    """``rect_s = sum_{t >= s} sum_{j < s} m_tj`` from ``m_s [64, 64]`` fp32 (shared; overwritten): inclusive row
    prefix sums, then a column walk: by the first 64 threads over all rows, or, with ``part [P, 64]`` fp32 shared
    (P x 64 threads), by P groups of 64 threads over P row blocks, the P partial sums then added in block order
    (the fused kernel: 4 x 16 rows instead of 64 rows by a quarter of its threads)."""
    T.cumsum(m_s[:, 0:BT], dim=1)      # the first 64 columns (m_s may have padding columns past them)
    tx = T.get_thread_binding()
    if part is None:
        if tx < BT:
            acc[0] = T.float32(0)
            if tx > 0:
                for t in T.serial(BT):
                    if t >= tx:
                        acc[0] = acc[0] + m_s[t, tx - 1]
            rect[hv, c, tx] = acc[0]
    else:
        P = part.shape[0]
        RB = BT // P
        s = tx % BT
        acc[0] = T.float32(0)
        if s > 0:
            for i in T.serial(RB):
                if (tx // BT) * RB + i >= s:
                    acc[0] = acc[0] + m_s[(tx // BT) * RB + i, s - 1]
        part[tx // BT, s] = acc[0]
        T.sync_threads()
        if tx < BT:
            acc[0] = part[0, tx]
            for j in T.serial(P - 1):
                acc[0] = acc[0] + part[j + 1, tx]
            rect[hv, c, tx] = acc[0]


INTRA_ABLATIONS = ("no_mlo", "no_rect", "no_db2", "store", "rmw")


def build_bwd_dqk_intra(DK: int, DV: int, dtype: str, lean: bool = False, single: bool = False,
                        _ablate: frozenset = frozenset()):
    """``lean``: read the hi terms of U and dY alone (the opt-in "lean_sd" tables: 2 instead of 5 value-dim
    products, 32 KB less shared memory in the first phase); ``Ul``, ``dYl`` are then not read.  ``single``: the four
    64x64 operands single (``intra_terms(mlo=False)``; the build's ``_INTRA_SINGLE``, the API's form since session 14).

    ``_ablate`` (timing studies only, ``benchmarks/ablate_bwd.py --kernel intra``; wrong gradients): names
    from ``INTRA_ABLATIONS`` - "no_mlo" without the four lo-term products of the 64x64 gradient matrices,
    "no_rect" without the row cumsum and column walk of the dg rectangle sums, "no_db2" without the dbeta row
    sums, "store" dq~ / dk~ stored instead of added to the inter kernel's; "rmw" session 7's form of the addition
    (load, add, store: the same results).

    dq~ / dk~ are added to the inter kernel's rows by fp32 atomic adds (``red``, two floats at a time; nothing
    waits for them), not loaded, added and stored: every element gets exactly one addition onto the value the inter
    kernel stored, so the result is the same sum in the same order (deterministic, bitwise the read-modify-write's).
    Ablating the read-modify-write took 3.63 -> 2.26 ms on an H200 (session 8, call 1, B1 T32768 H16 HV32); with the
    atomic adds the kernel takes 2.53 ms against 3.65 for the read-modify-write (call 2, ``ablate_bwd.py --kernel
    intra``, its "rmw" line).

    The gate table is read from global memory (L1) where it is used, not copied to shared memory: both phases
    of the kernel (the q, k, dO, U, dY tiles; then the eight 64x64 operand tiles and m_s) peak at 112 KiB of
    shared memory, so two CTAs fit per SM (228 KiB, 1 KiB reserved per CTA); with a 2 KiB shared copy (session
    5's form) they peaked at 114 KiB, one CTA per SM.  Measured on an H200 in session 6 (commit c556228, where
    the copy was still the default and this form the opt-in ``_tables="split+fg"``): bitwise the same gradients
    on three cases (GPU test), and the stage 1.9x faster (B1 T32768 H16 HV32: 3.65 instead of 6.98 ms).

    Arguments:
      q, k            [Ttot, H, DK]     dtype
      do              [Ttot, HV, DV]    dtype
      Uh, Ul          [HV, NC, 64, DV]  dtype  (key-first)
      dYh, dYl        [HV, NC, DV, 64]  dtype  (value-first)
      Fb              [HV, NC, 8, 64]   fp32
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32
      dqv, dkv        [Ttot, HV, DK]    fp32   (in/out: += the intra-chunk terms)
      rect, db2       [HV, NC, 64]      fp32   (out)
      scale fp32
    """
    assert DK in (64, 128) and DV in (64, 128)
    assert set(_ablate) <= set(INTRA_ABLATIONS), _ablate
    f32 = "float32"
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")
    mlo = "no_mlo" not in _ablate and not single

    @T.prim_func
    def gdn_bwd_dqk_intra(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        dYl: T.Tensor((HV, NC, DV, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dqv: T.Tensor((Ttot, HV, DK), f32),
        dkv: T.Tensor((Ttot, HV, DK), f32),
        rect: T.Tensor((HV, NC, BT), f32),
        db2: T.Tensor((HV, NC, BT), f32),
        scale: T.float32,
    ):
        with T.Kernel(NC, HV, threads=128) as (c, hv):
            h = hv // (HV // H)
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            do_s = T.alloc_shared((BT, DV), dtype)
            uh_s = T.alloc_shared((BT, DV), dtype)
            ul_s = T.alloc_shared(lo_shape((BT, DV), not lean), dtype)
            dyh_s = T.alloc_shared((DV, BT), dtype)
            dyl_s = T.alloc_shared(lo_shape((DV, BT), not lean), dtype)
            mqh = T.alloc_shared((BT, BT), dtype)
            mql = T.alloc_shared(lo_shape((BT, BT), mlo), dtype)
            m1h = T.alloc_shared((BT, BT), dtype)
            m1l = T.alloc_shared(lo_shape((BT, BT), mlo), dtype)
            m2h = T.alloc_shared((BT, BT), dtype)
            m2l = T.alloc_shared(lo_shape((BT, BT), mlo), dtype)
            m3h = T.alloc_shared((BT, BT), dtype)
            m3l = T.alloc_shared(lo_shape((BT, BT), mlo), dtype)
            m_s = T.alloc_shared((BT, BT), f32)

            qk = T.alloc_fragment((BT, BT), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            dpu = T.alloc_fragment((BT, BT), f32)
            dyu = T.alloc_fragment((BT, BT), f32)
            x_f = T.alloc_fragment((BT, BT), f32)
            rs = T.alloc_fragment((BT,), f32)
            dq_f = T.alloc_fragment((BT, DK), f32)
            dk_f = T.alloc_fragment((BT, DK), f32)
            acc = T.alloc_local((1,), f32)

            T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
            T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
            T.copy(do[t0:t0 + BT, hv, 0:DV], do_s)
            load_u_dy(Uh, Ul, dYh, dYl, hv, c, uh_s, ul_s, dyh_s, dyl_s, not lean)
            fv = _GateRows(Fb, hv, c)

            intra_terms(q_s, k_s, do_s, uh_s, ul_s, dyh_s, dyl_s, fv, mqh, mql, m1h, m1l, m2h, m2l, m3h, m3l, m_s,
                        qk, kk, dpu, dyu, x_f, rs, dq_f, dk_f, db2, nv, hv, c, scale, lean, mlo,
                        "no_db2" not in _ablate)
            if "store" in _ablate:
                for t, d in T.Parallel(BT, DK):
                    if t < nv:
                        dqv[t0 + t, hv, d] = dq_f[t, d]
                        dkv[t0 + t, hv, d] = dk_f[t, d]
            elif "rmw" in _ablate:
                for t, d in T.Parallel(BT, DK):
                    if t < nv:
                        dqv[t0 + t, hv, d] = dqv[t0 + t, hv, d] + dq_f[t, d]
                        dkv[t0 + t, hv, d] = dkv[t0 + t, hv, d] + dk_f[t, d]
            else:
                for t, d in T.Parallel(BT, DK):
                    if t < nv:
                        T.atomic_add(dqv[t0 + t, hv, d], dq_f[t, d])
                        T.atomic_add(dkv[t0 + t, hv, d], dk_f[t, d])

            if "no_rect" not in _ablate:
                rect_sums(m_s, acc, rect, hv, c)

    return gdn_bwd_dqk_intra
