"""Sequential state kernel, register-operand form ``gdn_state_rv`` (and the CP scan ``gdn_scan_rv``).

Same math and precision knobs as ``state_smem.py``, computed transposed so that every fp32 value that
feeds the next product stays in registers (the FlashAttention-3 trick: a wgmma accumulator
re-typed to the input dtype *is* the register A operand of the next wgmma).  One warpgroup owns
``BV = 64`` value columns of one head; the state lives transposed, ``S^T [BV, DK]`` fp32::

    Sa  = rd(S^T)                  (registers)          -> Sch^T [HV, NC, DV, DK]  (direct stores)
    X^T = V^T - (Sa K^T) diag(F0)  wgmma_rs (A = Sa, B = K, K-major)
    U^T = X^T Ag^T  (+ X^T Al^T) (+ Xl^T Ag^T)          wgmma_rs, B = Ag (K-major)
                                   -> Uh^T (+ Ul^T) [HV, NC, DV, 64]  (direct stores)
    S^T = F3 S^T + rd(U^T diag(F2)) K (+ lo)            wgmma_rs, B = K (MN-major)

No shared-memory round trip and no CTA barrier between the products of one chunk: only the TMA
loads of k, v, Ag, F (warp-specialised ``T.Pipelined``) touch shared memory.  The chunk tables are
written value-first (``Sch[hv, c, i, d] = S[d, i]``, ``Uh[hv, c, i, t] = U[t, i]``); the output kernel
reads them with ``vt=True``.

``scan=True``: the CP phase-1 kernel over ``2 DV`` rows: rows ``[0, DV)`` = the segment's state from
zero, rows ``[DV, 2 DV)`` = ``M^T`` from the identity with ``v = 0``; writes ``[Z^T; M^T]`` to
``ht [Nseg, HV, 2 DV, DK]``.
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.prologue import dynamic_dims, load_state_vt, lo_shape, seq_span, store_state_vt

from .cp_warm import MAX_SEGMENTS, WARM_CHUNKS, macros

_, exact_after = macros()

BT = 64
FR = T.GemmWarpPolicy.FullRow     # every product splits its M (= value rows) over the warpgroups


def build_state_registers(DK: int, DV: int, dtype: str, prec, num_stages: int = 2, scan: bool = False, BV: int = 64,
                          warm: bool = False):
    """Arguments:
      k        [Ttot, H, DK]     dtype
      v        [Ttot, HV, DV]    dtype
      Ah, Al   [HV, NCg, 64, 64] dtype    (Al read only when prec.ag == "split")
      F        [HV, NCg, 8, 64]  fp32
      cu_seqlens, chunk_offsets [N + 1] int32   (sequences, or CP segments)
      h0       [Nh, HV, DK, DV]  fp32 (read as [.., DV, DK] when v_first)
      Sch, Scl [HV, NCg, DV, DK] dtype    (outputs, value-first; Scl only when prec.s == "split")
      Uh, Ul   [HV, NCg, DV, 64] dtype    (outputs, value-first; Ul only when prec.u == "split")
               (scan: Sch, Scl, Uh, Ul [1, 1, 1, 1], not accessed)
      ht       [Nt, HV, DK, DV]  fp32 (written as [.., DV, DK] when v_first); scan: [Nt, HV, 2 DV, DK]
      use_h0, store_ht, v_first int32
    ``warm`` (scan): ``chunk_offsets`` is ``cp_warm``'s ``[3 N + 1]`` table of all N segments, and a segment's
    CTA runs (and writes its ``[Z^T; M^T]``) only where a later segment of its sequence needs an exact start state.
    """
    assert DK in (64, 128) and DV == DK
    assert BV in (64, 128) and DV % BV == 0
    assert dtype in ("bfloat16", "float16")
    assert scan or not warm, "warm-up starts decide which segments the CP scan runs"
    f32 = "float32"
    threads = 128 * (BV // 64)
    Wr = 2 * DV if scan else DV
    NV = Wr // BV
    ks_sp, s_sp, x_sp, ag_sp, u_sp, upd_sp = prec.state_splits(scan)
    store = not scan

    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")
    ht_shape = (Nt, HV, 2 * DV, DK) if scan else (Nt, HV, DK, DV)
    s_shape = (HV, NCg, DV, DK) if store else (1, 1, 1, 1)     # the scan writes no chunk table
    u_shape = (HV, NCg, DV, BT) if store else (1, 1, 1, 1)

    @T.prim_func
    def gdn_state_rv(
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NCg, BT, BT), dtype),
        Al: T.Tensor((HV, NCg, BT, BT), dtype),
        F: T.Tensor((HV, NCg, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((3 * N + 1 if warm else N + 1,), "int32"),
        h0: T.Tensor((Nh, HV, DK, DV), f32),
        Sch: T.Tensor(s_shape, dtype),
        Scl: T.Tensor(s_shape, dtype),
        Uh: T.Tensor(u_shape, dtype),
        Ul: T.Tensor(u_shape, dtype),
        ht: T.Tensor(ht_shape, f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        with T.Kernel(NV, HV, N, threads=threads) as (bv, hv, n):
            h = hv // (HV // H)
            if warm:    # run only where a later segment of the sequence needs its exact start state
                # (the decision in shared memory: a loop count that depends on a local array makes ptxas spill)
                need = T.alloc_shared((1,), "int32")
                wacc = T.alloc_local((1,), f32)
                wl_s = T.alloc_shared((MAX_SEGMENTS * WARM_CHUNKS,), f32)
                ca_s = T.alloc_shared((MAX_SEGMENTS,), "int32")
                exact_after(F, chunk_offsets, N + 1, n + 1, chunk_offsets[2 * N + 1 + n] - n, hv, need, wacc, wl_s,
                            ca_s)
                bos, seos, c0, snchunks = seq_span(cu_seqlens, chunk_offsets, n)
                eos = T.if_then_else(need[0] > 0, seos, bos)        # (an empty segment where not needed)
                nchunks = T.ceildiv(eos - bos, BT)
            else:
                bos, eos, c0, nchunks = seq_span(cu_seqlens, chunk_offsets, n)
            v0 = bv * BV
            vv = v0 % DV
            vkeep = T.if_then_else(v0 < DV, T.float32(1), T.float32(0))

            k_s = T.alloc_shared((BT, DK), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            ah_s = T.alloc_shared((BT, BT), dtype)
            al_s = T.alloc_shared(lo_shape((BT, BT), ag_sp), dtype)
            f_s = T.alloc_shared((4, BT), f32)

            s_f = T.alloc_fragment((BV, DK), f32)
            sa = T.alloc_fragment((BV, DK), dtype)
            sl = T.alloc_fragment(lo_shape((BV, DK), ks_sp or s_sp), dtype)
            ks_f = T.alloc_fragment((BV, BT), f32)
            xa = T.alloc_fragment((BV, BT), dtype)
            xl = T.alloc_fragment(lo_shape((BV, BT), x_sp), dtype)
            u_f = T.alloc_fragment((BV, BT), f32)
            ua = T.alloc_fragment((BV, BT), dtype)
            ul = T.alloc_fragment(lo_shape((BV, BT), u_sp or upd_sp), dtype)
            # v is read transposed into the accumulator's fragment: row-major, the 4 chunk rows a warp reads at
            # once share their banks; the swizzled layout (written so by the TMA load) spreads them
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})

            if scan:
                for i, d in T.Parallel(BV, DK):
                    s_f[i, d] = T.if_then_else(v0 + i == DV + d, T.float32(1), T.float32(0))
            else:
                if use_h0 != 0:
                    load_state_vt(h0, s_f, v_first, n, hv, v0, BV, DK)
                else:
                    T.clear(s_f)

            for ic in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(v[t0:t0 + BT, hv, vv:vv + BV], v_s)
                T.copy(Ah[hv, c, 0:BT, 0:BT], ah_s)
                if ag_sp:
                    T.copy(Al[hv, c, 0:BT, 0:BT], al_s)
                T.copy(F[hv, c, 0:4, 0:BT], f_s)

                for i, d in T.Parallel(BV, DK):
                    sa[i, d] = T.cast(s_f[i, d], dtype)
                if ks_sp or s_sp:
                    for i, d in T.Parallel(BV, DK):
                        sl[i, d] = T.cast(s_f[i, d] - T.cast(T.cast(s_f[i, d], dtype), f32), dtype)
                if store:
                    T.copy(sa, Sch[hv, c, v0:v0 + BV, 0:DK])
                    if s_sp:
                        T.copy(sl, Scl[hv, c, v0:v0 + BV, 0:DK])

                # X^T = V^T - (S^T K^T) diag(F0)
                T.gemm(sa, k_s, ks_f, transpose_B=True, clear_accum=True, policy=FR)
                if ks_sp:
                    T.gemm(sl, k_s, ks_f, transpose_B=True, policy=FR)
                for i, t in T.Parallel(BV, BT):
                    ks_f[i, t] = vkeep * T.cast(v_s[t, i], f32) - f_s[0, t] * ks_f[i, t]
                for i, t in T.Parallel(BV, BT):
                    xa[i, t] = T.cast(ks_f[i, t], dtype)
                if x_sp:
                    for i, t in T.Parallel(BV, BT):
                        xl[i, t] = T.cast(ks_f[i, t] - T.cast(T.cast(ks_f[i, t], dtype), f32), dtype)

                # U^T = X^T Ag^T
                T.gemm(xa, ah_s, u_f, transpose_B=True, clear_accum=True, policy=FR)
                if ag_sp:
                    T.gemm(xa, al_s, u_f, transpose_B=True, policy=FR)
                if x_sp:
                    T.gemm(xl, ah_s, u_f, transpose_B=True, policy=FR)
                if store:
                    for i, t in T.Parallel(BV, BT):
                        ua[i, t] = T.cast(u_f[i, t], dtype)
                    T.copy(ua, Uh[hv, c, v0:v0 + BV, 0:BT])
                    if u_sp:
                        for i, t in T.Parallel(BV, BT):
                            ul[i, t] = T.cast(u_f[i, t] - T.cast(T.cast(u_f[i, t], dtype), f32), dtype)
                        T.copy(ul, Ul[hv, c, v0:v0 + BV, 0:BT])

                # S^T = F3 S^T + rd(U^T diag(F2)) K
                for i, t in T.Parallel(BV, BT):
                    u_f[i, t] = u_f[i, t] * f_s[2, t]
                for i, t in T.Parallel(BV, BT):
                    ua[i, t] = T.cast(u_f[i, t], dtype)
                if upd_sp:
                    for i, t in T.Parallel(BV, BT):
                        ul[i, t] = T.cast(u_f[i, t] - T.cast(T.cast(u_f[i, t], dtype), f32), dtype)
                for i, d in T.Parallel(BV, DK):
                    s_f[i, d] = s_f[i, d] * f_s[3, 0]
                T.gemm(ua, k_s, s_f, policy=FR)
                if upd_sp:
                    T.gemm(ul, k_s, s_f, policy=FR)

            if warm:
                if need[0] > 0:
                    T.copy(s_f, ht[n, hv, v0:v0 + BV, 0:DK])
            elif scan:
                T.copy(s_f, ht[n, hv, v0:v0 + BV, 0:DK])
            else:
                if store_ht != 0:
                    store_state_vt(s_f, ht, v_first, n, hv, v0, BV, DK)

    return gdn_state_rv
