"""Intra-chunk kernel ``gdn_intra``: one CTA (128 threads) per (chunk, value head).  It

* never computes ``P = Q K^T`` (the output kernel recomputes it from q/k in registers);
* loads k (and q, for the in-kernel L2 norm alone) with one TMA copy while the gates load, and zeroes k's rows
  past the sequence in shared memory; with the split merges q is read per element instead (shared memory);
* does the two block merges of the triangular inverse in fp32 on the CUDA cores (``merge="fp32"``, the
  dispatch's), or as wgmma with single input-dtype operands ("bf16": 2 per level) or 3-term splits ("split": 6);
* stores ``Ag = Tinv diag(beta)`` as one input-dtype term (``ag="bf16"``), a two-term split, or one fp16 term
  (``ag="fp16"``: the tables of the fp16-operand precision, P's included).

Math: ``A[t, j] = beta_t rk_t rk_j exp(G_t - G_j) (k_t . k_j)`` (j < t, fp32,
exact-operand wgmma ``K K^T``), fp32 forward substitution on the 16x16 diagonal blocks, merges
``L <- L - L A_o L`` at widths 16 and 32 (in fp32: ``L_21 = -L_22 (A_21 L_11)`` on each block pair).

Outputs (rows/cols past the end of the sequence are 0):
  Ah, Al  [HV, NC, 64, 64]  dtype, fp16 with ag == "fp16" (Al written only when ag == "split")
  F       [HV, NC, 8, 64]   fp32:  0 e^G rk, 1 scale e^G rq, 2 e^(GL - G) rk, 3 e^GL, 4 G,
                                   5 scale rq, 6 rk, 7 the log2 norm bounds' cumsum (``cp_warm``)
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.prologue import chunk_span, dynamic_dims, zero_rows_past

from .cumsum import BT, LOG2E, load_chunk_gate_cumsum

THREADS = 128
# Row padding (fp32 elements) of the fp32 shared tiles A and L: a row of 64 + 8 floats puts the 8 rows a warp's
# accumulator fragment touches at once in different banks (unpadded, the rows are 256 B apart, all in the same
# banks: 8-way conflicts on every fragment store and 4-way on the float2 accesses of the merges).
FP32_ROW = BT + 8
MERGES = ("fp32", "bf16", "split")   # the block merges: fp32 CUDA cores, or wgmma on one / two-term operands


def fp32_tile():
    """A ``[64, 64]`` fp32 shared tile with padded rows (``[64, FP32_ROW]``; only columns < 64 are used)."""
    return T.alloc_shared((BT, FP32_ROW), "float32")


@T.macro
def _merge(w, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype, msplit):
    """One merge level in place on ``l_s`` (fp32): ``L <- L - L (A_o L)``, A_o = the blocks (2i+1, 2i)
    of width ``w``; operands single input-dtype terms, or 3-term splits when ``msplit``."""
    # the values first, then selects: no branch per element (as in ``gate_kkt``)
    for r, m in T.Parallel(BT, BT):
        lh_s[r, m] = T.cast(l_s[r, m], dtype)
        a = a_s[r, m]
        oh_s[r, m] = T.cast(T.if_then_else(((r // w) % 2 == 1) & (m // w == r // w - 1), a, T.float32(0)), dtype)
    if msplit:
        for r, m in T.Parallel(BT, BT):
            ll_s[r, m] = T.cast(l_s[r, m] - T.cast(T.cast(l_s[r, m], dtype), "float32"), dtype)
            al = a_s[r, m] - T.cast(T.cast(a_s[r, m], dtype), "float32")
            ol_s[r, m] = T.cast(T.if_then_else(((r // w) % 2 == 1) & (m // w == r // w - 1), al, T.float32(0)),
                                dtype)
    T.gemm(oh_s, lh_s, x_f, clear_accum=True)
    if msplit:
        T.gemm(ol_s, lh_s, x_f)
        T.gemm(oh_s, ll_s, x_f)
    for r, m in T.Parallel(BT, BT):
        xh_s[r, m] = T.cast(x_f[r, m], dtype)
    if msplit:
        for r, m in T.Parallel(BT, BT):
            xl_s[r, m] = T.cast(x_f[r, m] - T.cast(T.cast(x_f[r, m], dtype), "float32"), dtype)
    T.gemm(lh_s, xh_s, x_f, clear_accum=True)
    if msplit:
        T.gemm(ll_s, xh_s, x_f)
        T.gemm(lh_s, xl_s, x_f)
    # L - X into the fragment, then back to l_s: an in-place update of l_s made TileLang put a CTA barrier in
    # every iteration of the unrolled loop (16 per merge); this form has one
    for r, m in T.Parallel(BT, BT):
        x_f[r, m] = l_s[r, m] - x_f[r, m]
    for r, m in T.Parallel(BT, BT):
        l_s[r, m] = x_f[r, m]


@T.macro
def _merge_pair_fp32(a_s, l_s, xr, R, C, K0, w, rstep, nc):
    """One block pair of a merge level in fp32, in place: rows ``R + rstep a`` (a < 2) and columns ``C + j`` (j <
    ``nc``) of ``L_21 = -L_22 X``, ``X = A_21 L_11``, the blocks of width ``w`` from row / column ``K0``; ``X`` goes
    to shared memory over ``A_21`` (dead from then on).  ``xr``: a local fp32 ``[2 nc]``."""
    for j in T.unroll(2 * nc):
        xr[j] = T.float32(0)
    for m in T.unroll(w):
        for a in T.unroll(2):
            for j in T.unroll(nc):
                xr[a * nc + j] = xr[a * nc + j] + a_s[R + rstep * a, K0 + m] * l_s[K0 + m, C + j]
    T.sync_threads()
    for a in T.unroll(2):
        for j in T.unroll(nc):
            a_s[R + rstep * a, C + j] = xr[a * nc + j]
    T.sync_threads()
    for j in T.unroll(2 * nc):
        xr[j] = T.float32(0)
    for m in T.unroll(w):
        for a in T.unroll(2):
            for j in T.unroll(nc):
                xr[a * nc + j] = xr[a * nc + j] - l_s[R + rstep * a, K0 + w + m] * a_s[K0 + w + m, C + j]
    for a in T.unroll(2):
        for j in T.unroll(nc):
            l_s[R + rstep * a, C + j] = xr[a * nc + j]


@T.macro
def _merge_fp32(a_s, l_s, xr):
    """Both merge levels in exact fp32 on the CUDA cores, in place on ``l_s``: at width 16, ``L_(2p+1, 2p) =
    -L_(2p+1, 2p+1) (A_(2p+1, 2p) L_(2p, 2p))`` for the block pairs p = 0, 1 (2 x 2 outputs a thread); at width 32
    the same with the 32-wide blocks (2 x 4 outputs a thread).  A thread's rows are 8 (16) apart, so a warp's rows
    fall in different banks.  ``xr``: a local fp32 ``[8]``."""
    tx = T.get_thread_binding()
    p = tx // 64
    _merge_pair_fp32(a_s, l_s, xr, 32 * p + 16 + (tx % 64) // 8, 32 * p + (tx % 8) * 2, 32 * p, 16, 8, 2)
    T.sync_threads()
    _merge_pair_fp32(a_s, l_s, xr, 32 + tx // 8, (tx % 8) * 4, 0, 32, 16, 4)


@T.macro
def l2_row_factors(x_s, sq, ss, r_s):
    """``r_s[r] = 1 / sqrt(|x_s[r]|^2 + 1e-6)`` (fp32) of a shared ``[BT, DK]`` tile (``sq``, ``ss``: fp32
    fragments ``[BT, DK]``, ``[BT]``)."""
    for r, d in T.Parallel(BT, x_s.shape[1]):
        sq[r, d] = T.cast(x_s[r, d], "float32") * T.cast(x_s[r, d], "float32")
    T.reduce_sum(sq, ss, dim=1)
    for r in T.Parallel(BT):
        r_s[r] = T.float32(1) / T.sqrt(ss[r] + T.float32(1e-6))


@T.macro
def row_exponents(x_s, sq, ss, c_s):
    """``c_s[r] = ceil(log2(max_d |x_s[r, d]|))`` (fp32; -60 for a zero row) of a shared ``[BT, DK]`` tile: the
    power of two that takes the row into [-1, 1]."""
    for r, d in T.Parallel(BT, x_s.shape[1]):
        sq[r, d] = T.abs(T.cast(x_s[r, d], "float32"))
    T.reduce_max(sq, ss, dim=1)
    for r in T.Parallel(BT):
        c_s[r] = T.ceil(T.log2(T.max(ss[r], T.float32(2.0 ** -60))))


@T.macro
def diagonal(kk, d_s):
    """``d_s[r] = kk[r, r]`` (a ``[BT, BT]`` fragment into a shared ``[BT]`` tile)."""
    for r, j in T.Parallel(BT, BT):
        if r == j:
            d_s[r] = kk[r, j]


@T.macro
def bound_terms(kn_s, b_s, rk_s):
    """``kn_s`` (shared fp32 ``[BT]``, entering as ``||k_r||^2``): the inclusive cumsum of ``log2 max(1, |1 -
    beta_r rk_r^2 ||k_r||^2|)`` over the chunk, the norm-bound terms of ``cp_warm``'s row 7."""
    for r in T.Parallel(BT):
        kn_s[r] = T.log2(T.max(T.float32(1), T.abs(T.float32(1) - b_s[r] * rk_s[r] * rk_s[r] * kn_s[r])))
    T.cumsum(kn_s, dim=0)


@T.macro
def gate_kkt(kk, a_s, b_s, rk_s, g_s):
    """``A[r, j] = beta_r rk_r rk_j e^(G_r - G_j) (k_r . k_j)`` for j < r, else 0 (fp32) from the product ``kk = K
    K^T`` (overwritten), stored to the shared ``a_s``."""
    # in the fragment first, then one copy: with no shared store between them, each thread loads its 2 rows' and 16
    # columns' gate values once instead of once per element
    for r, j in T.Parallel(BT, BT):
        # the value first, then a select: no branch per element (masked values, inf or not, are never selected)
        a = b_s[r] * rk_s[r] * rk_s[j] * T.exp2((g_s[r] - g_s[j]) * LOG2E) * kk[r, j]
        kk[r, j] = T.if_then_else(j < r, a, T.float32(0))
    for r, j in T.Parallel(BT, BT):
        a_s[r, j] = kk[r, j]


@T.macro
def solve_diag16(a_s, l_s, t16):
    """``l_s`` = the inverses of the 16x16 diagonal blocks of ``I + A`` (zero elsewhere): exact fp32
    forward substitution, one thread per column."""
    tx = T.get_thread_binding()
    if tx < BT:
        blk = tx // 16
        jj = tx % 16
        for r in T.unroll(16):
            t16[r] = T.if_then_else(jj == r, T.float32(1), T.float32(0))
            for m in T.unroll(r):
                t16[r] = t16[r] - a_s[blk * 16 + r, blk * 16 + m] * t16[m]
        for r in T.unroll(BT):
            l_s[r, tx] = T.if_then_else(r // 16 == blk, t16[r % 16], T.float32(0))


def build_intra_chunk(DK: int, dtype: str, merge: str = "bf16", ag: str = "bf16", th: bool = False,
                      pt: bool = False):
    """TileLang prim_func of ``gdn_intra``.  The merges write their product ``A_o L`` over the ``A_o`` tile
    (dead by then): 53 KiB of shared memory per CTA with fp32 or bf16 merges (4 CTAs per SM on an H100/H200), 69
    KiB with split ones (3).  ``th``: also store ``Tinv = (I + A)^-1`` itself, rounded once to
    the input dtype, into ``Th`` (the autograd Function keeps it, with Ah and Al, for the backward: its prep kernel
    then skips K K^T and the solve; ``kernels/backward/prep.py``); without it ``Th`` is not accessed (pass ``Ah``).
    ``pt``: also store the gated scores ``P = scale rq_t rk_j e^(G_t - G_j) (q_t . k_j)`` (j <= t) split into
    ``Ph + Pl`` for the fused state-output kernel, the product and expression its P warpgroup computes (needs the
    fp32 or bf16 merges: q by TMA); with ``ag="fp16"`` as ``Ph`` alone, one fp16 term; without ``pt`` ``Ph`` /
    ``Pl`` are not accessed (pass ``Ah``).  With ``ag="fp16"`` and bf16 inputs it also stores q and k as fp16 into
    ``qo`` / ``ko`` (the fused kernel's operands; every row of each chunk's q/k head, once per head: the CTAs of a
    GVA group's first value head), each row scaled by the power of two ``2^-c`` that takes it into [-1, 1] (so no
    bf16 value overflows fp16), ``2^c`` folded into the gate table's row factors F0, F2 (k) and F1 (q), and without
    ``pt`` into F6 (k) and F5 (q), the factors of P that the fused kernel then forms from the copies; else ``qo``
    / ``ko`` are not accessed (pass ``q`` / ``k``).

    Arguments:
      q, k        [Ttot, H, DK]     dtype   (q only read when use_l2 != 0 or with ``pt``)
      g, beta     [Ttot, HV]        fp32
      cu_seqlens  [N + 1]           int32
      chunk_indices [NC, 2]         int32
      Ah, Al      [HV, NC, 64, 64]  op      (outputs; op = fp16 with ag == "fp16", else dtype)
      F           [HV, NC, 8, 64]   fp32    (output; rows 0-2 with the copies' 2^c where qo / ko are written)
      Th          [HV, NC, 64, 64]  dtype   (output with ``th``; else not accessed)
      Ph, Pl      [HV, NC, 64, 64]  op      (outputs with ``pt``, Pl unless ag == "fp16"; else not accessed)
      qo, ko      [Ttot, H, DK]     op      (outputs with ag == "fp16" of bf16 inputs; else not accessed)
      scale fp32, use_l2 int32
    """
    assert DK in (64, 128)
    assert dtype in ("bfloat16", "float16")
    assert merge in MERGES and ag in ("bf16", "split", "fp16")
    op = "float16" if ag == "fp16" else dtype       # the type of the Ag and P tables
    assert not (th and ag == "fp16"), "Tinv is kept for the backward with Ag split"
    p_lo = ag != "fp16"
    cv = op != dtype                                # q and k copied to the operand type
    msplit = merge == "split"
    q_tma = not msplit
    assert q_tma or not (pt or cv), "P tables and fp16 copies need q by TMA (fp32 or bf16 merges)"
    asplit = ag == "split"
    f32 = "float32"

    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")

    @T.prim_func
    def gdn_intra(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        g: T.Tensor((Ttot, HV), f32),
        beta: T.Tensor((Ttot, HV), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        Ah: T.Tensor((HV, NC, BT, BT), op),
        Al: T.Tensor((HV, NC, BT, BT), op),
        F: T.Tensor((HV, NC, 8, BT), f32),
        Th: T.Tensor((HV, NC, BT, BT), op),             # op == dtype where it is written (th: Ag split)
        Ph: T.Tensor((HV, NC, BT, BT), op),
        Pl: T.Tensor((HV, NC, BT, BT), op),
        qo: T.Tensor((Ttot, H, DK), op),
        ko: T.Tensor((Ttot, H, DK), op),
        scale: T.float32,
        use_l2: T.int32,
    ):
        # value heads fastest: a GVA group's CTAs of one chunk launch together and share its q / k tiles in L2
        with T.Kernel(HV, NC, threads=THREADS) as (hv, c):
            h = hv // (HV // H)
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, True)
            nv = T.min(eos - t0, BT)

            k_s = T.alloc_shared((BT, DK), dtype)
            if q_tma:
                q_s = T.alloc_shared((BT, DK), dtype)
            g_s = T.alloc_shared((BT,), f32)
            b_s = T.alloc_shared((BT,), f32)
            rq_s = T.alloc_shared((BT,), f32)
            rk_s = T.alloc_shared((BT,), f32)
            kn_s = T.alloc_shared((BT,), f32)        # ||k_r||^2, then row 7's terms
            if pt:
                f5_s = T.alloc_shared((BT,), f32)
                f6_s = T.alloc_shared((BT,), f32)
                ph_s = T.alloc_shared((BT, BT), op)
                T.annotate_layout({ph_s: make_swizzled_layout(ph_s)})
                if p_lo:
                    pl_s = T.alloc_shared((BT, BT), op)
                    T.annotate_layout({pl_s: make_swizzled_layout(pl_s)})
            if cv:              # k's copy, then q's, staged in one tile (4 CTAs per SM kept)
                cv_s = T.alloc_shared((BT, DK), op)
                T.annotate_layout({cv_s: make_swizzled_layout(cv_s)})
                ck_s = T.alloc_shared((BT,), f32)       # the rows' exponents c
                cq_s = T.alloc_shared((BT,), f32)
            a_s = fp32_tile()
            l_s = fp32_tile()
            if merge != "fp32":
                lh_s = T.alloc_shared((BT, BT), dtype)
                oh_s = T.alloc_shared((BT, BT), dtype)
                LB = BT if msplit else 8          # the lo buffers are only used by the split merge
                ll_s = T.alloc_shared((LB, LB), dtype)
                ol_s = T.alloc_shared((LB, LB), dtype)
                xh_s = oh_s                       # A_o L over A_o: each merge reads A_o (oh, ol) before it writes X
                xl_s = ol_s
                x_f = T.alloc_fragment((BT, BT), f32)
            else:
                xr = T.alloc_local((8,), f32)

            sq = T.alloc_fragment((BT, DK), f32)
            ss = T.alloc_fragment((BT,), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            t16 = T.alloc_local((16,), f32)
            k_ready = T.alloc_barrier(arrive_count=32)
            tx = T.get_thread_binding()

            # one TMA load of k (rows past the tensor zero-filled) in flight while the gates load, then the rows past
            # the sequence zeroed in shared memory: a load per element under ``r < nv`` is a branch, and a thread's
            # eight loads then wait one after another
            if tx < 32:
                T.tma_copy(k[t0:t0 + BT, h, 0:DK], k_s, barrier=k_ready)
                if pt or cv:
                    T.tma_copy(q[t0:t0 + BT, h, 0:DK], q_s, barrier=k_ready)
                elif q_tma and use_l2 != 0:
                    T.tma_copy(q[t0:t0 + BT, h, 0:DK], q_s, barrier=k_ready)
                T.barrier_arrive(k_ready)
            load_chunk_gate_cumsum(g, beta, hv, t0, nv, g_s, b_s)
            T.barrier_wait(k_ready, 0)
            if cv:
                # q and k in the operand type, each row scaled into [-1, 1], before k's rows past the sequence are
                # zeroed: rows of the next sequence get the same values from its own chunk's CTA, rows past the
                # tensor are clipped
                row_exponents(k_s, sq, ss, ck_s)
                row_exponents(q_s, sq, ss, cq_s)
                if hv % (HV // H) == 0:
                    for r, d in T.Parallel(BT, DK):
                        cv_s[r, d] = T.cast(T.cast(k_s[r, d], f32) * T.exp2(-ck_s[r]), op)
                    T.copy(cv_s, ko[t0:t0 + BT, h, 0:DK])
                    for r, d in T.Parallel(BT, DK):
                        cv_s[r, d] = T.cast(T.cast(q_s[r, d], f32) * T.exp2(-cq_s[r]), op)
                    T.copy(cv_s, qo[t0:t0 + BT, h, 0:DK])
            zero_rows_past(k_s, nv)

            # L2-norm row factors (fp32; 1 when use_l2 == 0).  q is read only here: by TMA into a tile that shares
            # the fp32 tiles' memory (they are born later), or per element with the split merges (whose shared
            # memory the tile would grow past 3 CTAs per SM)
            if use_l2 != 0:
                if q_tma:
                    for r, d in T.Parallel(BT, DK):
                        sq[r, d] = T.if_then_else(r < nv, T.cast(q_s[r, d], f32) * T.cast(q_s[r, d], f32),
                                                  T.float32(0))
                else:
                    for r, d in T.Parallel(BT, DK):
                        sq[r, d] = T.if_then_else(r < nv,
                                                  T.cast(q[t0 + r, h, d], f32) * T.cast(q[t0 + r, h, d], f32),
                                                  T.float32(0))
                T.reduce_sum(sq, ss, dim=1)
                for r in T.Parallel(BT):
                    rq_s[r] = T.float32(1) / T.sqrt(ss[r] + T.float32(1e-6))
                l2_row_factors(k_s, sq, ss, rk_s)
            else:
                for r in T.Parallel(BT):
                    rq_s[r] = T.float32(1)
                    rk_s[r] = T.float32(1)

            if pt:
                # P as the fused kernel's P warpgroup forms it: the exact-operand Q K^T, then F5_t F6_j e^(G_t - G_j)
                # in the same order (F5 = scale rq, F6 = rk, zero past the sequence: formed once per row, not per
                # element), selected where j <= t; staged in shared memory and stored by rows; before K K^T, so
                # that q's and P's tiles are dead when the fp32 tiles they share memory with are born
                for r in T.Parallel(BT):
                    f5_s[r] = T.if_then_else(r < nv, scale * rq_s[r], T.float32(0))
                    f6_s[r] = T.if_then_else(r < nv, rk_s[r], T.float32(0))
                T.gemm(q_s, k_s, kk, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(BT, BT):
                    p = f5_s[r] * f6_s[j] * T.exp2((g_s[r] - g_s[j]) * LOG2E) * kk[r, j]
                    kk[r, j] = T.if_then_else(j <= r, p, T.float32(0))
                for r, j in T.Parallel(BT, BT):
                    ph_s[r, j] = T.cast(kk[r, j], op)
                    if p_lo:
                        pl_s[r, j] = T.cast(kk[r, j] - T.cast(T.cast(kk[r, j], op), f32), op)
                T.copy(ph_s, Ph[hv, c, 0:BT, 0:BT])
                if p_lo:
                    T.copy(pl_s, Pl[hv, c, 0:BT, 0:BT])

            # K K^T; its diagonal (||k_r||^2) gives row 7, the log2 norm bounds of the chunk's transitions
            # (``cp_warm``): G log2 e + the cumsum of log2 max(1, |1 - beta rk^2 ||k||^2|) (0 past the sequence)
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            diagonal(kk, kn_s)
            gate_kkt(kk, a_s, b_s, rk_s, g_s)
            bound_terms(kn_s, b_s, rk_s)

            for r in T.Parallel(BT):
                # with the copies, their row scales undone in the row factors of the products they enter
                fk = rk_s[r] * T.exp2(ck_s[r]) if cv else rk_s[r]
                fq = rq_s[r] * T.exp2(cq_s[r]) if cv else rq_s[r]
                F[hv, c, 0, r] = T.if_then_else(r < nv, T.exp2(g_s[r] * LOG2E) * fk, T.float32(0))
                F[hv, c, 1, r] = T.if_then_else(r < nv, scale * T.exp2(g_s[r] * LOG2E) * fq, T.float32(0))
                F[hv, c, 2, r] = T.if_then_else(r < nv, T.exp2((g_s[BT - 1] - g_s[r]) * LOG2E) * fk, T.float32(0))
                F[hv, c, 3, r] = T.exp2(g_s[BT - 1] * LOG2E)
                F[hv, c, 4, r] = g_s[r]
                # (the fused kernel forms P from the copies without P tables: their 2^c undone here)
                F[hv, c, 5, r] = T.if_then_else(r < nv, scale * (fq if cv and not pt else rq_s[r]), T.float32(0))
                F[hv, c, 6, r] = T.if_then_else(r < nv, fk if cv and not pt else rk_s[r], T.float32(0))
                F[hv, c, 7, r] = g_s[r] * LOG2E + kn_s[r]

            # 16x16 diagonal blocks: exact fp32 forward substitution, one thread per column
            solve_diag16(a_s, l_s, t16)

            # merges L <- L - L A_o L at widths 16 and 32
            if merge == "fp32":
                _merge_fp32(a_s, l_s, xr)
            else:
                _merge(16, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype, msplit)
                _merge(32, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype, msplit)

            for r, j in T.Parallel(BT, BT):
                Ah[hv, c, r, j] = T.cast(l_s[r, j] * b_s[j], op)
                if th:
                    Th[hv, c, r, j] = T.cast(l_s[r, j], op)
                if asplit:
                    Al[hv, c, r, j] = T.cast(l_s[r, j] * b_s[j] - T.cast(T.cast(l_s[r, j] * b_s[j], op), f32), op)

    return gdn_intra
