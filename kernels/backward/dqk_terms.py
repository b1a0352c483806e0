"""The TileLang macros of ``gdn_bwd_dqk`` (``dqk.py``): its row dots, the S o dS' sums and the intra-chunk terms.

The products that contract over the value dim with a state (S = the chunk-start state from the forward recompute,
key-first; dS' = the chunk-end state gradient from ``gdn_bwd_dh``, value-first; both two-term splits, or every
table one term: one wgmma each)::

    Z = dO S^T (2 wgmma)     W = dY S^T (3)     R = U dS'^T (3)                [64 x 64] fp32
    dq~ = scale e^G Z,   dk~ = -beta e^G W + e^(GL-G) R
    row dots q.Z, k.W, k.R, sum_d S o dS', dY . V             (for dg / dbeta)

The 64x64 (intra-chunk) terms (``intra_terms``)::

    QK = Q K^T, KK = K K^T (exact operands), dPU = dO U^T (2), dYU = dY U^T (3)
    dQK = scale e^(G_t-G_j) dPU (j <= t);  dA = -dYU (j < t);  dBk = beta_t e^(G_t-G_j) dA
    dq~ += (dQK diag(rk)) K                      (1 wgmma, single operand)
    dk~ += (diag(rq) dQK)^T Q + (dBk diag(rk)) K + (diag(rk) dBk)^T K          (3)
    dbeta += rowsum(dA o B),  B = e^(G_t-G_j) rk_t rk_j KK
    dg    += rect_s = sum_{t >= s > j} m_tj,  m = dQK o (q~ k~^T) + beta dA o B   (no cancellation)
"""

import tilelang.language as T

from kernels.forward.cumsum import LOG2E

BT = 64


@T.macro
def half_row_dots(src_f, rows_s, tmp2, rs2, nv, out, hv, c):
    """``out[h, hv, c, t] = sum_{d in half h} [t < nv] rows_s[t, d] src_f[t, d]``, the two halves of the key (column)
    dim apart (``src_f [64, D]`` fp32 fragment, ``rows_s [64, D]`` input dtype in shared memory, ``tmp2 [2, 64, D/2]``
    and ``rs2 [2, 64]`` fp32 fragments, ``out [2, HV, NC, 64]``; ``finish`` adds the halves).  In the fused
    kernel's 256-thread wgmma layout each warpgroup holds one half of every row, so each half is summed within its
    warpgroup (a quad of shuffles) with no shared-memory exchange or block barrier between the warpgroups: the q.Z,
    k.W, k.R row dots of ``dqk.py``."""
    f32 = "float32"
    DH = tmp2.shape[2]
    for hf, t, d in T.Parallel(2, BT, DH):
        # the load first, then a select: no branch per element around a shared-memory load
        r = T.cast(rows_s[t, hf * DH + d], f32)
        tmp2[hf, t, d] = T.if_then_else(t < nv, r, T.float32(0)) * src_f[t, hf * DH + d]
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
    halves of the value dim apart as in ``half_row_dots`` (``tmp2`` the same fragment, so the same thread map);
    ``dyl_s`` None: dY its hi term alone."""
    f32 = "float32"
    DH = tmp2.shape[2]
    for hf, t, i in T.Parallel(2, BT, DH):
        r = T.cast(v_s[t, hf * DH + i], f32)
        if dyl_s is None:
            tmp2[hf, t, i] = T.if_then_else(t < nv, r, T.float32(0)) * T.cast(dyh_s[hf * DH + i, t], f32)
        else:
            tmp2[hf, t, i] = T.if_then_else(t < nv, r, T.float32(0)) * (
                T.cast(dyh_s[hf * DH + i, t], f32) + T.cast(dyl_s[hf * DH + i, t], f32))
    store_half_sums(tmp2, rs2, yv2, hv, c)


@T.macro
def split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx, xh=None, xl=None, d0=0, nd=None):
    """``acc[0] += sum_d (Sh + Sl)[d, tx] (dSh' + dSl')[tx, d]`` over one key block: the ``S o dS'`` row dot of value
    column ``tx`` (a dg term, from hi + lo) by the thread ``tx`` alone, a serial fp32 sum (``sh_s, sl_s [BK, DV]``,
    ``dsh_s, dsl_s [DV, BK]``, input dtype; ``acc`` a local fp32 [1]; callers guard ``tx < DV``).  A [DV, BK]
    fragment and ``T.reduce_sum`` instead would spread every row over 64 threads: 64 block-wide all-reduces in a
    row, each behind a ``__syncthreads``.

    With ``xh, xl`` (local buffers of 8, input dtype) the row ``tx`` of dS' is read 8 elements (16 bytes) at a time
    into them: the same products summed in the same order.  Read element by element (``xh`` None), each 2-byte load
    of the 32 lanes' rows (128 bytes apart, the swizzle spreading 8 rows over the banks) is a 4-way bank
    conflict.

    ``d0, nd``: only the key rows ``d0 .. d0 + nd`` of the tiles (all of them by default; ``nd`` a multiple of 8).
    ``sl_s`` None: S is its hi term alone (with ``xh, xl`` only); ``dsl_s`` None too: dS' its hi term alone (every
    table one term, ``build_bwd_dqk(one=True)``)."""
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
            if dsl_s is not None:
                for j in T.vectorized(8):
                    xl[j] = dsl_s[tx, d0 + d8 * 8 + j]
            for j in T.serial(8):
                if dsl_s is None:
                    acc[0] = acc[0] + T.cast(sh_s[d0 + d8 * 8 + j, tx], f32) * T.cast(xh[j], f32)
                elif sl_s is None:
                    acc[0] = acc[0] + T.cast(sh_s[d0 + d8 * 8 + j, tx], f32) * (T.cast(xh[j], f32) + T.cast(xl[j], f32))
                else:
                    acc[0] = acc[0] + ((T.cast(sh_s[d0 + d8 * 8 + j, tx], f32)
                                        + T.cast(sl_s[d0 + d8 * 8 + j, tx], f32))
                                       * (T.cast(xh[j], f32) + T.cast(xl[j], f32)))


@T.macro
def put_split(hi, lo, t, j, x, with_lo):
    """``hi[t, j] = rd(x)`` and, where ``with_lo`` (a build-time bool), ``lo[t, j] = rd(x - rd(x))``: one element of
    a two-term split (``x`` an fp32 expression, ``hi``, ``lo`` input-dtype tiles)."""
    hi[t, j] = T.cast(x, hi.dtype)
    if with_lo:
        lo[t, j] = T.cast(x - T.cast(T.cast(x, hi.dtype), "float32"), hi.dtype)


def gate(fv, e_f, t, j):
    """``e^(G_t - G_j)`` of the gate table ``fv`` (row 4: G): exp2 of the difference, or its value kept in the fp32
    fragment ``e_f`` (None: computed here)."""
    return T.exp2((fv[4, t] - fv[4, j]) * LOG2E) if e_f is None else e_f[t, j]


@T.macro
def intra_terms(q_s, k_s, do_s, uh_s, ul_s, dyh_s, dyl_s, fv, mqh, m1h, m2h, m3h, m_s, qk, kk, dpu, dyu, x_f, dq_f,
                dk_f, db2, t2, r2, nv, hv, c, scale, e_f=None):
    """The intra-chunk (64x64) terms of chunk ``c``, value head ``hv`` (module docstring): the dbeta row sums by
    halves of the columns into ``db2 [2, HV, NC, 64]`` (``t2 [2, 64, 32], r2 [2, 64]`` fp32 fragments,
    ``store_half_sums``), the dg rectangle's summands to ``m_s [64, >= 64]`` fp32 (``rect_sums`` finishes them;
    through ``x_f`` and one fragment copy), and the products added onto ``dq_f, dk_f [64, DK]`` (fp32 fragments).
    ``fv[r, t]`` the gate table; ``qk .. x_f`` [64, 64] fp32 fragments; ``mqh .. m3h`` [64, 64] input-dtype shared
    tiles: the four 64x64 operands, single (one input-dtype term each).  ``e_f`` ([64, 64] fp32 fragment or None):
    ``e^(G_t - G_j)`` formed once there for its four uses (the same values) instead of at each.  ``ul_s, dyl_s``
    None: U and dY their hi terms alone (one product each)."""
    T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
    T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
    T.gemm(do_s, uh_s, dpu, transpose_B=True, clear_accum=True)
    if ul_s is not None:
        T.gemm(do_s, ul_s, dpu, transpose_B=True)
    T.gemm(dyh_s, uh_s, dyu, transpose_A=True, transpose_B=True, clear_accum=True)
    if ul_s is not None:
        T.gemm(dyl_s, uh_s, dyu, transpose_A=True, transpose_B=True)
        T.gemm(dyh_s, ul_s, dyu, transpose_A=True, transpose_B=True)
    if e_f is not None:
        for t, j in T.Parallel(BT, BT):
            e_f[t, j] = T.exp2((fv[4, t] - fv[4, j]) * LOG2E)

    # (t, j) = (row, col); F5 = scale rq, F6 = rk, F7 = beta (0 on rows past the end)
    for t, j in T.Parallel(BT, BT):
        # dQK (rows t < nv) times rk_j -> dq~ operand
        # the value first, then a select: no branch per element (masked values, inf or not, are never selected)
        x = scale * gate(fv, e_f, t, j) * dpu[t, j] * fv[6, j]
        x_f[t, j] = T.if_then_else((j <= t) & (t < nv), x, T.float32(0))
    for t, j in T.Parallel(BT, BT):
        put_split(mqh, None, t, j, x_f[t, j], False)
    for t, j in T.Parallel(BT, BT):
        # rq_t dQK_tj (-> dk~ operand, transposed) ; dpu <- its product with q~ k~^T for dg
        x = fv[5, t] * gate(fv, e_f, t, j) * dpu[t, j]
        x_f[t, j] = T.if_then_else(j <= t, x, T.float32(0))
    for t, j in T.Parallel(BT, BT):
        put_split(m1h, None, t, j, x_f[t, j], False)
        dpu[t, j] = x_f[t, j] * fv[6, j] * qk[t, j]
    for t, j in T.Parallel(BT, BT):
        # braw = e rk_t rk_j KK (j < t);  kk <- braw
        x = gate(fv, e_f, t, j) * fv[6, t] * fv[6, j] * kk[t, j]
        kk[t, j] = T.if_then_else(j < t, x, T.float32(0))
    for t, j in T.Parallel(BT, BT):
        dyu[t, j] = T.if_then_else(j < t, -dyu[t, j], T.float32(0))          # dA
    for hf, t, j in T.Parallel(2, BT, BT // 2):
        t2[hf, t, j] = dyu[t, hf * (BT // 2) + j] * kk[t, hf * (BT // 2) + j]
    store_half_sums(t2, r2, db2, hv, c)
    for t, j in T.Parallel(BT, BT):
        x = dpu[t, j] + fv[7, t] * dyu[t, j] * kk[t, j]
        x_f[t, j] = T.if_then_else(j < t, x, T.float32(0))
    T.copy(x_f, m_s[:, 0:BT])
    for t, j in T.Parallel(BT, BT):
        # dBk = beta_t e dA
        x = fv[7, t] * dyu[t, j] * gate(fv, e_f, t, j)
        x_f[t, j] = T.if_then_else(j < t, x, T.float32(0))
    for t, j in T.Parallel(BT, BT):
        put_split(m2h, None, t, j, x_f[t, j] * fv[6, j], False)
        put_split(m3h, None, t, j, x_f[t, j] * fv[6, t], False)

    T.gemm(mqh, k_s, dq_f)
    T.gemm(m1h, q_s, dk_f, transpose_A=True)
    T.gemm(m2h, k_s, dk_f)
    T.gemm(m3h, k_s, dk_f, transpose_A=True)


@T.macro
def rect_sums(m_s, acc, rect, part, hv, c):
    """``rect_s = sum_{t >= s} sum_{j < s} m_tj`` from ``m_s [64, >= 64]`` fp32 (shared; overwritten): inclusive
    row prefix sums, then a column walk by P groups of 64 threads over P row blocks (``part [P, 64]`` fp32 shared),
    the P partial sums then added in block order."""
    T.cumsum(m_s[:, 0:BT], dim=1)      # the first 64 columns (m_s may have padding columns past them)
    tx = T.get_thread_binding()
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
