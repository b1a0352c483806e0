"""``gdn_bwd_fused``: the reverse pass and the chunk terms of the one-term backward (``gdn_bwd_dh_ws`` and
``gdn_bwd_dqk`` in their ``one`` forms) in one warp-specialised kernel, with dUloc = P^T dO formed in the kernel
from one fp16 term of P (the emulation's ``p_single``).

One CTA of four warpgroups per (value head, sequence), K = V = 128, chunks last to first, four phases a chunk
joined by mbarriers (``ph``), each chunk's inputs loaded by TMA beside them:

* WG0, the chain (dS fp32 key-first in registers): P1 P = F5_t F6_j e^(G_t - G_j) QK^T (j <= t), dS' = rd(dS),
  dU = F2 K dS' + P^T dO by halves of 64 value columns; P2 dY = Th^T dU (dv stored), D2 = rd(-F7 F0 2^x dY);
  P3 dS = (F3 2^x dS + Q^T D1 + K^T D2) 2^-x, ``2^x`` the chunk's power of two (``dh_ws.chunk_pow2``).
* WG1, dq~: P1 Z = dO S^T (dq~, q.Z), dO U^T -> M0, dq~ += M0 K; P2 dq~ stored, QK -> M1, the dg summands'
  dO U^T part; P3 KK, dY U^T -> the dbeta row sums, the dg summands m (stored as three bf16 terms), M2, M3;
  P4 the dg rectangle, rect[c] = sum_{j < c} X[c, j] with X = U m by wgmma (U the upper triangle of ones, m
  as three bf16 terms: m to fp32's 24 bits).
* WG2, dk~: P1 the previous chunk's dY.v row dots (the diagonal of dY V^T, v loaded over D1 after P3, so that its
  load is not waited for in P4), D1 = rd(F1 2^x dO); P2 the S o dS' column dots (the diagonals of S^T dS' by halves
  of 64 columns), R = U dS'^T (dk~, k.R); P3 W = dY S^T by halves of 64 keys (dk~, k.W), dk~ += M1^T Q; P4 dk~ +=
  M2 K + M3^T K, stored after the phase's arrival.
* WG3, one producer warp: k and the gate table in two stages; dO, S, U, q, Th as the phases free them; v after P3.

No [64, 128] fragment lives beside another in WG1 or WG2 (row dots by halves, dq~ finished in P1): that keeps
every wgmma asynchronous at registers (184, 168, 136, 24).  Elementwise steps form a fragment first and store it to
shared memory after, so no shared load waits behind a shared store; a masked value is formed, then selected (no
branch per element around its loads).
"""
import tilelang.language as T

from kernels.common.prologue import dynamic_dims, seq_span
from kernels.forward.cp_warm import backward_macros
from kernels.forward.cumsum import LOG2E

from .dh_ws import chunk_pow2

warm_after, _ = backward_macros()

BT = 64
WG = 128
f32, f16, bf16 = "float32", "float16", "bfloat16"


def egate(f_s, st, t, j):
    """e^(G_t - G_j) from the gate rows of stage ``st``."""
    return T.exp2((f_s[st, 4, t] - f_s[st, 4, j]) * LOG2E)


def _row(rows_s, st, t, d):
    return T.cast(rows_s[t, d] if st is None else rows_s[st, t, d], f32)


@T.macro
def put_dots(rs, out, hv, c):
    """``out[0, hv, c, :] = rs``, ``out[1, hv, c, :] = 0``."""
    for t in T.Parallel(BT):
        out[0, hv, c, t] = rs[t]
        out[1, hv, c, t] = T.float32(0)


@T.macro
def put_diagonal(x_f, out, hv, c, o, nv, keep):
    """Where ``keep``: ``out[0, hv, c, o + t] = x_f[t, o + t]`` for ``t < nv``, else 0; ``out[1, hv, c, o + t] = 0``
    (``x_f`` [64, 64] or [64, 128] fp32, ``o`` its diagonal's first column: each diagonal element stored by the
    thread that holds it, ``keep`` a predicate of its stores, not a branch around them)."""
    for t, j in T.Parallel(*x_f.shape):
        if (j == o + t) & keep:
            out[0, hv, c, j] = T.if_then_else(t < nv, x_f[t, j], T.float32(0))
            out[1, hv, c, j] = T.float32(0)


@T.macro
def v_dots(yh_s, d1_s, x_f, yv, hv, c, tc, eos, warm):
    """Chunk ``c``'s dY.v row dots (its first token ``tc``), the diagonal of dY V^T, into ``yv`` (v over D1, waited
    for by the caller; ``x_f`` [64, 64] fp32 fragment; ``put_diagonal``, kept where its tokens are the segment's:
    ``tc < eos`` with ``warm``)."""
    T.gemm(yh_s, d1_s, x_f, transpose_B=True, clear_accum=True)
    put_diagonal(x_f, yv, hv, c, 0, T.min(eos - tc, BT), (tc < eos) if warm else True)


@T.macro
def half_dots(x_f, rows_s, st, tmp, rs, rs2, nv):
    """``rs[t] = sum_d [t < nv] rows[t, d] x_f[t, d]`` by halves of 64 columns (``x_f [64, D]`` kept; ``tmp
    [64, 64]`` fp32 fragment; ``rows`` the [64, D] tile ``rows_s``, or its stage ``st`` when ``st`` is not None)."""
    T.clear(rs)
    for hh in T.unroll(2):
        for t, d in T.Parallel(BT, BT):
            r = _row(rows_s, st, t, hh * BT + d)
            tmp[t, d] = T.if_then_else(t < nv, r, T.float32(0)) * x_f[t, hh * BT + d]
        T.reduce_sum(tmp, rs2, dim=1)
        for t in T.Parallel(BT):
            rs[t] = rs[t] + rs2[t]


@T.macro
def form_d1(do_s, f_s, st, x_h, d1_s):
    """``d1_s = rd(F1 2^x dO)`` by halves of 64 columns through the [64, 64] fp32 fragment ``x_h`` (gate rows of
    stage ``st``; ``2^x`` the chunk's power of two)."""
    for hh in T.unroll(2):
        for t, d in T.Parallel(BT, BT):
            x_h[t, d] = T.cast(do_s[t, hh * BT + d], f32) * f_s[st, 1, t] * chunk_pow2(f_s[st, 4, 0])
        for t, d in T.Parallel(BT, BT):
            d1_s[t, hh * BT + d] = T.cast(x_h[t, d], f16)


@T.macro
def pass_phases(ph, par):
    """Arrive at the chunk's four phase barriers ``ph`` in turn, waiting for each (parity ``par``): a warpgroup with
    no work in the chunk."""
    for k in T.unroll(4):
        T.barrier_arrive(ph[k])
        T.barrier_wait(ph[k], par)


@T.macro
def store_rows(x_f, out, t0, hv, nv, fac):
    """``out[t0 + t, hv, :] = x_f[t, :] fac`` in ``out``'s dtype for ``t < nv`` (``fac`` a register: a global load
    inside the predicated stores would be issued once per element pair, each waited for)."""
    for t, d in T.Parallel(*x_f.shape):
        if t < nv:
            out[t0 + t, hv, d] = T.cast(x_f[t, d] * fac, out.dtype)


def build_bwd_fused(D: int = 128, io: str = "bfloat16", nreg=(184, 168, 136, 24), warm: bool = False,
                    chain: bool = False, dq16: bool = False):
    """TileLang prim_func of ``gdn_bwd_fused``.  Arguments: q, k [Ttot, H, D], v, dO [Ttot, HV, D] fp16 (the one-term
    plan's, v and dO under its powers of two); Sch [HV, NC, D, D] (key-first), Uh [HV, NC, 64, D],
    Th [HV, NC, 64, 64] fp16; Fb [HV, NC, 8, 64] fp32; cu_seqlens [N + 1], chunk_offsets [N + 1] int32 ([4 N + 1] with
    ``warm``); seq_order [N] int32 (CTA (hv, i) runs sequence ``seq_order[i]``: the order in which the sequences'
    CTAs are issued); Lb [HV, NC] fp32 (each chunk's log2 norm bound, read by ``warm`` alone); dht [N or 1, HV, D,
    D] fp32 key-first; then the outputs dv [Ttot, HV, D] in ``io``, dq~, dk~ [Ttot, HV, D] fp32 per value head (times
    ``factors[1, hv]``), qz, kw, kr, yv, db2 [2, HV, NC, 64] and sd [2, HV, NC, D] fp32 (half 0 the sums, half 1 zero),
    rect [HV, NC, 64], dh0 [N or 1, HV, D, D] fp32 key-first (with ``warm``, dht and dh0 per segment); use_dht,
    store_dh0 int32, scale fp32, factors [2, HV] fp32 (dv stored times row 0, dq~ and dk~ times row 1).

    ``dq16``: dq~ and dk~ stored in fp16 as the kernel forms them, under the GVA group's powers of two (not times
    ``factors[1]``: ``gdn_bwd_group_sum``'s scaled form applies it), half the bytes of fp32 (the chain form, which
    stores neither: their arguments declared fp16, as its caller's buffers are).

    ``warm`` (``gdn_bwd_fused_warm``): the N "sequences" are CP segments of the call's sequences and
    ``chunk_offsets`` is ``dh_segmented.warm_table``'s; a segment that is not its sequence's last first runs its
    warm-up chunks after its end from a zero state gradient (``cp_warm``'s ``warm_after`` on ``Lb``), storing
    nothing for them, or runs on from its sequence's end; dht and dh0 are indexed by segment (the caller gives each
    segment its sequence's dht and takes each sequence's first segment's dh0: a sequence index read in the kernel
    costs the chain warpgroup spills).

    ``chain`` (``gdn_bwd_fused_chain``, the exact segmented pass's pass A): the reverse chain alone, dh0 its one
    output (stored where ``store_dh0``): warpgroup 1 and warpgroup 2's terms past D1 are not built, S and U not
    loaded, nothing else stored."""
    assert not (warm and chain), "the chain form runs its segments from their given end gradients"
    full = not chain
    assert D == 128, "the fused backward is built at K = V = 128 alone (its tiles take 225 KiB of shared memory)"
    assert io in ("bfloat16", "float16"), io
    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")
    n_co = 4 * N + 1 if warm else N + 1
    qk_t = f16 if dq16 else f32                     # dq~, dk~ as stored

    def chunk_step(i, ntot, c0, bos, eos):
        """(ic, c, t0, keep, nv) of step ``i`` of a chunk loop (chunks last to first): the segment's chunk, its global
        index, its first token, whether its outputs are stored (a warm-up chunk's tokens are the next segment's), its
        valid rows."""
        ic = ntot - 1 - i
        t0 = bos + ic * BT
        return ic, c0 + ic, t0, (t0 < eos if warm else True), T.min(eos - t0, BT)

    @T.prim_func
    def gdn_bwd_fused(
        q: T.Tensor((Ttot, H, D), f16),
        k: T.Tensor((Ttot, H, D), f16),
        v: T.Tensor((Ttot, HV, D), f16),
        do: T.Tensor((Ttot, HV, D), f16),
        Sch: T.Tensor((HV, NCg, D, D), f16),
        Uh: T.Tensor((HV, NCg, BT, D), f16),
        Th: T.Tensor((HV, NCg, BT, BT), f16),
        Fb: T.Tensor((HV, NCg, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((n_co,), "int32"),
        seq_order: T.Tensor((N,), "int32"),
        Lb: T.Tensor((HV, NCg), f32),
        dht: T.Tensor((Nh, HV, D, D), f32),
        dv: T.Tensor((Ttot, HV, D), io),
        dq32: T.Tensor((Ttot, HV, D), qk_t),
        dk32: T.Tensor((Ttot, HV, D), qk_t),
        qz: T.Tensor((2, HV, NCg, BT), f32),
        kw: T.Tensor((2, HV, NCg, BT), f32),
        kr: T.Tensor((2, HV, NCg, BT), f32),
        yv: T.Tensor((2, HV, NCg, BT), f32),
        db2: T.Tensor((2, HV, NCg, BT), f32),
        sd: T.Tensor((2, HV, NCg, D), f32),
        rect: T.Tensor((HV, NCg, BT), f32),
        dh0: T.Tensor((Nt, HV, D, D), f32),
        use_dht: T.int32,
        store_dh0: T.int32,
        scale: T.float32,
        factors: T.Tensor((2, HV), f32),
    ):
        with T.Kernel(HV, N, threads=4 * WG) as (hv, i_n):
            n = seq_order[i_n]
            h = hv // (HV // H)
            bos, eos, c0, nch = seq_span(cu_seqlens, chunk_offsets, n)
            q_s = T.alloc_shared((BT, D), f16)
            k_s = T.alloc_shared((2, BT, D), f16)
            do_s = T.alloc_shared((BT, D), f16)
            s_s = T.alloc_shared((D, D), f16)          # the chunk-start state S, key-first
            u_s = T.alloc_shared((BT, D), f16)
            th_s = T.alloc_shared((BT, BT), f16)       # Th, then M3
            f_s = T.alloc_shared((2, 8, BT), f32)
            p_s = T.alloc_shared((BT, BT), f16)        # P, then M2
            m1_s = T.alloc_shared((BT, BT), f16)       # M0, then M1
            d1_s = T.alloc_shared((BT, D), f16)
            dsh_s = T.alloc_shared((D, D), f16)        # dS' key-first, then the dg summands
            xh_s = T.alloc_shared((BT, D), f16)        # dU, then D2
            yh_s = T.alloc_shared((BT, D), f16)        # dY
            # the dg summands m as three bf16 terms (quarters 0-2) and the upper triangle of ones U (quarter 3)
            mt_s = T.view(dsh_s, (D, D), bf16)
            if warm:
                rw_s = T.alloc_shared((BT,), f32)      # warm_after's scratch
                w = T.alloc_local((1,), "int32")       # warm-up chunks after the segment
                wacc = T.alloc_local((1,), f32)
                end = chunk_offsets[chunk_offsets[2 * N + 1 + n] + 1]
                warm_after(Lb, hv, chunk_offsets[n + 1], end, w, wacc, rw_s)
                # exact (from the sequence's dht) where the warm-up reaches the sequence's end
                from_dht = T.if_then_else(c0 + nch + w[0] == end, use_dht, 0)
                ntot = T.alloc_var("int32")            # the chunks run: the segment's, then its warm-up ones
                ntot = nch + w[0]
            else:
                from_dht, ntot = use_dht, nch

            full_k = T.alloc_barrier(arrive_count=[32] * 2)
            full_q = T.alloc_barrier(arrive_count=32)
            full_do = T.alloc_barrier(arrive_count=32)
            full_su = T.alloc_barrier(arrive_count=32)
            full_th = T.alloc_barrier(arrive_count=32)
            full_v = T.alloc_barrier(arrive_count=32)     # v over D1 (after P3)
            ph = T.alloc_barrier(arrive_count=[3 * WG] * 4)

            tx = T.get_thread_binding()

            if tx < WG:
                # WG0: the chain
                T.set_max_nreg(nreg[0], 1)
                ds_f = T.alloc_fragment((D, D), f32)
                kd_f = T.alloc_fragment((BT, BT), f32)
                xp = T.alloc_local((2,), f32)              # the chunk's 2^x and 2^-x
                fac = T.alloc_local((1,), f32)             # dv's factor
                fac[0] = factors[0, hv]
                if from_dht != 0:
                    T.copy(dht[n, hv, 0:D, 0:D], ds_f)
                else:
                    T.clear(ds_f)
                for i in T.serial(ntot):
                    ic, c, t0, keep, nv = chunk_step(i, ntot, c0, bos, eos)
                    par = i % 2
                    st = i % 2
                    # P1: P, dS', dU
                    T.barrier_wait(full_k[st], (i // 2) % 2)
                    T.barrier_wait(full_q, par)
                    T.barrier_wait(full_do, par)
                    xp[0] = chunk_pow2(f_s[st, 4, 0])
                    xp[1] = chunk_pow2(f_s[st, 4, 0], -1)
                    T.gemm(q_s, k_s[st, :, :], kd_f, transpose_B=True, clear_accum=True)
                    for a, b in T.Parallel(BT, BT):
                        x = f_s[st, 5, a] * f_s[st, 6, b] * egate(f_s, st, a, b) * kd_f[a, b]
                        kd_f[a, b] = T.if_then_else(b <= a, x, 0.0)
                    for a, b in T.Parallel(BT, BT):
                        p_s[a, b] = T.cast(kd_f[a, b], f16)
                    for a, b in T.Parallel(D, D):
                        dsh_s[a, b] = T.cast(ds_f[a, b], f16)
                    T.fence_proxy_async()
                    for hh in T.unroll(2):
                        T.gemm(k_s[st, :, :], dsh_s[:, hh * BT:(hh + 1) * BT], kd_f, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            kd_f[t, j] = f_s[st, 2, t] * kd_f[t, j]
                        T.gemm(p_s, do_s[:, hh * BT:(hh + 1) * BT], kd_f, transpose_A=True)
                        for t, j in T.Parallel(BT, BT):
                            xh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                    T.fence_proxy_async()
                    T.barrier_arrive(ph[0])
                    T.barrier_wait(ph[0], par)
                    # P2: dY, dv, D2
                    T.barrier_wait(full_th, par)
                    for hh in T.unroll(2):
                        T.gemm(th_s, xh_s[:, hh * BT:(hh + 1) * BT], kd_f, transpose_A=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            yh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                        for t, j in T.Parallel(BT, BT):
                            kd_f[t, j] = f_s[st, 7, t] * kd_f[t, j]
                        for t, j in T.Parallel(BT, BT):
                            if full:                    # (a build-time condition: the chain form stores no dv)
                                if t0 + t < eos:
                                    dv[t0 + t, hv, hh * BT + j] = T.cast(kd_f[t, j] * fac[0], io)
                            kd_f[t, j] = -kd_f[t, j] * f_s[st, 0, t] * xp[0]
                        for t, j in T.Parallel(BT, BT):
                            xh_s[t, hh * BT + j] = T.cast(kd_f[t, j], f16)
                    T.fence_proxy_async()
                    T.barrier_arrive(ph[1])
                    T.barrier_wait(ph[1], par)
                    # P3: dS = (F3 2^x dS + Q^T D1 + K^T D2) 2^-x
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * (f_s[st, 3, 0] * xp[0])
                    T.gemm(q_s, d1_s, ds_f, transpose_A=True)
                    T.gemm(k_s[st, :, :], xh_s, ds_f, transpose_A=True)
                    for a, b in T.Parallel(D, D):
                        ds_f[a, b] = ds_f[a, b] * xp[1]
                    T.barrier_arrive(ph[2])
                    T.barrier_wait(ph[2], par)
                    # P4: the other warpgroups' (P, dS' and Th free once they end)
                    T.barrier_arrive(ph[3])
                    T.barrier_wait(ph[3], par)
                if store_dh0 != 0:
                    T.copy(ds_f, dh0[n, hv, 0:D, 0:D])
            elif tx < 2 * WG:
                # WG1: dq~ and the 64x64 terms
                T.set_max_nreg(nreg[1], 1)
                dq_f = T.alloc_fragment((BT, D), f32)
                a_f = T.alloc_fragment((BT, BT), f32)
                b_f = T.alloc_fragment((BT, BT), f32)
                c_f = T.alloc_fragment((BT, BT), f32)
                rs = T.alloc_fragment((BT,), f32)
                rs2 = T.alloc_fragment((BT,), f32)
                fac = T.alloc_local((1,), f32)             # dq~'s factor
                fac[0] = T.float32(1) if dq16 else factors[1, hv]
                if chain:       # the phases' barriers alone
                    for i in T.serial(ntot):
                        par = i % 2
                        pass_phases(ph, par)
                else:
                    for i in T.serial(ntot):
                        ic, c, t0, keep, nv = chunk_step(i, ntot, c0, bos, eos)
                        par = i % 2
                        st = i % 2
                        # P1: Z = dO S^T -> dq~, q.Z; dO U^T -> M0 (over M1's tile); dq~ += M0 K
                        T.barrier_wait(full_k[st], (i // 2) % 2)
                        T.barrier_wait(full_q, par)
                        T.barrier_wait(full_do, par)
                        T.barrier_wait(full_su, par)
                        T.gemm(do_s, s_s, dq_f, transpose_B=True, clear_accum=True)
                        half_dots(dq_f, q_s, None, c_f, rs, rs2, nv)
                        if keep:
                            put_dots(rs, qz, hv, c)
                        for t, d in T.Parallel(BT, D):
                            dq_f[t, d] = scale * T.exp2(f_s[st, 4, t] * LOG2E) * dq_f[t, d]
                        T.gemm(do_s, u_s, b_f, transpose_B=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            x = scale * egate(f_s, st, t, j) * b_f[t, j] * f_s[st, 6, j]
                            c_f[t, j] = T.if_then_else((j <= t) & (t < nv), x, 0.0)
                        for t, j in T.Parallel(BT, BT):
                            m1_s[t, j] = T.cast(c_f[t, j], f16)
                        T.fence_proxy_async()
                        T.gemm(m1_s, k_s[st, :, :], dq_f)
                        T.barrier_arrive(ph[0])
                        T.barrier_wait(ph[0], par)
                        # P2: dq~ stored; QK -> M1; the summands' dO U^T part
                        store_rows(dq_f, dq32, t0, hv, nv, fac[0])
                        T.gemm(q_s, k_s[st, :, :], a_f, transpose_B=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            x = f_s[st, 5, t] * egate(f_s, st, t, j) * b_f[t, j]
                            b_f[t, j] = T.if_then_else(j <= t, x, 0.0)
                        for t, j in T.Parallel(BT, BT):
                            x = b_f[t, j] * f_s[st, 6, j] * a_f[t, j]
                            c_f[t, j] = T.if_then_else(j < t, x, 0.0)
                        for t, j in T.Parallel(BT, BT):
                            m1_s[t, j] = T.cast(b_f[t, j], f16)
                        T.fence_proxy_async()
                        T.barrier_arrive(ph[1])
                        T.barrier_wait(ph[1], par)
                        # P3: KK, dY U^T -> dbeta row sums, the dg summands, M2 (over P), M3 (over Th)
                        T.gemm(k_s[st, :, :], k_s[st, :, :], a_f, transpose_B=True, clear_accum=True)
                        T.gemm(yh_s, u_s, b_f, transpose_B=True, clear_accum=True)
                        for t, j in T.Parallel(BT, BT):
                            x = egate(f_s, st, t, j) * f_s[st, 6, t] * f_s[st, 6, j] * a_f[t, j]
                            a_f[t, j] = T.if_then_else(j < t, x, 0.0)
                            b_f[t, j] = T.if_then_else(j < t, -b_f[t, j], 0.0)
                        for t, j in T.Parallel(BT, BT):
                            y = c_f[t, j] + f_s[st, 7, t] * b_f[t, j] * a_f[t, j]
                            c_f[t, j] = T.if_then_else(j < t, y, 0.0)
                            a_f[t, j] = b_f[t, j] * a_f[t, j]
                        T.reduce_sum(a_f, rs, dim=1)
                        if keep:
                            put_dots(rs, db2, hv, c)
                        for t, j in T.Parallel(BT, BT):
                            x = c_f[t, j] - T.cast(T.cast(c_f[t, j], bf16), f32)
                            mt_s[t, j] = T.cast(c_f[t, j], bf16)
                            mt_s[t, BT + j] = T.cast(x, bf16)
                            mt_s[BT + t, j] = T.cast(x - T.cast(T.cast(x, bf16), f32), bf16)
                            mt_s[BT + t, BT + j] = T.cast(T.if_then_else(j >= t, 1.0, 0.0), bf16)
                        for t, j in T.Parallel(BT, BT):
                            x = f_s[st, 7, t] * b_f[t, j] * egate(f_s, st, t, j)
                            b_f[t, j] = T.if_then_else(j < t, x, 0.0)
                        for t, j in T.Parallel(BT, BT):
                            a_f[t, j] = b_f[t, j] * f_s[st, 6, j]
                            c_f[t, j] = b_f[t, j] * f_s[st, 6, t]
                        for t, j in T.Parallel(BT, BT):
                            p_s[t, j] = T.cast(a_f[t, j], f16)
                            th_s[t, j] = T.cast(c_f[t, j], f16)
                        T.fence_proxy_async()
                        T.barrier_arrive(ph[2])
                        T.barrier_wait(ph[2], par)
                        # P4: the dg rectangle, rect[c] = sum_{j < c <= t} m[t, j] = sum_{j < c} X[c, j], X = U m
                        T.gemm(mt_s[BT:, BT:], mt_s[:BT, :BT], a_f, clear_accum=True)
                        T.gemm(mt_s[BT:, BT:], mt_s[:BT, BT:], a_f)
                        T.gemm(mt_s[BT:, BT:], mt_s[BT:, :BT], a_f)
                        for t, j in T.Parallel(BT, BT):
                            a_f[t, j] = T.if_then_else(j < t, a_f[t, j], 0.0)
                        T.reduce_sum(a_f, rs, dim=1)
                        if keep:
                            for t in T.Parallel(BT):
                                rect[hv, c, t] = rs[t]
                        T.barrier_arrive(ph[3])
                        T.barrier_wait(ph[3], par)
            elif tx < 3 * WG:
                # WG2: dk~
                T.set_max_nreg(nreg[2], 1 if nreg[2] >= 128 else 0)
                dk_f = T.alloc_fragment((BT, D), f32)
                x_h = T.alloc_fragment((BT, BT), f32)
                rs = T.alloc_fragment((BT,), f32)
                rs2 = T.alloc_fragment((BT,), f32)
                fac = T.alloc_local((1,), f32)             # dk~'s factor
                fac[0] = T.float32(1) if dq16 else factors[1, hv]
                if chain:       # D1 alone, for the chain
                    for i in T.serial(ntot):
                        par = i % 2
                        st = i % 2
                        T.barrier_wait(full_k[st], (i // 2) % 2)
                        T.barrier_wait(full_do, par)
                        form_d1(do_s, f_s, st, x_h, d1_s)
                        T.fence_proxy_async()
                        pass_phases(ph, par)
                else:
                    for i in T.serial(ntot):
                        ic, c, t0, keep, nv = chunk_step(i, ntot, c0, bos, eos)
                        par = i % 2
                        st = i % 2
                        T.barrier_wait(full_k[st], (i // 2) % 2)
                        T.barrier_wait(full_su, par)
                        # P1: the previous chunk's dY.v dots (its dY and v, loaded over D1 after its P3), then
                        # D1 = rd(F1 2^x dO) over v
                        if i > 0:
                            T.barrier_wait(full_v, 1 - par)
                            v_dots(yh_s, d1_s, x_h, yv, hv, c + 1, t0 + BT, eos, warm)
                        T.barrier_wait(full_do, par)
                        form_d1(do_s, f_s, st, x_h, d1_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(ph[0])
                        T.barrier_wait(ph[0], par)
                        # P2: the S o dS' column dots, the diagonals of S^T dS' by halves of 64 columns;
                        # R = U dS'^T -> dk~, k.R
                        for hh in T.unroll(2):
                            T.gemm(s_s[:, hh * BT:(hh + 1) * BT], dsh_s, dk_f, transpose_A=True, clear_accum=True)
                            put_diagonal(dk_f, sd, hv, c, hh * BT, BT, keep)
                        T.gemm(u_s, dsh_s, dk_f, transpose_B=True, clear_accum=True)
                        half_dots(dk_f, k_s, st, x_h, rs, rs2, nv)
                        if keep:
                            put_dots(rs, kr, hv, c)
                        for t, d in T.Parallel(BT, D):
                            dk_f[t, d] = T.exp2((f_s[st, 4, BT - 1] - f_s[st, 4, t]) * LOG2E) * dk_f[t, d]
                        T.barrier_arrive(ph[1])
                        T.barrier_wait(ph[1], par)
                        # P3: W = dY S^T -> dk~, k.W; dk~ += M1^T Q (q's load waited on here too, not only
                        # through ph[0])
                        T.barrier_wait(full_q, par)
                        T.clear(rs)
                        for hh in T.unroll(2):
                            T.gemm(yh_s, s_s[hh * BT:(hh + 1) * BT, :], x_h, transpose_B=True, clear_accum=True)
                            for t, d in T.Parallel(BT, BT):
                                dk_f[t, hh * BT + d] = dk_f[t, hh * BT + d] - f_s[st, 7, t] * T.exp2(
                                    f_s[st, 4, t] * LOG2E) * x_h[t, d]
                            for t, d in T.Parallel(BT, BT):
                                r = _row(k_s, st, t, hh * BT + d)
                                x_h[t, d] = T.if_then_else(t < nv, r, T.float32(0)) * x_h[t, d]
                            T.reduce_sum(x_h, rs2, dim=1)
                            for t in T.Parallel(BT):
                                rs[t] = rs[t] + rs2[t]
                        if keep:
                            put_dots(rs, kw, hv, c)
                        T.gemm(m1_s, q_s, dk_f, transpose_A=True)
                        T.barrier_arrive(ph[2])
                        T.barrier_wait(ph[2], par)
                        # P4: dk~ += M2 K + M3^T K, stored
                        T.gemm(p_s, k_s[st, :, :], dk_f)
                        T.gemm(th_s, k_s[st, :, :], dk_f, transpose_A=True)
                        T.barrier_arrive(ph[3])
                        store_rows(dk_f, dk32, t0, hv, nv, fac[0])
                        T.barrier_wait(ph[3], par)
                    if ntot > 0:                # the first chunk's dY.v dots (run last)
                        T.barrier_wait(full_v, (ntot - 1) % 2)
                        v_dots(yh_s, d1_s, x_h, yv, hv, c0, bos, eos, warm)
            else:
                # WG3: the producer
                T.set_max_nreg(nreg[3], 0)
                # (no chunk: no load, none left in flight when the CTA exits)
                if (tx < 3 * WG + 32) & (ntot > 0):
                    for j in T.unroll(2):
                        if j < ntot:
                            cj = c0 + ntot - 1 - j
                            tj = bos + (ntot - 1 - j) * BT
                            T.tma_copy(k[tj:tj + BT, h, 0:D], k_s[j, :, :], barrier=full_k[j])
                            T.tma_copy(Fb[hv, cj, 0:8, 0:BT], f_s[j, :, :], barrier=full_k[j])
                            T.barrier_arrive(full_k[j])
                    c = c0 + ntot - 1
                    t0 = bos + (ntot - 1) * BT
                    T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_q)
                    T.barrier_arrive(full_q)
                    T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                    T.barrier_arrive(full_do)
                    T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                    T.barrier_arrive(full_th)
                    if full:
                        T.tma_copy(Sch[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                        T.tma_copy(Uh[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                        T.barrier_arrive(full_su)
                    for i in T.serial(ntot):
                        # chunk i's phases free the next chunk's tiles; v of chunk i goes over D1 after P3
                        par = i % 2
                        ic = ntot - 2 - i
                        c = c0 + ic
                        t0 = bos + ic * BT
                        T.barrier_wait(ph[1], par)     # dO read (P1 and WG0's P^T dO)
                        if i + 1 < ntot:
                            T.tma_copy(do[t0:t0 + BT, hv, 0:D], do_s, barrier=full_do)
                            T.barrier_arrive(full_do)
                        T.barrier_wait(ph[2], par)     # S, U, q, D1 read
                        if full:
                            tc = bos + (ntot - 1 - i) * BT
                            T.tma_copy(v[tc:tc + BT, hv, 0:D], d1_s, barrier=full_v)
                            T.barrier_arrive(full_v)
                        if i + 1 < ntot:
                            if full:
                                T.tma_copy(Sch[hv, c, 0:D, 0:D], s_s, barrier=full_su)
                                T.tma_copy(Uh[hv, c, 0:BT, 0:D], u_s, barrier=full_su)
                                T.barrier_arrive(full_su)
                            T.tma_copy(q[t0:t0 + BT, h, 0:D], q_s, barrier=full_q)
                            T.barrier_arrive(full_q)
                        T.barrier_wait(ph[3], par)     # Th (M3), k and the gates of chunk i, v read
                        if i + 1 < ntot:
                            T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s, barrier=full_th)
                            T.barrier_arrive(full_th)
                        if i + 2 < ntot:
                            c2 = c0 + ntot - 3 - i
                            t2 = bos + (ntot - 3 - i) * BT
                            T.tma_copy(k[t2:t2 + BT, h, 0:D], k_s[i % 2, :, :], barrier=full_k[i % 2])
                            T.tma_copy(Fb[hv, c2, 0:8, 0:BT], f_s[i % 2, :, :], barrier=full_k[i % 2])
                            T.barrier_arrive(full_k[i % 2])

    # the warm and chain forms under their own kernel names
    if warm or chain:
        return gdn_bwd_fused.with_attr("global_symbol", "gdn_bwd_fused_warm" if warm else "gdn_bwd_fused_chain")
    return gdn_bwd_fused
