"""Stage 2: the intra-chunk kernel (everything that does not depend on the state).

One CTA (128 threads) per (chunk, value head).  Fused in it:

* the chunk-local gate cumsum ``G`` (fp32, `cumsum.py`);
* the in-kernel q/k L2 norm, as fp32 per-row factors ``rq, rk``
  (``1 / sqrt(sum x^2 + 1e-6)``); the bf16/fp16 q/k themselves are never
  rounded again, the factors are applied to the fp32 results of the matmuls;
* ``KK^T`` and ``QK^T`` (wgmma, bf16/fp16 operands, fp32 accumulation: the
  products are exact, the sums are fp32);
* ``A[t, j] = beta_t rk_t rk_j exp(G_t - G_j) (k_t . k_j)`` for ``j < t``, in fp32;
* the triangular solve ``Tinv = (I + A)^{-1}``: exact fp32 forward substitution
  on the four 16x16 diagonal blocks (CUDA cores, one thread per column, in
  registers), then two block merges ``L <- L - L A_o L`` (widths 16 and 32) as
  64x64x64 wgmmas on two-term bf16/fp16 splits (3 products each, fp32
  accumulation, ~2^-16 relative; no TF32 anywhere);
* ``Ag = Tinv diag(beta)`` and ``P[t, j] = scale rq_t rk_j exp(G_t - G_j) (q_t . k_j)``
  (``j <= t``), both written as a two-term split ``hi + lo`` in the input
  dtype (``hi = round(x)``, ``lo = round(x - hi)``), i.e. about 16 mantissa bits,
  so the recurrent kernel can use them as wgmma operands at near-fp32 accuracy;
* four fp32 per-row factors ``F`` that fold the gates and norms for the
  recurrent kernel (see below).

Outputs (all padded per chunk: rows/cols past the end of the sequence are 0):

* ``Ah, Al, Ph, Pl``: ``[HV, NC, 64, 64]`` in the input dtype,
* ``F``: ``[HV, NC, 4, 64]`` fp32 with
  ``F[0, t] = exp(G_t) rk_t``            (row factor of ``K @ S``),
  ``F[1, t] = scale exp(G_t) rq_t``      (row factor of ``Q @ S``),
  ``F[2, t] = exp(G_L - G_t) rk_t``      (row factor of the state update),
  ``F[3, t] = exp(G_L)``                 (state decay of the chunk, same for all t).

Every exponent is of a difference ``G_t - G_j`` with ``j <= t`` (or of ``G_t``,
``G_L - G_t``), never a ratio of exponentials, so gates near -20/token cannot
overflow; the masked entries select 0 instead of evaluating a product.
"""

import tilelang
import tilelang.language as T

from .cumsum import BT, LOG2E, load_chunk_gate_cumsum

THREADS = 128


@T.macro
def merge_level(w, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype):
    """One block-merge level of the triangular inverse, in place on ``l_s`` (fp32).

    On entry ``l_s = L = blockdiag(L_0, L_1, ...)`` holds the inverses of the
    diagonal ``w x w`` blocks of ``M = I + A``.  With ``A_o`` = the blocks
    ``(2i+1, 2i)`` of ``A`` (the coupling inside each ``2w x 2w`` diagonal block),
    ``[[M0, 0], [A10, M1]]^{-1} = [[L0, 0], [-L1 A10 L0, L1]]``, i.e.
    ``L <- L - L A_o L``: two 64x64x64 products, each as 3 wgmmas of two-term
    splits (hi*hi + lo*hi + hi*lo, fp32 accumulation; ~2^-16 relative).
    """
    for r, m in T.Parallel(BT, BT):
        lh_s[r, m] = T.cast(l_s[r, m], dtype)
        ll_s[r, m] = T.cast(l_s[r, m] - T.cast(T.cast(l_s[r, m], dtype), "float32"), dtype)
        oh_s[r, m] = T.cast(
            T.if_then_else(((r // w) % 2 == 1) & (m // w == r // w - 1), a_s[r, m], T.float32(0)), dtype)
        ol_s[r, m] = T.cast(
            T.if_then_else(((r // w) % 2 == 1) & (m // w == r // w - 1),
                           a_s[r, m] - T.cast(T.cast(a_s[r, m], dtype), "float32"), T.float32(0)), dtype)
    T.gemm(oh_s, lh_s, x_f, clear_accum=True)
    T.gemm(ol_s, lh_s, x_f)
    T.gemm(oh_s, ll_s, x_f)
    for r, m in T.Parallel(BT, BT):
        xh_s[r, m] = T.cast(x_f[r, m], dtype)
        xl_s[r, m] = T.cast(x_f[r, m] - T.cast(T.cast(x_f[r, m], dtype), "float32"), dtype)
    T.gemm(lh_s, xh_s, x_f, clear_accum=True)
    T.gemm(ll_s, xh_s, x_f)
    T.gemm(lh_s, xl_s, x_f)
    for r, m in T.Parallel(BT, BT):
        x_f[r, m] = l_s[r, m] - x_f[r, m]
    T.copy(x_f, l_s)


def build_intra_kernel(DK: int, dtype: str):
    """Return the TileLang prim_func of the intra-chunk kernel.

    Compile-time: ``DK`` (64 or 128), ``dtype`` ("bfloat16" | "float16").
    Runtime (symbolic): Ttot tokens, H q/k heads, HV value heads, N sequences,
    NC chunks; ``scale`` (fp32) and ``use_l2`` (int32, 0/1) are scalars.

    Arguments:
      q, k          [Ttot, H, DK]       dtype
      g, beta       [Ttot, HV]          fp32
      cu_seqlens    [N + 1]             int32
      chunk_indices [NC, 2]             int32  (sequence id, chunk id within it)
      Ah, Al, Ph, Pl[HV, NC, 64, 64]    dtype  (outputs)
      F             [HV, NC, 4, 64]     fp32   (output)
    """
    assert DK in (64, 128)
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"

    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    N = T.dynamic("N")
    NC = T.dynamic("NC")

    @T.prim_func
    def gdn_intra_chunk(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        g: T.Tensor((Ttot, HV), f32),
        beta: T.Tensor((Ttot, HV), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        Ah: T.Tensor((HV, NC, BT, BT), dtype),
        Al: T.Tensor((HV, NC, BT, BT), dtype),
        Ph: T.Tensor((HV, NC, BT, BT), dtype),
        Pl: T.Tensor((HV, NC, BT, BT), dtype),
        F: T.Tensor((HV, NC, 4, BT), f32),
        scale: T.float32,
        use_l2: T.int32,
    ):
        with T.Kernel(NC, HV, threads=THREADS) as (c, hv):
            h = hv // (HV // H)
            seq = chunk_indices[c, 0]
            ic = chunk_indices[c, 1]
            bos = cu_seqlens[seq]
            eos = cu_seqlens[seq + 1]
            t0 = bos + ic * BT
            nv = T.min(eos - t0, BT)

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            g_s = T.alloc_shared((BT,), f32)
            b_s = T.alloc_shared((BT,), f32)
            rq_s = T.alloc_shared((BT,), f32)
            rk_s = T.alloc_shared((BT,), f32)
            a_s = T.alloc_shared((BT, BT), f32)

            sq = T.alloc_fragment((BT, DK), f32)
            ss = T.alloc_fragment((BT,), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            t16 = T.alloc_local((16,), f32)
            l_s = T.alloc_shared((BT, BT), f32)
            lh_s = T.alloc_shared((BT, BT), dtype)
            ll_s = T.alloc_shared((BT, BT), dtype)
            oh_s = T.alloc_shared((BT, BT), dtype)
            ol_s = T.alloc_shared((BT, BT), dtype)
            xh_s = T.alloc_shared((BT, BT), dtype)
            xl_s = T.alloc_shared((BT, BT), dtype)
            x_f = T.alloc_fragment((BT, BT), f32)

            # ---- loads (rows past the end of the sequence are zero) ----
            for r, d in T.Parallel(BT, DK):
                q_s[r, d] = T.if_then_else(r < nv, q[t0 + r, h, d], T.cast(0, dtype))
                k_s[r, d] = T.if_then_else(r < nv, k[t0 + r, h, d], T.cast(0, dtype))
            load_chunk_gate_cumsum(g, beta, hv, t0, nv, g_s, b_s)

            # ---- L2-norm row factors in fp32 (1 when use_l2 == 0) ----
            for r, d in T.Parallel(BT, DK):
                sq[r, d] = T.cast(q_s[r, d], f32) * T.cast(q_s[r, d], f32)
            T.reduce_sum(sq, ss, dim=1)
            for r in T.Parallel(BT):
                rq_s[r] = T.if_then_else(use_l2 != 0, T.float32(1) / T.sqrt(ss[r] + T.float32(1e-6)), T.float32(1))
            for r, d in T.Parallel(BT, DK):
                sq[r, d] = T.cast(k_s[r, d], f32) * T.cast(k_s[r, d], f32)
            T.reduce_sum(sq, ss, dim=1)
            for r in T.Parallel(BT):
                rk_s[r] = T.if_then_else(use_l2 != 0, T.float32(1) / T.sqrt(ss[r] + T.float32(1e-6)), T.float32(1))

            # ---- K K^T and Q K^T on the tensor cores (exact products, fp32 sums) ----
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)

            # ---- A (strictly lower, gated, beta rows) into shared fp32 ----
            for r, j in T.Parallel(BT, BT):
                a_s[r, j] = T.if_then_else(
                    j < r,
                    b_s[r] * rk_s[r] * rk_s[j] * T.exp2((g_s[r] - g_s[j]) * LOG2E) * kk[r, j],
                    T.float32(0),
                )

            # ---- P (lower incl. diagonal, gated, scaled), split hi/lo ----
            for r, j in T.Parallel(BT, BT):
                qk[r, j] = T.if_then_else(
                    (j <= r) & (r < nv),
                    scale * rq_s[r] * rk_s[j] * T.exp2((g_s[r] - g_s[j]) * LOG2E) * qk[r, j],
                    T.float32(0),
                )
            for r, j in T.Parallel(BT, BT):
                Ph[hv, c, r, j] = T.cast(qk[r, j], dtype)
                Pl[hv, c, r, j] = T.cast(qk[r, j] - T.cast(T.cast(qk[r, j], dtype), f32), dtype)

            # ---- per-row factors for the recurrent kernel ----
            for r in T.Parallel(BT):
                F[hv, c, 0, r] = T.if_then_else(r < nv, T.exp2(g_s[r] * LOG2E) * rk_s[r], T.float32(0))
                F[hv, c, 1, r] = T.if_then_else(r < nv, scale * T.exp2(g_s[r] * LOG2E) * rq_s[r], T.float32(0))
                F[hv, c, 2, r] = T.if_then_else(
                    r < nv, T.exp2((g_s[BT - 1] - g_s[r]) * LOG2E) * rk_s[r], T.float32(0)
                )
                F[hv, c, 3, r] = T.exp2(g_s[BT - 1] * LOG2E)

            # ---- (I + A)^{-1}: exact fp32 forward substitution on the four 16x16 diagonal
            # blocks (thread j of block b owns column j in registers), then two block merges
            # on the tensor cores: L <- L - L A_o L (see merge_level) at widths 16 and 32.
            tx = T.get_thread_binding()
            if tx < BT:
                blk = tx // 16
                jj = tx % 16
                for r in T.unroll(16):
                    t16[r] = T.if_then_else(jj == r, T.float32(1), T.float32(0))
                    for m in T.unroll(r):
                        t16[r] = t16[r] - a_s[blk * 16 + r, blk * 16 + m] * t16[m]
                # column tx of the block-diagonal L (zeros outside the diagonal block)
                for r in T.unroll(BT):
                    l_s[r, tx] = T.if_then_else(r // 16 == blk, t16[r % 16], T.float32(0))
            merge_level(16, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype)
            merge_level(32, a_s, l_s, lh_s, ll_s, oh_s, ol_s, xh_s, xl_s, x_f, dtype)

            # ---- Ag = Tinv diag(beta) (column j scaled by beta_j, 0 past the end), split hi/lo ----
            for r, j in T.Parallel(BT, BT):
                Ah[hv, c, r, j] = T.cast(l_s[r, j] * b_s[j], dtype)
                Al[hv, c, r, j] = T.cast(
                    l_s[r, j] * b_s[j] - T.cast(T.cast(l_s[r, j] * b_s[j], dtype), f32), dtype
                )

    return gdn_intra_chunk


PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}
