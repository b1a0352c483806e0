"""Stage 2: the intra-chunk kernel (everything that does not depend on the state).

One CTA (128 threads) per (chunk, value head).  Fused in it:

* the chunk-local gate cumsum ``G`` (fp32, `cumsum.py`);
* the in-kernel q/k L2 norm, as fp32 per-row factors ``rq, rk``
  (``1 / sqrt(sum x^2 + 1e-6)``); the bf16/fp16 q/k themselves are never
  rounded again, the factors are applied to the fp32 results of the matmuls;
* ``KK^T`` and ``QK^T`` (wgmma, bf16/fp16 operands, fp32 accumulation: the
  products are exact, the sums are fp32);
* ``A[t, j] = beta_t rk_t rk_j exp(G_t - G_j) (k_t . k_j)`` for ``j < t``, in fp32;
* the triangular solve ``Tinv = (I + A)^{-1}`` by exact fp32 forward
  substitution on the CUDA cores (thread ``j`` owns column ``j`` in registers;
  no TF32 anywhere);
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
            tcol = T.alloc_local((BT,), f32)

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

            # ---- (I + A)^{-1} by fp32 forward substitution, thread j owns column j ----
            # t[r] = delta(r, j) - sum_{m < r} A[r, m] t[m]; rows r <= j give exactly
            # t[r] = delta(r, j) because A is strictly lower and t[m] = 0 for m < j.
            tx = T.get_thread_binding()
            if tx < BT:
                for r in T.unroll(BT):
                    tcol[r] = T.if_then_else(tx == r, T.float32(1), T.float32(0))
                    for m in T.unroll(r):
                        tcol[r] = tcol[r] - a_s[r, m] * tcol[m]
                # Ag = Tinv diag(beta): column j scaled by beta_j (0 past the end)
                for r in T.unroll(BT):
                    Ah[hv, c, r, tx] = T.cast(tcol[r] * b_s[tx], dtype)
                    Al[hv, c, r, tx] = T.cast(
                        tcol[r] * b_s[tx] - T.cast(T.cast(tcol[r] * b_s[tx], dtype), f32), dtype
                    )

    return gdn_intra_chunk


PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}
