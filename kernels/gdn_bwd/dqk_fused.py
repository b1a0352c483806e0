"""Backward kernel 3+4 in one: ``gdn_bwd_dqk`` - the inter-chunk (state) and intra-chunk (64x64) gradients of
q, k, g, beta of one chunk and value head, grid (chunk, value head), 256 threads (two warpgroups; each product's
output columns split between them).

The same products and row dots as ``dqk.build_bwd_dqk_inter`` (both key blocks) followed by
``dqk.build_bwd_dqk_intra`` (module docstring of ``dqk.py``), on the same split operands, with three differences
in where values go, none in what is computed:

* dq~ and dk~ stay in two [64, DK] fp32 fragments: the inter terms are folded in after their row dots, then the
  intra products accumulate onto them by wgmma, and each element is stored once.  The separate kernels stored the
  inter terms (1 GB at B1 T32768 H16 HV32) and added the intra terms by atomics; the tiles both read (do, U, dY,
  q, k) are loaded once instead of three times (the inter kernel's two key-block CTAs and the intra kernel).
* the products are ordered so that shared memory peaks at 192 KiB (one CTA of eight warps per SM): the S o dS'
  row dots (S, dS' hi + lo: 128 KiB), R = U dS'^T (then dS' dies), Z = dO S^T, W = dY S^T (then S dies), the
  dY . v dots, then the 64x64 terms (q, k, dO, U, dY and the eight 64x64 operand tiles).
* the S o dS' dots: thread ``tx`` sums value column ``tx % DV`` over key rows ``(tx // DV) * DK/2 ..`` (the
  two halves go to ``sd[0]`` and ``sd[1]``, as the two key blocks of the separate kernels did).

dk~'s inter part is the sum of the same two fp32 terms as before (``e^(GL-G) R`` and ``-beta e^G W``; fp32
addition of two terms commutes exactly); the intra part is added by the wgmma accumulator instead of an fp32
atomic add (another rounding order of the same fp32 sum).
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims
from kernels.gdn_fwd.cumsum import LOG2E

from .dqk import BT, intra_terms, rect_sums, split_dot_rows


@T.macro
def masked_row_dot(x_f, rows_s, rs, nv, out, hv, c):
    """``out[0, hv, c, t] = sum_d [t < nv] rows_s[t, d] x_f[t, d]`` (``x_f [64, D]`` fp32 fragment, overwritten;
    ``rows_s [64, D]`` input dtype in shared memory; ``out [1, HV, NC, 64]`` fp32)."""
    f32 = "float32"
    for t, d in T.Parallel(BT, x_f.shape[1]):
        x_f[t, d] = T.if_then_else(t < nv, T.cast(rows_s[t, d], f32), T.float32(0)) * x_f[t, d]
    T.reduce_sum(x_f, rs, dim=1)
    for t in T.Parallel(BT):
        out[0, hv, c, t] = rs[t]


def build_bwd_dqk_fused(DK: int, DV: int, dtype: str):
    """Arguments (as the inter and intra kernels together; ``qz, kw, kr`` with one key block, ``sd`` with two
    halves of the key dim):
      q, k            [Ttot, H, DK]     dtype
      v, do           [Ttot, HV, DV]    dtype
      Sch, Scl        [HV, NC, DK, DV]  dtype  (forward recompute, key-first)
      Uh, Ul          [HV, NC, 64, DV]  dtype
      dSh, dSl        [HV, NC, DV, DK]  dtype  (gdn_bwd_dh, value-first)
      dYh, dYl        [HV, NC, DV, 64]  dtype
      Fb              [HV, NC, 8, 64]   fp32
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32
      dqv, dkv        [Ttot, HV, DK]    fp32   (out: every valid row)
      qz, kw, kr      [1, HV, NC, 64]   fp32   (out)
      sd              [2, HV, NC, DV]   fp32   (out)
      yv, rect, db2   [HV, NC, 64]      fp32   (out)
      scale fp32
    """
    assert DK == DV == 128, "the fused kernel's thread map assumes K = V = 128 (64 is zero-padded by the API)"
    f32 = "float32"
    NTH = 2 * DV
    HALF = DK // 2
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")

    @T.prim_func
    def gdn_bwd_dqk(
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
        qz: T.Tensor((1, HV, NC, BT), f32),
        kw: T.Tensor((1, HV, NC, BT), f32),
        kr: T.Tensor((1, HV, NC, BT), f32),
        sd: T.Tensor((2, HV, NC, DV), f32),
        yv: T.Tensor((HV, NC, BT), f32),
        rect: T.Tensor((HV, NC, BT), f32),
        db2: T.Tensor((HV, NC, BT), f32),
        scale: T.float32,
    ):
        with T.Kernel(NC, HV, threads=NTH) as (c, hv):
            h = hv // (HV // H)
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)

            f_s = T.alloc_shared((8, BT), f32)
            sh_s = T.alloc_shared((DK, DV), dtype)
            sl_s = T.alloc_shared((DK, DV), dtype)
            dsh_s = T.alloc_shared((DV, DK), dtype)
            dsl_s = T.alloc_shared((DV, DK), dtype)
            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            do_s = T.alloc_shared((BT, DV), dtype)
            v_s = T.alloc_shared((BT, DV), dtype)
            uh_s = T.alloc_shared((BT, DV), dtype)
            ul_s = T.alloc_shared((BT, DV), dtype)
            dyh_s = T.alloc_shared((DV, BT), dtype)
            dyl_s = T.alloc_shared((DV, BT), dtype)
            mqh = T.alloc_shared((BT, BT), dtype)
            mql = T.alloc_shared((BT, BT), dtype)
            m1h = T.alloc_shared((BT, BT), dtype)
            m1l = T.alloc_shared((BT, BT), dtype)
            m2h = T.alloc_shared((BT, BT), dtype)
            m2l = T.alloc_shared((BT, BT), dtype)
            m3h = T.alloc_shared((BT, BT), dtype)
            m3l = T.alloc_shared((BT, BT), dtype)
            m_s = T.alloc_shared((BT, BT), f32)

            dq_f = T.alloc_fragment((BT, DK), f32)
            dk_f = T.alloc_fragment((BT, DK), f32)
            x_f = T.alloc_fragment((BT, DK), f32)
            rs = T.alloc_fragment((BT,), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            dpu = T.alloc_fragment((BT, BT), f32)
            dyu = T.alloc_fragment((BT, BT), f32)
            y_f = T.alloc_fragment((BT, BT), f32)
            rs2 = T.alloc_fragment((BT,), f32)
            acc = T.alloc_local((1,), f32)
            xh = T.alloc_local((8,), dtype)
            xl = T.alloc_local((8,), dtype)
            tx = T.get_thread_binding()

            # 1. the S o dS' row dots (S, dS' hi + lo)
            T.copy(Fb[hv, c, 0:8, 0:BT], f_s)
            T.copy(Sch[hv, c, 0:DK, 0:DV], sh_s)
            T.copy(Scl[hv, c, 0:DK, 0:DV], sl_s)
            T.copy(dSh[hv, c, 0:DV, 0:DK], dsh_s)
            T.copy(dSl[hv, c, 0:DV, 0:DK], dsl_s)
            acc[0] = T.float32(0)
            split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx % DV, xh, xl, (tx // DV) * HALF, HALF)
            sd[tx // DV, hv, c, tx % DV] = acc[0]
            # 2. R = U dS'^T (U, dS' hi + lo) -> dk~ = e^(GL-G) R, the k.R dots
            T.copy(Uh[hv, c, 0:BT, 0:DV], uh_s)
            T.copy(Ul[hv, c, 0:BT, 0:DV], ul_s)
            T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
            T.gemm(uh_s, dsh_s, x_f, clear_accum=True)
            T.gemm(ul_s, dsh_s, x_f)
            T.gemm(uh_s, dsl_s, x_f)
            for t, d in T.Parallel(BT, DK):
                dk_f[t, d] = T.exp2((f_s[4, BT - 1] - f_s[4, t]) * LOG2E) * x_f[t, d]
            masked_row_dot(x_f, k_s, rs, nv, kr, hv, c)
            # 3. Z = dO S^T (S hi + lo) -> dq~ = scale e^G Z, the q.Z dots
            T.copy(do[t0:t0 + BT, hv, 0:DV], do_s)
            T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
            T.gemm(do_s, sh_s, x_f, transpose_B=True, clear_accum=True)
            T.gemm(do_s, sl_s, x_f, transpose_B=True)
            for t, d in T.Parallel(BT, DK):
                dq_f[t, d] = scale * T.exp2(f_s[4, t] * LOG2E) * x_f[t, d]
            masked_row_dot(x_f, q_s, rs, nv, qz, hv, c)
            # 4. W = dY S^T (dY, S hi + lo) -> dk~ += -beta e^G W, the k.W dots; then the dY . v dots
            T.copy(dYh[hv, c, 0:DV, 0:BT], dyh_s)
            T.copy(dYl[hv, c, 0:DV, 0:BT], dyl_s)
            T.gemm(dyh_s, sh_s, x_f, transpose_A=True, transpose_B=True, clear_accum=True)
            T.gemm(dyl_s, sh_s, x_f, transpose_A=True, transpose_B=True)
            T.gemm(dyh_s, sl_s, x_f, transpose_A=True, transpose_B=True)
            for t, d in T.Parallel(BT, DK):
                dk_f[t, d] = dk_f[t, d] - f_s[7, t] * T.exp2(f_s[4, t] * LOG2E) * x_f[t, d]
            masked_row_dot(x_f, k_s, rs, nv, kw, hv, c)
            T.copy(v[t0:t0 + BT, hv, 0:DV], v_s)
            for t, i in T.Parallel(BT, DV):
                x_f[t, i] = T.if_then_else(t < nv, T.cast(v_s[t, i], f32), T.float32(0)) * (
                    T.cast(dyh_s[i, t], f32) + T.cast(dyl_s[i, t], f32))
            T.reduce_sum(x_f, rs, dim=1)
            for t in T.Parallel(BT):
                yv[hv, c, t] = rs[t]
            # 5. the 64x64 terms, accumulated onto dq~ / dk~; each row stored once
            intra_terms(q_s, k_s, do_s, uh_s, ul_s, dyh_s, dyl_s, f_s, mqh, mql, m1h, m1l, m2h, m2l, m3h, m3l,
                        m_s, qk, kk, dpu, dyu, y_f, rs2, dq_f, dk_f, db2, nv, hv, c, scale, clear=False)
            for t, d in T.Parallel(BT, DK):
                if t < nv:
                    dqv[t0 + t, hv, d] = dq_f[t, d]
                    dkv[t0 + t, hv, d] = dk_f[t, d]
            rect_sums(m_s, acc, rect, hv, c)

    return gdn_bwd_dqk
