"""``fused_bwd_ws`` (nt layouts) with the next chunk's loads issued earlier: a timing skeleton, not the tree's kernel.

What changes against ``fused_bwd_ws``:

* k and the gate rows in two stages (chunk i + 2's loaded once chunk i is done);
* D1 = F1 dO 2^x written over dO in place by WG1 in phase 1 (dO U^T moved into phase 1), which frees D1's tile;
* M1^T Q in WG2's phase 3, so q and dUloc die with phase 3 and load during phase 4;
* M0, M1 over dUloc's bytes, M2, M3 the two column halves of dU's tile (dead after WG0's phase 2).

Loads of chunk i + 1: dO, Th after phase 2 of chunk i; S, U, q, dUloc after phase 3; k and the gates of chunk i + 2
after phase 4.  ``dots``: the dY.v and S o dS' dots on or off; ``profile``: ``fused_bwd_ws``'s clock64 marks;
``local``: dUloc formed in the kernel (WG0, phase 1: P = scale QK^T o e^(G_s - G_t) on and below the diagonal, dU =
F2 K dS' + P^T dO) instead of loaded, D1 in its own tile, M0 over P's; ``late`` (with ``local``): WG0's state
update and the next chunk's dS' in phase 3 beside the dq / dk side's products, M2 over P's tile and M3 over Th's
(Th loaded after phase 4); ``early_p`` (with ``late``): WG0 forms the next chunk's P in its registers during
phase 4; ``rect`` (with ``late``): dS' written in phase 1 again, so that its tile is free in phases 3 and 4 and
holds the dg rectangle's fp32 summands (WG1, phase 3), whose sums WG1 forms in phase 4 (``rows[5]``).
"""
import sys

import tilelang
import tilelang.language as T

from fused_bwd_ws import BT, D, LOG2E, WG, f16, f32, mark


@T.macro
def gated_scores(q_s, k_s, f_s, p_f, st, scale):
    """``p_f = scale (Q K^T o e^(G_s - G_t))`` on and below the diagonal, 0 above (k and the gates of stage st)."""
    T.gemm(q_s, k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
    for a, b in T.Parallel(BT, BT):
        p_f[a, b] = T.if_then_else(b <= a, scale * p_f[a, b] * T.exp2((f_s[st, 4, a] - f_s[st, 4, b]) * LOG2E), 0.0)


def build(nreg=(176, 168, 144, 24), dots=False, profile=False, local=False, late=False, early_p=False, rect=False,
          scale=0.088):
    assert local or not late
    assert late or not early_p
    assert late or not rect
    dsh_late = late and not rect      # the next chunk's dS' written in phase 3
    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    NC = T.dynamic("NC")
    N = T.dynamic("N")

    @T.prim_func
    def fused_bwd_ws2(q: T.Tensor((Ttot, H, D), f16), k: T.Tensor((Ttot, H, D), f16),
                      v: T.Tensor((Ttot, HV, D), f16), do: T.Tensor((Ttot, HV, D), f16),
                      S: T.Tensor((HV, NC, D, D), f16), U: T.Tensor((HV, NC, BT, D), f16),
                      Th: T.Tensor((HV, NC, BT, BT), f16), Fb: T.Tensor((HV, NC, 8, BT), f32),
                      dUl: T.Tensor((HV, NC, BT, D), f32),
                      dq: T.Tensor((Ttot, HV, D), f32), dk: T.Tensor((Ttot, HV, D), f32),
                      dv: T.Tensor((Ttot, HV, D), f16),
                      rows: T.Tensor((6, HV, NC, BT), f32), sd: T.Tensor((HV, NC, D), f32),
                      cu: T.Tensor((N + 1,), "int32"), prof: T.Tensor((4, 64, 8), "int64")):
        with T.Kernel(HV, N, threads=4 * WG) as (hv, n):
            h = hv // (HV // H)
            nch = (cu[n + 1] - cu[n]) // BT
            c_end = cu[n] // BT + nch
            q_s = T.alloc_shared((BT, D), f16)
            k_s = T.alloc_shared((2, BT, D), f16)
            do_s = T.alloc_shared((BT, D), f16)        # dO, then D1 = F1 dO 2^x
            s_s = T.alloc_shared((D, D), f16)
            u_s = T.alloc_shared((BT, D), f16)
            th_s = T.alloc_shared((BT, BT), f16)
            f_s = T.alloc_shared((2, 8, BT), f32)
            if local:
                p_s = T.alloc_shared((BT, BT), f16)    # P (dUloc = P^T dO), then M0
                m1_s = T.alloc_shared((BT, BT), f16)
                d1_s = T.alloc_shared((BT, D), f16)
            else:
                dul_s = T.alloc_shared((BT, D), f32)
            dsh_s = T.alloc_shared((D, D), f16)        # dS' key-first
            xh_s = T.alloc_shared((BT, D), f16)        # dU, then D2, then [M2 | M3]
            yh_s = T.alloc_shared((BT, D), f16)        # dY token-first
            if not local:
                m01 = T.view(dul_s, (4 * BT, BT), f16)     # M0, M1 over dUloc's first half

            full_k = T.alloc_barrier(arrive_count=[32] * 2)
            full_q = T.alloc_barrier(arrive_count=32)
            full_do = T.alloc_barrier(arrive_count=32)
            full_su = T.alloc_barrier(arrive_count=32)
            full_th = T.alloc_barrier(arrive_count=32)
            ph = T.alloc_barrier(arrive_count=[3 * WG] * 4)
            if rect:
                rb = T.alloc_barrier(arrive_count=WG)              # WG1's row prefix sums written
                m_s = T.view(dsh_s, (BT, 2 * BT), f32)            # dg summands [64, 64 (+64 unused)] over dS'

            tx = T.get_thread_binding()

            if tx < WG:
                T.set_max_nreg(nreg[0], 1 if nreg[0] >= 128 else 0)
                ds_f = T.alloc_fragment((D, D), f32)
                kd_f = T.alloc_fragment((BT, BT), f32)
                T.clear(ds_f)
                if dsh_late:
                    for a, b in T.Parallel(D, D):
                        dsh_s[a, b] = T.cast(ds_f[a, b], f16)
                    T.fence_proxy_async()
                for i in T.serial(nch):
                    c = c_end - 1 - i
                    t0 = c * BT
                    par = i % 2
                    st = i % 2
                    # P1
                    T.barrier_wait(full_k[st], (i // 2) % 2)
                    T.barrier_wait(full_q, par)
                    if local:
                        T.barrier_wait(full_do, par)
                    mark(prof, hv, n, tx, 0, i, 0, profile)
                    if early_p:
                        # P formed in the registers during the previous chunk's phase 4
                        if i == 0:
                            gated_scores(q_s, k_s, f_s, kd_f, st, scale)
                        T.copy(kd_f, p_s)
                    elif local:
                        # P = scale (QK^T o e^(G_s - G_t)) on and below the diagonal: dUloc = P^T dO
                        T.gemm(q_s, k_s[st, :, :], kd_f, transpose_B=True, clear_accum=True)
                        for a, b in T.Parallel(BT, BT):
                            p_s[a, b] = T.cast(T.if_then_else(b <= a, scale * kd_f[a, b] * T.exp2(
                                (f_s[st, 4, a] - f_s[st, 4, b]) * LOG2E), 0.0), f16)
                    if not dsh_late:
                        for a, b in T.Parallel(D, D):
                            dsh_s[a, b] = T.cast(ds_f[a, b], f16)
                        T.fence_proxy_async()
                    for hh in T.unroll(2):
                        T.gemm(k_s[st, :, :], dsh_s[:, hh * BT:(hh + 1) * BT], kd_f, clear_accum=True)
                        if local:
                            for t, j in T.Parallel(BT, BT):
                                kd_f[t, j] = f_s[st, 2, t] * kd_f[t, j]
                            T.gemm(p_s, do_s[:, hh * BT:(hh + 1) * BT], kd_f, transpose_A=True)
                            for t, j in T.Parallel(BT, BT):
                                xh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                        else:
                            for t, j in T.Parallel(BT, BT):
                                xh_s[t, hh * BT + j] = T.cast(dul_s[t, hh * BT + j] + f_s[st, 2, t] * kd_f[t, j],
                                                              f16)
                    T.fence_proxy_async()
                    mark(prof, hv, n, tx, 0, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2
                    mark(prof, hv, n, tx, 0, i, 1, profile)
                    if late:
                        T.barrier_wait(full_th, par)
                    if not local:
                        T.barrier_wait(full_do, par)
                    for hh in T.unroll(2):
                        T.gemm(th_s, xh_s[:, hh * BT:(hh + 1) * BT], kd_f, transpose_A=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            yh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                            dv[t0 + t, hv, hh * BT + j] = T.cast(f_s[st, 7, t] * kd_f[t, j], f16)
                            xh_s[t, hh * BT + j] = T.cast(-f_s[st, 0, t] * f_s[st, 7, t] * f_s[st, 4, 0]
                                                          * kd_f[t, j], f16)
                    T.fence_proxy_async()
                    if late:
                        mark(prof, hv, n, tx, 0, i, 5, profile)
                        T.barrier_arrive(ph[1])
                        T.barrier_wait(ph[1], par)
                        mark(prof, hv, n, tx, 0, i, 2, profile)
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * f_s[st, 3, 0]
                    T.gemm(q_s, d1_s if local else do_s, ds_f, transpose_A=True)
                    T.gemm(k_s[st, :, :], xh_s, ds_f, transpose_A=True)
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * f_s[st, 5, 0]
                    if late:
                        if dsh_late:
                            # the next chunk's dS' (WG2 read this chunk's in phase 2)
                            for a, b in T.Parallel(D, D):
                                dsh_s[a, b] = T.cast(ds_f[a, b], f16)
                            T.fence_proxy_async()
                        mark(prof, hv, n, tx, 0, i, 6, profile)
                    else:
                        mark(prof, hv, n, tx, 0, i, 5, profile)
                        T.barrier_arrive(ph[1])
                        T.barrier_wait(ph[1], par)
                        mark(prof, hv, n, tx, 0, i, 2, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    mark(prof, hv, n, tx, 0, i, 3, profile)
                    if early_p:
                        if i + 1 < nch:
                            T.barrier_wait(full_k[1 - st], ((i + 1) // 2) % 2)
                            T.barrier_wait(full_q, 1 - par)
                            gated_scores(q_s, k_s, f_s, kd_f, 1 - st, scale)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
            elif tx < 2 * WG:
                T.set_max_nreg(nreg[1], 1 if nreg[1] >= 128 else 0)
                dq_f = T.alloc_fragment((BT, D), f32)
                x_f = T.alloc_fragment((BT, D), f32)
                a_f = T.alloc_fragment((BT, BT), f32)
                b_f = T.alloc_fragment((BT, BT), f32)
                rs = T.alloc_fragment((BT,), f32)
                if rect:
                    c_f = T.alloc_fragment((BT, BT), f32)     # the dg summands' dO U^T part, phase 2 to 3
                    acc = T.alloc_local((1,), f32)
                for i in T.serial(nch):
                    c = c_end - 1 - i
                    t0 = c * BT
                    par = i % 2
                    st = i % 2
                    # P1: Z = dO S^T -> dq, q.Z; dO U^T; D1 over dO
                    mark(prof, hv, n, tx, 1, i, 0, profile)
                    T.barrier_wait(full_k[st], (i // 2) % 2)
                    T.barrier_wait(full_q, par)
                    T.barrier_wait(full_do, par)
                    T.barrier_wait(full_su, par)
                    T.gemm(do_s, s_s, x_f, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dq_f[t, d] = T.exp2(f_s[st, 4, t] * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(q_s[t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[0, hv, c, t] = rs[t]
                    T.gemm(do_s, u_s, b_f, transpose_B=True, clear_accum=True)
                    if local:
                        for t, d in T.Parallel(BT, D):
                            d1_s[t, d] = T.cast(T.cast(do_s[t, d], f32) * f_s[st, 1, t] * f_s[st, 4, 0], f16)
                    else:
                        for t, d in T.Parallel(BT, D):
                            do_s[t, d] = T.cast(T.cast(do_s[t, d], f32) * f_s[st, 1, t] * f_s[st, 4, 0], f16)
                    T.fence_proxy_async()
                    mark(prof, hv, n, tx, 1, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2: qk -> M0, M1; dq += M0 K
                    mark(prof, hv, n, tx, 1, i, 1, profile)
                    T.gemm(q_s, k_s[st, :, :], a_f, transpose_B=True, clear_accum=True)
                    if local:
                        for t, j in T.Parallel(BT, BT):
                            p_s[t, j] = T.cast(T.if_then_else(j <= t, f_s[st, 5, t] * b_f[t, j] * a_f[t, j], 0.0), f16)
                            m1_s[t, j] = T.cast(T.if_then_else(j <= t, f_s[st, 6, j] * b_f[t, j], 0.0), f16)
                            a_f[t, j] = a_f[t, j] * b_f[t, j]
                        if rect:
                            for t, j in T.Parallel(BT, BT):
                                c_f[t, j] = T.if_then_else(j < t, f_s[st, 6, j] * a_f[t, j], 0.0)
                    else:
                        for t, j in T.Parallel(BT, BT):
                            m01[t, j] = T.cast(T.if_then_else(j <= t, f_s[st, 5, t] * b_f[t, j] * a_f[t, j], 0.0),
                                               f16)
                            m01[BT + t, j] = T.cast(T.if_then_else(j <= t, f_s[st, 6, j] * b_f[t, j], 0.0), f16)
                            a_f[t, j] = a_f[t, j] * b_f[t, j]
                    T.reduce_sum(a_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[1, hv, c, t] = rs[t]
                    T.fence_proxy_async()
                    if local:
                        T.gemm(p_s, k_s[st, :, :], dq_f)
                    else:
                        T.gemm(m01[0:BT, :], k_s[st, :, :], dq_f)
                    mark(prof, hv, n, tx, 1, i, 5, profile)
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3: kk, dY U^T -> M2, M3 (over dU); dY.v dots
                    mark(prof, hv, n, tx, 1, i, 2, profile)
                    T.gemm(k_s[st, :, :], k_s[st, :, :], a_f, transpose_B=True, clear_accum=True)
                    T.gemm(yh_s, u_s, b_f, transpose_B=True, clear_accum=True)
                    if late:
                        for t, j in T.Parallel(BT, BT):
                            p_s[t, j] = T.cast(T.if_then_else(j < t, f_s[st, 7, t] * b_f[t, j] * a_f[t, j], 0.0), f16)
                            th_s[t, j] = T.cast(T.if_then_else(j < t, f_s[st, 6, t] * b_f[t, j], 0.0), f16)
                        if rect:
                            # the dg rectangle's summands, over dS' (dead until the next chunk's phase 1)
                            for t, j in T.Parallel(BT, BT):
                                m_s[t, j] = c_f[t, j] + T.if_then_else(j < t, f_s[st, 7, t] * b_f[t, j] * a_f[t, j],
                                                                       0.0)
                    else:
                        for t, j in T.Parallel(BT, BT):
                            xh_s[t, j] = T.cast(T.if_then_else(j < t, f_s[st, 7, t] * b_f[t, j] * a_f[t, j], 0.0),
                                                f16)
                            xh_s[t, BT + j] = T.cast(T.if_then_else(j < t, f_s[st, 6, t] * b_f[t, j], 0.0), f16)
                    T.fence_proxy_async()
                    if dots:
                        for t, d in T.Parallel(BT, D):
                            x_f[t, d] = T.cast(v[t0 + t, hv, d], f32) * T.cast(yh_s[t, d], f32)
                        T.reduce_sum(x_f, rs, dim=1)
                        for t in T.Parallel(BT):
                            rows[2, hv, c, t] = rs[t]
                    mark(prof, hv, n, tx, 1, i, 6, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    # P4
                    mark(prof, hv, n, tx, 1, i, 3, profile)
                    T.copy(dq_f, dq[t0:t0 + BT, hv, 0:D])
                    if rect:
                        # rect_s = sum_{t >= s} sum_{j < s} m_tj: row prefix sums, then a column walk
                        if tx - WG < BT:
                            for j in T.serial(BT - 1):
                                m_s[tx - WG, j + 1] = m_s[tx - WG, j + 1] + m_s[tx - WG, j]
                        T.barrier_arrive(rb)
                        T.barrier_wait(rb, par)
                        if tx - WG < BT:
                            acc[0] = T.float32(0)
                            if tx - WG > 0:
                                for t in T.serial(BT):
                                    if t >= tx - WG:
                                        acc[0] = acc[0] + m_s[t, tx - WG - 1]
                            rows[5, hv, c, tx - WG] = acc[0]
                    mark(prof, hv, n, tx, 1, i, 7, profile)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
            elif tx < 3 * WG:
                T.set_max_nreg(nreg[2], 1 if nreg[2] >= 128 else 0)
                dk_f = T.alloc_fragment((BT, D), f32)
                x_f = T.alloc_fragment((BT, D), f32)
                rs = T.alloc_fragment((BT,), f32)
                acc = T.alloc_local((1,), f32)
                for i in T.serial(nch):
                    c = c_end - 1 - i
                    t0 = c * BT
                    par = i % 2
                    st = i % 2
                    mark(prof, hv, n, tx, 2, i, 0, profile)
                    T.barrier_wait(full_k[st], (i // 2) % 2)
                    T.barrier_wait(full_su, par)
                    mark(prof, hv, n, tx, 2, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2: S o dS' column dots; R = U dS'^T -> dk, k.R
                    mark(prof, hv, n, tx, 2, i, 1, profile)
                    if dots:
                        acc[0] = T.float32(0)
                        for d in T.serial(D):
                            acc[0] = acc[0] + T.cast(s_s[d, tx - 2 * WG], f32) * T.cast(dsh_s[d, tx - 2 * WG], f32)
                        sd[hv, c, tx - 2 * WG] = acc[0]
                    T.gemm(u_s, dsh_s, x_f, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dk_f[t, d] = T.exp2((f_s[st, 4, BT - 1] - f_s[st, 4, t]) * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(k_s[st, t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[3, hv, c, t] = rs[t]
                    mark(prof, hv, n, tx, 2, i, 5, profile)
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3: W = dY S^T -> dk, k.W; dk += M1^T Q
                    mark(prof, hv, n, tx, 2, i, 2, profile)
                    T.gemm(yh_s, s_s, x_f, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dk_f[t, d] = dk_f[t, d] - f_s[st, 7, t] * T.exp2(f_s[st, 4, t] * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(k_s[st, t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[4, hv, c, t] = rs[t]
                    if local:
                        T.gemm(m1_s, q_s, dk_f, transpose_A=True)
                    else:
                        T.gemm(m01[BT:2 * BT, :], q_s, dk_f, transpose_A=True)
                    mark(prof, hv, n, tx, 2, i, 6, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    # P4: dk += M2 K + M3^T K
                    mark(prof, hv, n, tx, 2, i, 3, profile)
                    if late:
                        T.gemm(p_s, k_s[st, :, :], dk_f)
                        T.gemm(th_s, k_s[st, :, :], dk_f, transpose_A=True)
                    else:
                        T.gemm(xh_s[:, 0:BT], k_s[st, :, :], dk_f)
                        T.gemm(xh_s[:, BT:2 * BT], k_s[st, :, :], dk_f, transpose_A=True)
                    T.copy(dk_f, dk[t0:t0 + BT, hv, 0:D])
                    mark(prof, hv, n, tx, 2, i, 7, profile)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
            else:
                T.set_max_nreg(nreg[3], 0)
                if tx < 3 * WG + 32:
                    for j in T.unroll(2):
                        if j < nch:
                            c = c_end - 1 - j
                            T.tma_copy(k[c * BT:(c + 1) * BT, h, 0:D], k_s[j, :, :], barrier=full_k[j])
                            T.tma_copy(Fb[hv, c, 0:8, 0:BT], f_s[j, :, :], barrier=full_k[j])
                            T.barrier_arrive(full_k[j])
                    c = c_end - 1
                    t0 = c * BT
                    T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_q)
                    if not local:
                        T.tma_copy(dUl[hv, c, 0:BT, 0:D], dul_s, barrier=full_q)
                    T.barrier_arrive(full_q)
                    T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                    if late:
                        T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                        T.barrier_arrive(full_th)
                    else:
                        T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_do)
                    T.barrier_arrive(full_do)
                    T.tma_copy(S[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                    T.tma_copy(U[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                    T.barrier_arrive(full_su)
                    for i in T.serial(nch - 1):
                        par = i % 2
                        c = c_end - 2 - i
                        t0 = c * BT
                        T.barrier_wait(ph[1], par)     # dO (D1), Th read
                        T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                        if not late:
                            T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_do)
                        T.barrier_arrive(full_do)
                        T.barrier_wait(ph[2], par)     # S, U, q, dUloc (M0, M1) read
                        T.tma_copy(S[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                        T.tma_copy(U[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                        T.barrier_arrive(full_su)
                        T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_q)
                        if not local:
                            T.tma_copy(dUl[hv, c, 0:BT, 0:D], dul_s, barrier=full_q)
                        T.barrier_arrive(full_q)
                        T.barrier_wait(ph[3], par)     # chunk i's k and gates read: chunk i + 2's
                        if late:                       # Th (M3) read
                            T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                            T.barrier_arrive(full_th)
                        if i + 2 < nch:
                            c2 = c_end - 3 - i
                            T.tma_copy(k[c2 * BT:(c2 + 1) * BT, h, 0:D], k_s[i % 2, :, :], barrier=full_k[i % 2])
                            T.tma_copy(Fb[hv, c2, 0:8, 0:BT], f_s[i % 2, :, :], barrier=full_k[i % 2])
                            T.barrier_arrive(full_k[i % 2])

    return fused_bwd_ws2


if __name__ == "__main__":
    import re
    from tilelang import tvm
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    pc = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    with tvm.transform.PassContext(opt_level=3, config=pc), target:
        art = tilelang.lower(build(), target=target)
    open("/tmp/fused_bwd_ws2.cu", "w").write(art.kernel_source)
    print(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", art.kernel_source))
