"""Sequential state kernel with the output fused, ``gdn_state_output`` (shared-memory operands, key-first).

The smem state kernel's chain (``state_smem.py``) computes o of each chunk as well, from the state it holds in
registers, so that no chunk-start state and no U table is written or read again (the output kernel's 32 to 64 KB
per chunk and value head).  One CTA (128 threads) per (block of ``BV`` value columns, value head, sequence).  Per
chunk, three groups of wgmma with one wait each::

    Sh (+ Sl) = split(S)
    QK = Q K^T;  O = Q Sh (+ Q Sl);  KS = K Sh (+ K Sl)                         (group 1)
    X  = V - F0 KS;  O = F1 O;  P = scale rq_t rk_j e^(G_t - G_j) QK (j <= t), split
    U  = Ah Xh (+ Al Xh) (+ Ah Xl)                                               (group 2)
    O += Ph Uh (+ Pl Uh) (+ Ph Ul);  S = F3 S + K^T (rd(F2 U) (+ lo))           (group 3)
    o  = rd(O)

Every product and rounding is the one the smem state kernel and the output kernel make (``prec``:
``precision.Precision``), so o and the final state are those of the two kernels run one after the other.
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.prologue import dynamic_dims, lo_shape, load_state_kt, seq_span, split_into, store_state_kt

from .output import gated_scores

BT = 64
THREADS = 128


def build_state_output(DK: int, DV: int, BV: int, dtype: str, prec, num_stages: int = 2):
    """TileLang prim_func of ``gdn_state_output``: at most BV 32 (its fp32 state, X, U, P and O live in the
    registers of one warpgroup).

    Arguments:
      q, k     [Ttot, H, DK]          dtype
      v        [Ttot, HV, DV]         dtype
      Ah, Al   [HV, NCg, 64, 64]      dtype   (Al read only when prec.ag == "split")
      F        [HV, NCg, 8, 64]       fp32    (rows 0 F0, 1 F1, 2 F2, 3 F3, 4 G, 5 scale rq, 6 rk)
      cu_seqlens    [N + 1]  int32;  chunk_offsets [N + 1] int32
      h0       [Nh, HV, DK, DV]       fp32 (read as [.., DV, DK] when v_first)
      o        [Ttot, HV, DV]         dtype   (output)
      ht       [Nt, HV, DK, DV]       fp32    (output; [.., DV, DK] when v_first)
      use_h0, store_ht, v_first       int32
    """
    assert DK in (64, 128) and DV == DK
    assert DV % BV == 0 and BV in (16, 32)
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"
    NV = DV // BV
    ks_sp, s_sp, x_sp, ag_sp, u_sp, upd_sp = prec.state_splits()
    p_sp = prec.p == "split"
    sl_need = ks_sp or s_sp
    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")

    @T.prim_func
    def gdn_state_output(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NCg, BT, BT), dtype),
        Al: T.Tensor((HV, NCg, BT, BT), dtype),
        F: T.Tensor((HV, NCg, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor((Nh, HV, DK, DV), f32),
        o: T.Tensor((Ttot, HV, DV), dtype),
        ht: T.Tensor((Nt, HV, DK, DV), f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        with T.Kernel(NV, HV, N, threads=THREADS) as (bv, hv, n):
            h = hv // (HV // H)
            bos, eos, c0, nchunks = seq_span(cu_seqlens, chunk_offsets, n)
            v0 = bv * BV

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            if ag_sp:
                a_s = T.alloc_shared((2, BT, BT), dtype)
            else:
                ah_s = T.alloc_shared((BT, BT), dtype)
            f_s = T.alloc_shared((8, BT), f32)
            sh_s = T.alloc_shared((DK, BV), dtype)
            sl_s = T.alloc_shared(lo_shape((DK, BV), sl_need), dtype)
            xh_s = T.alloc_shared((BT, BV), dtype)
            xl_s = T.alloc_shared(lo_shape((BT, BV), x_sp or upd_sp), dtype)
            uh_s = T.alloc_shared((BT, BV), dtype)
            ul_s = T.alloc_shared(lo_shape((BT, BV), u_sp), dtype)

            s_f = T.alloc_fragment((DK, BV), f32)
            ks_f = T.alloc_fragment((BT, BV), f32)
            u_f = T.alloc_fragment((BT, BV), f32)
            o_f = T.alloc_fragment((BT, BV), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            pa = T.alloc_fragment((BT, BT), dtype)
            pl = T.alloc_fragment(lo_shape((BT, BT), p_sp), dtype)
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})

            if use_h0 != 0:
                load_state_kt(h0, s_f, v_first, n, hv, v0, BV, DK)
            else:
                T.clear(s_f)

            for ic in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(v[t0:t0 + BT, hv, v0:v0 + BV], v_s)
                if ag_sp:
                    T.copy(Ah[hv, c, 0:BT, 0:BT], a_s[0, :, :])
                    T.copy(Al[hv, c, 0:BT, 0:BT], a_s[1, :, :])
                else:
                    T.copy(Ah[hv, c, 0:BT, 0:BT], ah_s)
                T.copy(F[hv, c, 0:8, 0:BT], f_s)

                # group 1: Q K^T (issued first: a statement before the loop body's first read of a loaded tile
                # would be moved to the TMA producer's branch), Q S, K S
                T.wgmma_gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                split_into(s_f, sh_s, sl_s, sl_need)
                T.wgmma_gemm(q_s, sh_s, o_f, clear_accum=True)
                if s_sp:
                    T.wgmma_gemm(q_s, sl_s, o_f)
                if ks_sp:
                    T.wgmma_gemm(k_s, sh_s, ks_f, clear_accum=True)
                    T.gemm(k_s, sl_s, ks_f)
                else:
                    T.gemm(k_s, sh_s, ks_f, clear_accum=True)

                # X = V - F0 KS;  O = F1 O;  P from Q K^T
                for i, j in T.Parallel(BT, BV):
                    ks_f[i, j] = T.cast(v_s[i, j], f32) - f_s[0, i] * ks_f[i, j]
                split_into(ks_f, xh_s, xl_s, x_sp)
                for i, j in T.Parallel(BT, BV):
                    o_f[i, j] = o_f[i, j] * f_s[1, i]
                gated_scores(qk, pa, pl, f_s, p_sp)

                # group 2: U = Ag X
                if ag_sp:
                    T.wgmma_gemm(a_s[0, :, :], xh_s, u_f, clear_accum=True)
                    if x_sp:
                        T.wgmma_gemm(a_s[1, :, :], xh_s, u_f)
                        T.gemm(a_s[0, :, :], xl_s, u_f)
                    else:
                        T.gemm(a_s[1, :, :], xh_s, u_f)
                else:
                    if x_sp:
                        T.wgmma_gemm(ah_s, xh_s, u_f, clear_accum=True)
                        T.gemm(ah_s, xl_s, u_f)
                    else:
                        T.gemm(ah_s, xh_s, u_f, clear_accum=True)
                split_into(u_f, uh_s, ul_s, u_sp)

                # group 3: O += P U;  S = F3 S + K^T (F2 U)
                for i, j in T.Parallel(BT, BV):
                    u_f[i, j] = f_s[2, i] * u_f[i, j]
                split_into(u_f, xh_s, xl_s, upd_sp)
                for i, j in T.Parallel(DK, BV):
                    s_f[i, j] = s_f[i, j] * f_s[3, 0]
                T.wgmma_gemm(pa, uh_s, o_f)
                if p_sp:
                    T.wgmma_gemm(pl, uh_s, o_f)
                if u_sp:
                    T.wgmma_gemm(pa, ul_s, o_f)
                if upd_sp:
                    T.wgmma_gemm(k_s, xh_s, s_f, transpose_A=True)
                    T.gemm(k_s, xl_s, s_f, transpose_A=True)
                else:
                    T.gemm(k_s, xh_s, s_f, transpose_A=True)
                for i, j in T.Parallel(BT, BV):
                    if t0 + i < eos:
                        o[t0 + i, hv, v0 + j] = T.cast(o_f[i, j], dtype)

            if store_ht != 0:
                store_state_kt(s_f, ht, v_first, n, hv, v0, BV, DK)

    return gdn_state_output
