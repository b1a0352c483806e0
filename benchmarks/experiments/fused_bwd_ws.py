"""A timing skeleton of a warp-specialised fused one-term backward: one CTA per (value head, sequence), K = V = 128,
fp16 operands, chunks last to first, four warpgroups.  The products and tiles of the fused kernel; elementwise steps
of the real thing's volume but simplified values.  Not the tree's kernel: its numbers are timing only.

Per chunk four lockstep phases (mbarriers ``ph[0..3]``, every consumer thread arrives once a phase):

* WG0, the chain: P1 dS' = rd(dS) value-first, dU = dUloc + F2 (K dS') by halves of 64 value columns;
  P2 dY = Th^T dU by halves (dY tile, dv stored, D2 over dU), dS = F3 dS + 2^-x (Q^T D1 - K^T D2).
* WG1, dq: P1 Z = dO S^T (dq, q.Z dots), D1 = F1 dO 2^x; P2 qk, dO U^T -> M0, M1, dq += M0 K;
  P3 kk, dY U^T -> M2, M3, dY.v dots; P4 dq stored.
* WG2, dk: P2 the S o dS' column dots, R = U dS'^T (dk, k.R dots); P3 W = dY S^T (dk, k.W dots);
  P4 dk += M1^T Q + M2 K + M3^T K, dk stored.
* WG3, the producer (one warp): chunk i + 1's dO and Th after P2 of chunk i, S and U after P3, q, k, dUloc and the
  gates after P4.  The four 64x64 operand tiles M0..M3 lie over dUloc's bytes.

Build options: ``nreg`` the four warpgroups' register counts; ``yv``, ``sdd`` the dY.v and S o dS' dots on or off;
``nt`` every tile in the layout its producer writes (dS' key-first, dY and dUloc token-first: no transposed
shared-memory writes or reads); ``reload_qk`` False keeps chunk 0's q, k, dUloc (a bound on what hiding their loads
gives); ``profile`` writes ``clock64`` of CTA (0, 0)'s warpgroups at each phase start (``prof[w, i, p]``) and before
each phase arrive (``prof[w, i, 4 + p]``; WG0's phase-1 mark is after its loads landed).
"""
import sys

import tilelang
import tilelang.language as T

BT = 64
D = 128
WG = 128
f32, f16 = "float32", "float16"
LOG2E = 1.4426950408889634


@T.macro
def mark(prof, hv, n, tx, w, i, p, on):
    """clock64 at phase p of chunk i in warpgroup w's first thread (CTA (0, 0), the first 64 chunks)."""
    if on and hv == 0 and n == 0 and tx % WG == 0 and i < 64:
        prof[w, i, p] = T.call_extern("int64", "clock64")


def build(nreg=(184, 152, 152, 24), yv=True, sdd=True, nt=False, profile=False, reload_qk=True):
    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    NC = T.dynamic("NC")
    N = T.dynamic("N")

    @T.prim_func
    def fused_bwd_ws(q: T.Tensor((Ttot, H, D), f16), k: T.Tensor((Ttot, H, D), f16),
                     v: T.Tensor((Ttot, HV, D), f16), do: T.Tensor((Ttot, HV, D), f16),
                     S: T.Tensor((HV, NC, D, D), f16), U: T.Tensor((HV, NC, BT, D), f16),
                     Th: T.Tensor((HV, NC, BT, BT), f16), Fb: T.Tensor((HV, NC, 8, BT), f32),
                     dUl: T.Tensor((HV, NC, BT, D) if nt else (HV, NC, D, BT), f32),
                     dq: T.Tensor((Ttot, HV, D), f32), dk: T.Tensor((Ttot, HV, D), f32),
                     dv: T.Tensor((Ttot, HV, D), f16),
                     rows: T.Tensor((6, HV, NC, BT), f32), sd: T.Tensor((HV, NC, D), f32),
                     cu: T.Tensor((N + 1,), "int32"), prof: T.Tensor((4, 64, 8), "int64")):
        with T.Kernel(HV, N, threads=4 * WG) as (hv, n):
            h = hv // (HV // H)
            nch = (cu[n + 1] - cu[n]) // BT
            c_end = cu[n] // BT + nch          # one past the sequence's last chunk
            q_s = T.alloc_shared((BT, D), f16)
            k_s = T.alloc_shared((BT, D), f16)
            do_s = T.alloc_shared((BT, D), f16)
            s_s = T.alloc_shared((D, D), f16)
            u_s = T.alloc_shared((BT, D), f16)
            th_s = T.alloc_shared((BT, BT), f16)
            f_s = T.alloc_shared((8, BT), f32)
            dul_s = T.alloc_shared((BT, D) if nt else (D, BT), f32)
            dsh_s = T.alloc_shared((D, D), f16)        # dS' value-first [V, K] (nt: key-first)
            xh_s = T.alloc_shared((BT, D), f16)        # dU, then D2
            yh_s = T.alloc_shared((BT, D) if nt else (D, BT), f16)        # dY value-first [V, 64] (nt: [64, V])
            d1_s = T.alloc_shared((BT, D), f16)        # D1 = F1 dO 2^x
            m = T.view(dul_s, (4 * BT, BT), f16)       # M0..M3 over dUloc's bytes

            full_qk = T.alloc_barrier(arrive_count=32)
            full_do = T.alloc_barrier(arrive_count=32)
            full_th = T.alloc_barrier(arrive_count=32)
            full_su = T.alloc_barrier(arrive_count=32)
            ph = T.alloc_barrier(arrive_count=[3 * WG] * 4)

            tx = T.get_thread_binding()

            if tx < WG:
                T.set_max_nreg(nreg[0], 1 if nreg[0] >= 128 else 0)
                ds_f = T.alloc_fragment((D, D), f32)
                kd_f = T.alloc_fragment((BT, BT), f32)
                T.clear(ds_f)
                for i in T.serial(nch):
                    c = c_end - 1 - i
                    t0 = c * BT
                    par = i % 2
                    # P1
                    T.barrier_wait(full_qk, par)
                    mark(prof, hv, n, tx, 0, i, 0, profile)
                    if nt:
                        for a, b in T.Parallel(D, D):
                            dsh_s[a, b] = T.cast(ds_f[a, b], f16)
                    else:
                        for a, b in T.Parallel(D, D):
                            dsh_s[b, a] = T.cast(ds_f[a, b], f16)
                    T.fence_proxy_async()
                    for hh in T.unroll(2):
                        if nt:
                            T.gemm(k_s, dsh_s[:, hh * BT:(hh + 1) * BT], kd_f, clear_accum=True)
                            for t, j in T.Parallel(BT, BT):
                                xh_s[t, hh * BT + j] = T.cast(dul_s[t, hh * BT + j] + f_s[2, t] * kd_f[t, j], f16)
                        else:
                            T.gemm(k_s, dsh_s[hh * BT:(hh + 1) * BT, :], kd_f, transpose_B=True, clear_accum=True)
                            for t, j in T.Parallel(BT, BT):
                                xh_s[t, hh * BT + j] = T.cast(dul_s[hh * BT + j, t] + f_s[2, t] * kd_f[t, j], f16)
                    T.fence_proxy_async()
                    mark(prof, hv, n, tx, 0, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2
                    mark(prof, hv, n, tx, 0, i, 1, profile)
                    T.barrier_wait(full_th, par)
                    for hh in T.unroll(2):
                        T.gemm(th_s, xh_s[:, hh * BT:(hh + 1) * BT], kd_f, transpose_A=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            if nt:
                                yh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                            else:
                                yh_s[hh * BT + j, t] = T.cast(kd_f[t, j], f16)
                            dv[t0 + t, hv, hh * BT + j] = T.cast(f_s[7, t] * kd_f[t, j], f16)
                            xh_s[t, hh * BT + j] = T.cast(-f_s[0, t] * f_s[7, t] * f_s[4, 0] * kd_f[t, j], f16)
                    T.fence_proxy_async()
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * f_s[3, 0]
                    T.gemm(q_s, d1_s, ds_f, transpose_A=True)
                    T.gemm(k_s, xh_s, ds_f, transpose_A=True)
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * f_s[5, 0]
                    mark(prof, hv, n, tx, 0, i, 5, profile)
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3, P4
                    mark(prof, hv, n, tx, 0, i, 2, profile)
                    mark(prof, hv, n, tx, 0, i, 6, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    mark(prof, hv, n, tx, 0, i, 3, profile)
                    mark(prof, hv, n, tx, 0, i, 7, profile)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
            elif tx < 2 * WG:
                T.set_max_nreg(nreg[1], 1 if nreg[1] >= 128 else 0)
                dq_f = T.alloc_fragment((BT, D), f32)
                x_f = T.alloc_fragment((BT, D), f32)
                a_f = T.alloc_fragment((BT, BT), f32)
                b_f = T.alloc_fragment((BT, BT), f32)
                rs = T.alloc_fragment((BT,), f32)
                for i in T.serial(nch):
                    c = c_end - 1 - i
                    t0 = c * BT
                    par = i % 2
                    # P1: Z = dO S^T -> dq, q.Z; D1
                    mark(prof, hv, n, tx, 1, i, 0, profile)
                    T.barrier_wait(full_qk, par)
                    T.barrier_wait(full_do, par)
                    T.barrier_wait(full_su, par)
                    T.gemm(do_s, s_s, x_f, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dq_f[t, d] = T.exp2(f_s[4, t] * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(q_s[t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[0, hv, c, t] = rs[t]
                    for t, d in T.Parallel(BT, D):
                        d1_s[t, d] = T.cast(T.cast(do_s[t, d], f32) * f_s[1, t] * f_s[4, 0], f16)
                    T.fence_proxy_async()
                    mark(prof, hv, n, tx, 1, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2: qk, dO U^T -> M0, M1; dq += M0 K
                    mark(prof, hv, n, tx, 1, i, 1, profile)
                    T.gemm(q_s, k_s, a_f, transpose_B=True, clear_accum=True)
                    T.gemm(do_s, u_s, b_f, transpose_B=True, clear_accum=True)
                    for t, j in T.Parallel(BT, BT):
                        m[t, j] = T.cast(T.if_then_else(j <= t, f_s[5, t] * b_f[t, j] * a_f[t, j], 0.0), f16)
                        m[BT + t, j] = T.cast(T.if_then_else(j <= t, f_s[6, j] * b_f[t, j], 0.0), f16)
                        a_f[t, j] = a_f[t, j] * b_f[t, j]
                    T.reduce_sum(a_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[1, hv, c, t] = rs[t]
                    T.fence_proxy_async()
                    T.gemm(m[0:BT, :], k_s, dq_f)
                    mark(prof, hv, n, tx, 1, i, 5, profile)
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3: kk, dY U^T -> M2, M3; dY.v dots
                    mark(prof, hv, n, tx, 1, i, 2, profile)
                    T.gemm(k_s, k_s, a_f, transpose_B=True, clear_accum=True)
                    if nt:
                        T.gemm(yh_s, u_s, b_f, transpose_B=True, clear_accum=True)
                    else:
                        T.gemm(yh_s, u_s, b_f, transpose_A=True, transpose_B=True, clear_accum=True)
                    for t, j in T.Parallel(BT, BT):
                        m[2 * BT + t, j] = T.cast(T.if_then_else(j < t, f_s[7, t] * b_f[t, j] * a_f[t, j], 0.0), f16)
                        m[3 * BT + t, j] = T.cast(T.if_then_else(j < t, f_s[6, t] * b_f[t, j], 0.0), f16)
                    T.fence_proxy_async()
                    if yv:
                        for t, d in T.Parallel(BT, D):
                            x_f[t, d] = T.cast(v[t0 + t, hv, d], f32) * T.cast(yh_s[t, d] if nt else yh_s[d, t], f32)
                        T.reduce_sum(x_f, rs, dim=1)
                        for t in T.Parallel(BT):
                            rows[2, hv, c, t] = rs[t]
                    mark(prof, hv, n, tx, 1, i, 6, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    # P4
                    mark(prof, hv, n, tx, 1, i, 3, profile)
                    T.copy(dq_f, dq[t0:t0 + BT, hv, 0:D])
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
                    mark(prof, hv, n, tx, 2, i, 0, profile)
                    T.barrier_wait(full_qk, par)
                    T.barrier_wait(full_su, par)
                    mark(prof, hv, n, tx, 2, i, 4, profile)
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2: S o dS' column dots; R = U dS'^T -> dk, k.R
                    mark(prof, hv, n, tx, 2, i, 1, profile)
                    if sdd:
                        acc[0] = T.float32(0)
                        for d in T.serial(D):
                            if nt:
                                acc[0] = acc[0] + T.cast(s_s[d, tx - 2 * WG], f32) * T.cast(dsh_s[d, tx - 2 * WG], f32)
                            else:
                                acc[0] = acc[0] + T.cast(s_s[d, tx - 2 * WG], f32) * T.cast(dsh_s[tx - 2 * WG, d], f32)
                        sd[hv, c, tx - 2 * WG] = acc[0]
                    T.gemm(u_s, dsh_s, x_f, transpose_B=nt, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dk_f[t, d] = T.exp2((f_s[4, BT - 1] - f_s[4, t]) * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(k_s[t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[3, hv, c, t] = rs[t]
                    mark(prof, hv, n, tx, 2, i, 5, profile)
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3: W = dY S^T -> dk, k.W
                    mark(prof, hv, n, tx, 2, i, 2, profile)
                    T.gemm(yh_s, s_s, x_f, transpose_A=not nt, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(BT, D):
                        dk_f[t, d] = dk_f[t, d] - f_s[7, t] * T.exp2(f_s[4, t] * LOG2E) * x_f[t, d]
                        x_f[t, d] = x_f[t, d] * T.cast(k_s[t, d], f32)
                    T.reduce_sum(x_f, rs, dim=1)
                    for t in T.Parallel(BT):
                        rows[4, hv, c, t] = rs[t]
                    mark(prof, hv, n, tx, 2, i, 6, profile)
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    # P4: dk += M1^T Q + M2 K + M3^T K
                    mark(prof, hv, n, tx, 2, i, 3, profile)
                    T.gemm(m[BT:2 * BT, :], q_s, dk_f, transpose_A=True)
                    T.gemm(m[2 * BT:3 * BT, :], k_s, dk_f)
                    T.gemm(m[3 * BT:4 * BT, :], k_s, dk_f, transpose_A=True)
                    T.copy(dk_f, dk[t0:t0 + BT, hv, 0:D])
                    mark(prof, hv, n, tx, 2, i, 7, profile)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
            else:
                T.set_max_nreg(nreg[3], 0)
                if tx < 3 * WG + 32:
                    c = c_end - 1
                    t0 = c * BT
                    T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_qk)
                    T.tma_copy(k[t0:t0 + BT, h, 0:D], k_s, barrier=full_qk)
                    if nt:
                        T.tma_copy(dUl[hv, c, 0:BT, 0:D], dul_s, barrier=full_qk)
                    else:
                        T.tma_copy(dUl[hv, c, 0:D, 0:BT], dul_s, barrier=full_qk)
                    T.tma_copy(Fb[hv, c, 0:8, 0:BT], f_s, barrier=full_qk)
                    T.barrier_arrive(full_qk)
                    T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                    T.barrier_arrive(full_do)
                    T.tma_copy(S[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                    T.tma_copy(U[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                    T.barrier_arrive(full_su)
                    T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                    T.barrier_arrive(full_th)
                    for i in T.serial(nch - 1):
                        par = i % 2
                        c = c_end - 2 - i
                        t0 = c * BT
                        T.barrier_wait(ph[1], par)     # dO read (P1, P2)
                        T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                        T.barrier_arrive(full_do)
                        T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                        T.barrier_arrive(full_th)
                        T.barrier_wait(ph[2], par)     # S, U read
                        T.tma_copy(S[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                        T.tma_copy(U[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                        T.barrier_arrive(full_su)
                        T.barrier_wait(ph[3], par)     # q, k, M0..M3, the gates read
                        if reload_qk:
                            T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_qk)
                            T.tma_copy(k[t0:t0 + BT, h, 0:D], k_s, barrier=full_qk)
                            if nt:
                                T.tma_copy(dUl[hv, c, 0:BT, 0:D], dul_s, barrier=full_qk)
                            else:
                                T.tma_copy(dUl[hv, c, 0:D, 0:BT], dul_s, barrier=full_qk)
                        T.tma_copy(Fb[hv, c, 0:8, 0:BT], f_s, barrier=full_qk)
                        T.barrier_arrive(full_qk)

    return fused_bwd_ws


if __name__ == "__main__":
    import re
    from tilelang import tvm
    nreg = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (184, 152, 152, 24)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    pc = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    with tvm.transform.PassContext(opt_level=3, config=pc), target:
        art = tilelang.lower(build(nreg), target=target)
    open("/tmp/fused_bwd_ws.cu", "w").write(art.kernel_source)
    print("lowered", len(art.kernel_source))
    print(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", art.kernel_source))
