"""A timing skeleton of a fused one-term backward (dh chain + dqk products per chunk, one CTA per (value head,
sequence), K = V = 128, fp16 operands): the products and tiles of the real thing, elementwise steps simplified.
Not the tree's kernel; its numbers are timing only."""
import sys

import tilelang
import tilelang.language as T

BT = 64
D = 128
f32, f16 = "float32", "float16"


def build(threads=512, nc_dyn=True):
    Ttot = T.dynamic("Ttot")
    HV = T.dynamic("HV")
    NC = T.dynamic("NC")
    N = T.dynamic("N")

    @T.prim_func
    def fused_bwd(q: T.Tensor((Ttot, HV, D), f16), k: T.Tensor((Ttot, HV, D), f16), do: T.Tensor((Ttot, HV, D), f16),
                  S: T.Tensor((HV, NC, D, D), f16), U: T.Tensor((HV, NC, BT, D), f16),
                  Th: T.Tensor((HV, NC, BT, BT), f16), Fb: T.Tensor((HV, NC, 8, BT), f32),
                  dUl: T.Tensor((HV, NC, D, BT), f32),
                  dq: T.Tensor((Ttot, HV, D), f32), dk: T.Tensor((Ttot, HV, D), f32), dv: T.Tensor((Ttot, HV, D), f16),
                  rows: T.Tensor((4, HV, NC, BT), f32), cu: T.Tensor((N + 1,), "int32")):
        with T.Kernel(HV, N, threads=threads) as (hv, n):
            nch = NC // N
            q_s = T.alloc_shared((BT, D), f16)
            k_s = T.alloc_shared((BT, D), f16)
            do_s = T.alloc_shared((BT, D), f16)
            s_s = T.alloc_shared((D, D), f16)
            u_s = T.alloc_shared((BT, D), f16)
            th_s = T.alloc_shared((BT, BT), f16)
            f_s = T.alloc_shared((8, BT), f32)
            dul_s = T.alloc_shared((D, BT), f32)
            dsh_s = T.alloc_shared((D, D), f16)
            x_s = T.alloc_shared((D, BT), f16)        # dU^T, then D1^T, then D2^T
            dyh_s = T.alloc_shared((D, BT), f16)
            m = T.view(dul_s, (4 * BT, BT), f16)       # the four 64x64 operand tiles over dUloc^T's bytes
            ds_f = T.alloc_fragment((D, D), f32)
            kd_f = T.alloc_fragment((D, BT), f32)
            x_f = T.alloc_fragment((BT, D), f32)
            dq_f = T.alloc_fragment((BT, D), f32)
            dk_f = T.alloc_fragment((BT, D), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            dpu = T.alloc_fragment((BT, BT), f32)
            dyu = T.alloc_fragment((BT, BT), f32)
            rs = T.alloc_fragment((BT,), f32)
            T.clear(ds_f)
            for icr in T.serial(nch):
                ic = nch - 1 - icr
                c = n * nch + ic
                t0 = c * BT
                T.copy(q[t0:t0 + BT, hv, 0:D], q_s)
                T.copy(k[t0:t0 + BT, hv, 0:D], k_s)
                T.copy(do[t0:t0 + BT, hv, 0:D], do_s)
                T.copy(S[hv, c, 0:D, 0:D], s_s)
                T.copy(U[hv, c, 0:BT, 0:D], u_s)
                T.copy(Th[hv, c, 0:BT, 0:BT], th_s)
                T.copy(Fb[hv, c, 0:8, 0:BT], f_s)
                T.copy(dUl[hv, c, 0:D, 0:BT], dul_s)
                # dh: dS' one term; dU^T = dUloc^T + F2 (dS'^T K^T); dY^T = dU^T Th; dv
                T.copy(ds_f, dsh_s)
                T.gemm(dsh_s, k_s, kd_f, transpose_B=True, clear_accum=True)
                for i, t in T.Parallel(D, BT):
                    x_s[i, t] = T.cast(dul_s[i, t] + f_s[2, t] * kd_f[i, t], f16)
                T.gemm(x_s, th_s, kd_f, clear_accum=True)
                for i, t in T.Parallel(D, BT):
                    dyh_s[i, t] = T.cast(kd_f[i, t], f16)
                for i, t in T.Parallel(D, BT):
                    dv[t0 + t, hv, i] = T.cast(f_s[7, t] * kd_f[i, t], f16)
                # dS^T = F3 dS^T + D1^T Q - D2^T K
                for i, d in T.Parallel(D, D):
                    ds_f[i, d] = ds_f[i, d] * f_s[3, 0]
                for i, t in T.Parallel(D, BT):
                    x_s[i, t] = T.cast(T.cast(do_s[t, i], f32) * f_s[1, t], f16)
                T.gemm(x_s, q_s, ds_f)
                for i, t in T.Parallel(D, BT):
                    x_s[i, t] = T.cast(-f_s[0, t] * T.cast(dyh_s[i, t], f32), f16)
                T.gemm(x_s, k_s, ds_f)
                # dqk: R = U dS'^T, Z = dO S^T, W = dY S^T
                T.gemm(u_s, dsh_s, x_f, transpose_B=True, clear_accum=True)
                for t, d in T.Parallel(BT, D):
                    dk_f[t, d] = f_s[2, t] * x_f[t, d]
                    x_f[t, d] = x_f[t, d] * T.cast(k_s[t, d], f32)
                T.reduce_sum(x_f, rs, dim=1)
                for t in T.Parallel(BT):
                    rows[0, hv, c, t] = rs[t]
                T.gemm(do_s, s_s, x_f, transpose_B=True, clear_accum=True)
                for t, d in T.Parallel(BT, D):
                    dq_f[t, d] = f_s[1, t] * x_f[t, d]
                    x_f[t, d] = x_f[t, d] * T.cast(q_s[t, d], f32)
                T.reduce_sum(x_f, rs, dim=1)
                for t in T.Parallel(BT):
                    rows[1, hv, c, t] = rs[t]
                T.gemm(dyh_s, s_s, x_f, transpose_A=True, transpose_B=True, clear_accum=True)
                for t, d in T.Parallel(BT, D):
                    dk_f[t, d] = dk_f[t, d] - f_s[0, t] * x_f[t, d]
                    x_f[t, d] = x_f[t, d] * T.cast(k_s[t, d], f32)
                T.reduce_sum(x_f, rs, dim=1)
                for t in T.Parallel(BT):
                    rows[2, hv, c, t] = rs[t]
                # the 64x64 terms
                T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                T.gemm(do_s, u_s, dpu, transpose_B=True, clear_accum=True)
                T.gemm(dyh_s, u_s, dyu, transpose_A=True, transpose_B=True, clear_accum=True)
                for t, j in T.Parallel(BT, BT):
                    m[t, j] = T.cast(T.if_then_else(j <= t, f_s[5, t] * dpu[t, j] * qk[t, j], 0.0), f16)
                    m[BT + t, j] = T.cast(T.if_then_else(j <= t, f_s[6, j] * dpu[t, j], 0.0), f16)
                    m[2 * BT + t, j] = T.cast(T.if_then_else(j < t, f_s[7, t] * dyu[t, j] * kk[t, j], 0.0), f16)
                    m[3 * BT + t, j] = T.cast(T.if_then_else(j < t, f_s[6, t] * dyu[t, j], 0.0), f16)
                for t, j in T.Parallel(BT, BT):
                    qk[t, j] = qk[t, j] * dpu[t, j] + kk[t, j] * dyu[t, j]
                T.reduce_sum(qk, rs, dim=1)
                for t in T.Parallel(BT):
                    rows[3, hv, c, t] = rs[t]
                T.gemm(m[0:BT, :], k_s, dq_f)
                T.gemm(m[BT:2 * BT, :], q_s, dk_f, transpose_A=True)
                T.gemm(m[2 * BT:3 * BT, :], k_s, dk_f)
                T.gemm(m[3 * BT:4 * BT, :], k_s, dk_f, transpose_A=True)
                T.copy(dq_f, dq[t0:t0 + BT, hv, 0:D])
                T.copy(dk_f, dk[t0:t0 + BT, hv, 0:D])

    return fused_bwd


if __name__ == "__main__":
    from tilelang import tvm
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    pc = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    with tvm.transform.PassContext(opt_level=3, config=pc), target:
        art = tilelang.lower(build(threads), target=target)
    open(f"/tmp/fused_bwd_skeleton_{threads}.cu", "w").write(art.kernel_source)
    print("lowered", len(art.kernel_source))
    import re as _re
    hs = art.host_source if hasattr(art, "host_source") else ""
    i = hs.find("_kernel_packed == NULL")
    print("dyn smem", _re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", hs[:i])[-1:] if i >= 0 else "?")
    print(_re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", art.kernel_source))
