"""Stage 3 (+ stage 4 fused): the sequential state recurrence over chunks.

One CTA (128 threads = one warpgroup) per (sequence, value head, block of
``BV`` value columns).  The fp32 state block ``S[DK, BV]`` lives in registers
for the whole sequence.  Per chunk of 64 tokens (``U`` is FLA's ``v_new``)::

    S_hi, S_lo = split(S)                      # input dtype, S = S_hi + S_lo + O(2^-16 S)
    X   = V - F0 * (K @ S)                     # fp32; F0 = exp(G) rk
    U   = Ag @ X                               # Ag = Tinv diag(beta) = Ag_hi + Ag_lo
    O   = F1 * (Q @ S) + P @ U                 # stage 4 (chunk_o.py), stored in dtype
    S   = F3 * S + K^T @ (F2 * U)              # F3 = exp(G_L), F2 = exp(G_L - G) rk

This is the FlashQLA-style ordering ``U = Tinv diag(beta) (V - diag(e^G) K S)``,
which equals FLA's ``u - w S`` with ``w = Tinv diag(beta e^G) K`` but needs no
``w`` tensor.  Every matmul is a wgmma with input-dtype operands and fp32
accumulation; fp32 operands (``S``, ``X``, ``U``, ``F2 U``) are split in two
input-dtype terms and the products are summed (3 terms for ``Ag @ X`` and
``P @ U``, 2 when one side is an exact input).  Nothing is TF32.

No masking is needed inside the loop: the intra kernel zero-pads ``Ag``, ``P``
and ``F`` past the end of the sequence, so padded rows of ``K``/``V`` (the next
sequence's tokens, or TMA/predicated zeros past the tensor end) only ever meet
exact zeros.  Only the ``o`` store is predicated.
"""

import tilelang
import tilelang.language as T

from .chunk_o import chunk_output

BT = 64
THREADS = 128


def build_recurrent_kernel(DK: int, DV: int, BV: int, dtype: str, num_stages: int = 2):
    """Return the TileLang prim_func of the fused recurrence + output kernel.

    Compile-time: ``DK == DV`` (64 or 128), ``BV`` (value columns per CTA),
    ``dtype`` ("bfloat16" | "float16"), ``num_stages`` (software pipelining of
    the chunk loads).
    Runtime (symbolic): Ttot, H, HV, N sequences, NC chunks, Nh (h0 batch, 1 when
    absent), Nt (ht batch, 1 when not stored); int flags ``use_h0``, ``store_ht``
    and ``v_first`` (state layout ``[.., V, K]``; same shape since DK == DV).

    Arguments:
      q, k            [Ttot, H, DK]            dtype
      v               [Ttot, HV, DV]           dtype
      Ah, Al, Ph, Pl  [HV, NC, 64, 64]         dtype   (intra kernel)
      F               [HV, NC, 4, 64]          fp32    (intra kernel)
      cu_seqlens      [N + 1]                  int32
      chunk_offsets   [N + 1]                  int32   (first chunk id of each sequence)
      h0              [Nh, HV, DK, DV] fp32 (read as [.., DV, DK] when v_first)
      o               [Ttot, HV, DV]           dtype   (output)
      ht              [Nt, HV, DK, DV] fp32 (written as [.., DV, DK] when v_first)
    """
    assert DK in (64, 128) and DV == DK
    assert DV % BV == 0 and BV in (16, 32, 64, 128)
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"
    NV = DV // BV

    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    N = T.dynamic("N")
    NC = T.dynamic("NC")
    Nh = T.dynamic("Nh")
    Nt = T.dynamic("Nt")
    state_shape_h0 = (Nh, HV, DK, DV)
    state_shape_ht = (Nt, HV, DK, DV)

    @T.prim_func
    def gdn_recurrent_fwd(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NC, BT, BT), dtype),
        Al: T.Tensor((HV, NC, BT, BT), dtype),
        Ph: T.Tensor((HV, NC, BT, BT), dtype),
        Pl: T.Tensor((HV, NC, BT, BT), dtype),
        F: T.Tensor((HV, NC, 4, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor(state_shape_h0, f32),
        o: T.Tensor((Ttot, HV, DV), dtype),
        ht: T.Tensor(state_shape_ht, f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        with T.Kernel(NV, HV, N, threads=THREADS) as (bv, hv, n):
            h = hv // (HV // H)
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = T.ceildiv(eos - bos, BT)
            v0 = bv * BV

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            ah_s = T.alloc_shared((BT, BT), dtype)
            al_s = T.alloc_shared((BT, BT), dtype)
            ph_s = T.alloc_shared((BT, BT), dtype)
            pl_s = T.alloc_shared((BT, BT), dtype)
            f_s = T.alloc_shared((4, BT), f32)
            sh_s = T.alloc_shared((DK, BV), dtype)
            sl_s = T.alloc_shared((DK, BV), dtype)
            xh_s = T.alloc_shared((BT, BV), dtype)
            xl_s = T.alloc_shared((BT, BV), dtype)
            uh_s = T.alloc_shared((BT, BV), dtype)
            ul_s = T.alloc_shared((BT, BV), dtype)

            s_f = T.alloc_fragment((DK, BV), f32)
            ks_f = T.alloc_fragment((BT, BV), f32)
            u_f = T.alloc_fragment((BT, BV), f32)
            o_f = T.alloc_fragment((BT, BV), f32)

            # ---- initial state ----
            if use_h0 != 0:
                if v_first != 0:
                    for i, j in T.Parallel(DK, BV):
                        s_f[i, j] = h0[n, hv, v0 + j, i]
                else:
                    T.copy(h0[n, hv, 0:DK, v0:v0 + BV], s_f)
            else:
                T.clear(s_f)

            for ic in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(v[t0:t0 + BT, hv, v0:v0 + BV], v_s)
                T.copy(Ah[hv, c, 0:BT, 0:BT], ah_s)
                T.copy(Al[hv, c, 0:BT, 0:BT], al_s)
                T.copy(Ph[hv, c, 0:BT, 0:BT], ph_s)
                T.copy(Pl[hv, c, 0:BT, 0:BT], pl_s)
                T.copy(F[hv, c, 0:4, 0:BT], f_s)

                # S -> S_hi + S_lo (input dtype) for the tensor cores
                for i, j in T.Parallel(DK, BV):
                    sh_s[i, j] = T.cast(s_f[i, j], dtype)
                    sl_s[i, j] = T.cast(s_f[i, j] - T.cast(T.cast(s_f[i, j], dtype), f32), dtype)

                # X = V - F0 * (K @ S)
                T.gemm(k_s, sh_s, ks_f, clear_accum=True)
                T.gemm(k_s, sl_s, ks_f)
                for i, j in T.Parallel(BT, BV):
                    ks_f[i, j] = T.cast(v_s[i, j], f32) - f_s[0, i] * ks_f[i, j]
                for i, j in T.Parallel(BT, BV):
                    xh_s[i, j] = T.cast(ks_f[i, j], dtype)
                    xl_s[i, j] = T.cast(ks_f[i, j] - T.cast(T.cast(ks_f[i, j], dtype), f32), dtype)

                # U = Ag @ X  (3-term split product)
                T.gemm(ah_s, xh_s, u_f, clear_accum=True)
                T.gemm(al_s, xh_s, u_f)
                T.gemm(ah_s, xl_s, u_f)
                for i, j in T.Parallel(BT, BV):
                    uh_s[i, j] = T.cast(u_f[i, j], dtype)
                    ul_s[i, j] = T.cast(u_f[i, j] - T.cast(T.cast(u_f[i, j], dtype), f32), dtype)

                # O = F1 * (Q @ S) + P @ U   (stage 4, chunk_o.py)
                chunk_output(q_s, sh_s, sl_s, ph_s, pl_s, uh_s, ul_s, f_s, o_f, o, t0, eos, hv, v0, BV, dtype)

                # S = F3 * S + K^T @ (F2 * U)
                for i, j in T.Parallel(BT, BV):
                    u_f[i, j] = f_s[2, i] * u_f[i, j]
                for i, j in T.Parallel(BT, BV):
                    xh_s[i, j] = T.cast(u_f[i, j], dtype)
                    xl_s[i, j] = T.cast(u_f[i, j] - T.cast(T.cast(u_f[i, j], dtype), f32), dtype)
                for i, j in T.Parallel(DK, BV):
                    s_f[i, j] = s_f[i, j] * f_s[3, 0]
                T.gemm(k_s, xh_s, s_f, transpose_A=True)
                T.gemm(k_s, xl_s, s_f, transpose_A=True)

            # ---- final state ----
            if store_ht != 0:
                if v_first != 0:
                    for i, j in T.Parallel(DK, BV):
                        ht[n, hv, v0 + j, i] = s_f[i, j]
                else:
                    T.copy(s_f, ht[n, hv, 0:DK, v0:v0 + BV])

    return gdn_recurrent_fwd


PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}


def build_state_kernel(DK: int, DV: int, BV: int, dtype: str, precision: str = "high", num_stages: int = 2):
    """Return the TileLang prim_func of the state-only recurrence ``gdn_state_fwd``.

    The sequential part of the split path: per chunk it only advances the state and
    writes what the parallel output kernel (``chunk_o.build_output_kernel``) needs::

        Sh, Sl = split(S)      -> Sch[c], Scl[c]         # chunk-start state for the output kernel
        X     = V - F0 * (K @ S)    high: K Sh + K Sl (2 wgmma)     fast: K Sh (1), Sl not written
        U     = Ag @ X      high: Ah Xh + Al Xh + Ah Xl  (3 wgmma)   fast: Ah Xh (1)
        Uh, Ul = split(U)                                # written for the output kernel
        S     = F3 S + K^T @ (F2 U)   split F2 U (2 wgmma)

    7 wgmma per chunk ("high": the same products as the fused kernel, so the same accuracy)
    or 4 ("fast"), vs 12 in the fused kernel.  The state stays fp32 in registers; all
    products accumulate in fp32.  Emulated at T=2048 (bf16, H=2, HV=4, no h0, floor
    1.661e-3): high o 1.661e-3 / state 3.5e-6; fast o ~2.3e-3 / state ~1.4e-3 (FLA-like bf16
    scheme: 3.3e-3 / 2.3e-3); with h0 fast's o is ~1.4x the floor (rd(S) in Q S).  Dropping
    the lo half of F2 U as well would put the state at the FLA-like level, so both keep it.

    Arguments (as ``build_recurrent_kernel`` minus q, Ph, Pl, o), plus outputs
      Sch, Scl [HV, NC, DK, DV] dtype   chunk-start states, two-term split (Scl untouched in "fast")
      Uh, Ul  [HV, NC, 64, DV]  dtype   U = v_new as a two-term split (rows past the end are 0)
    """
    assert DK in (64, 128) and DV == DK
    assert DV % BV == 0 and BV in (16, 32, 64, 128)
    assert dtype in ("bfloat16", "float16")
    assert precision in ("high", "fast")
    hi_prec = precision == "high"
    f32 = "float32"
    NV = DV // BV

    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    N = T.dynamic("N")
    NC = T.dynamic("NC")
    Nh = T.dynamic("Nh")
    Nt = T.dynamic("Nt")

    @T.prim_func
    def gdn_state_fwd(
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NC, BT, BT), dtype),
        Al: T.Tensor((HV, NC, BT, BT), dtype),
        F: T.Tensor((HV, NC, 4, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor((Nh, HV, DK, DV), f32),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        ht: T.Tensor((Nt, HV, DK, DV), f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        with T.Kernel(NV, HV, N, threads=THREADS) as (bv, hv, n):
            h = hv // (HV // H)
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            nchunks = T.ceildiv(eos - bos, BT)
            v0 = bv * BV

            k_s = T.alloc_shared((BT, DK), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            ah_s = T.alloc_shared((BT, BT), dtype)
            al_s = T.alloc_shared((BT, BT), dtype)
            f_s = T.alloc_shared((4, BT), f32)
            sh_s = T.alloc_shared((DK, BV), dtype)
            sl_s = T.alloc_shared((DK, BV), dtype)
            xh_s = T.alloc_shared((BT, BV), dtype)
            xl_s = T.alloc_shared((BT, BV), dtype)
            uh_s = T.alloc_shared((BT, BV), dtype)
            ul_s = T.alloc_shared((BT, BV), dtype)

            s_f = T.alloc_fragment((DK, BV), f32)
            ks_f = T.alloc_fragment((BT, BV), f32)
            u_f = T.alloc_fragment((BT, BV), f32)

            if use_h0 != 0:
                if v_first != 0:
                    for i, j in T.Parallel(DK, BV):
                        s_f[i, j] = h0[n, hv, v0 + j, i]
                else:
                    T.copy(h0[n, hv, 0:DK, v0:v0 + BV], s_f)
            else:
                T.clear(s_f)

            for ic in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(v[t0:t0 + BT, hv, v0:v0 + BV], v_s)
                T.copy(Ah[hv, c, 0:BT, 0:BT], ah_s)
                if hi_prec:
                    T.copy(Al[hv, c, 0:BT, 0:BT], al_s)
                T.copy(F[hv, c, 0:4, 0:BT], f_s)

                for i, j in T.Parallel(DK, BV):
                    sh_s[i, j] = T.cast(s_f[i, j], dtype)
                    if hi_prec:
                        sl_s[i, j] = T.cast(s_f[i, j] - T.cast(T.cast(s_f[i, j], dtype), f32), dtype)
                # plain stores (a TMA store would wait for its smem read on the critical path)
                T.copy(sh_s, Sch[hv, c, 0:DK, v0:v0 + BV], disable_tma=True)
                if hi_prec:
                    T.copy(sl_s, Scl[hv, c, 0:DK, v0:v0 + BV], disable_tma=True)

                # X = V - F0 * (K @ S)
                T.gemm(k_s, sh_s, ks_f, clear_accum=True)
                if hi_prec:
                    T.gemm(k_s, sl_s, ks_f)
                for i, j in T.Parallel(BT, BV):
                    ks_f[i, j] = T.cast(v_s[i, j], f32) - f_s[0, i] * ks_f[i, j]
                for i, j in T.Parallel(BT, BV):
                    xh_s[i, j] = T.cast(ks_f[i, j], dtype)
                    if hi_prec:
                        xl_s[i, j] = T.cast(ks_f[i, j] - T.cast(T.cast(ks_f[i, j], dtype), f32), dtype)

                # U = Ag @ X
                T.gemm(ah_s, xh_s, u_f, clear_accum=True)
                if hi_prec:
                    T.gemm(al_s, xh_s, u_f)
                    T.gemm(ah_s, xl_s, u_f)
                for i, j in T.Parallel(BT, BV):
                    uh_s[i, j] = T.cast(u_f[i, j], dtype)
                    ul_s[i, j] = T.cast(u_f[i, j] - T.cast(T.cast(u_f[i, j], dtype), f32), dtype)
                T.copy(uh_s, Uh[hv, c, 0:BT, v0:v0 + BV], disable_tma=True)
                T.copy(ul_s, Ul[hv, c, 0:BT, v0:v0 + BV], disable_tma=True)

                # S = F3 * S + K^T @ (F2 * U)
                for i, j in T.Parallel(BT, BV):
                    u_f[i, j] = f_s[2, i] * u_f[i, j]
                for i, j in T.Parallel(BT, BV):
                    xh_s[i, j] = T.cast(u_f[i, j], dtype)
                    xl_s[i, j] = T.cast(u_f[i, j] - T.cast(T.cast(u_f[i, j], dtype), f32), dtype)
                for i, j in T.Parallel(DK, BV):
                    s_f[i, j] = s_f[i, j] * f_s[3, 0]
                T.gemm(k_s, xh_s, s_f, transpose_A=True)
                T.gemm(k_s, xl_s, s_f, transpose_A=True)

            if store_ht != 0:
                if v_first != 0:
                    for i, j in T.Parallel(DK, BV):
                        ht[n, hv, v0 + j, i] = s_f[i, j]
                else:
                    T.copy(s_f, ht[n, hv, 0:DK, v0:v0 + BV])

    return gdn_state_fwd
