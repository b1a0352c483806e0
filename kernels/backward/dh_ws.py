"""``gdn_bwd_dh_ws``: the reverse sequential pass of ``gdn_bwd_dh``, warp-specialised and key-first.

The same products and roundings as ``gdn_bwd_dh`` on the same inputs and outputs (its arguments, its tables'
layouts), with the state gradient key-first, ``dS [DK, BV]`` fp32 in the registers of one warpgroup, so that a CTA
can own ``BV = 32`` value columns (twice the CTAs of the value-first kernel, whose wgmma rows are its 64 value
columns), and with every step off the chain moved to other warpgroups.  One CTA of three warpgroups per (block of
``BV`` value columns, value head, sequence):

* WG0, the chain; per chunk, last to first::

      dSh, dSl = split(dS)              value-first tiles [BV, DK]: the B operand of K dS and the dS' tables' tiles
      dU  = dUloc + F2 (K dSh + K dSl)                                  [64, BV]
      dY  = Th^T dUh (+ Tl^T dUh) (+ Th^T dUl)                          [64, BV]
      dYh, dYl = split(dY)              value-first tiles [BV, 64] for the dY tables;  dv = rd(F7 dY)
      dS  = F3 dS + Q^T (D1h + D1l) - K^T (D2h (+ D2l)),   D2 = split(F0 F7 dY)

* WG1, beside it: ``D1h, D1l = split(F1 dO)`` a chunk ahead of its use, and the TMA stores of the dS' and dY tables
  from the chain's tiles (the fp8 codes of dSl first with ``lo8``);
* WG2, the producer: one warp issues the TMA loads of q, k, dO, Th (+ Tl), Fb, dUloc into two stages.

The ``one`` form drops every lo term above (dSl, D1l, dUl, D2l, Tl and the dY lo table): 4 wgmma a chunk; its
D1 and D2 are rounded under the chunk's power of two ``2^x``, ``x = floor(-G_0 log2 e)`` in [-126, 126] (``G_0`` the
gate table's first cumsum: e^G_0 2^x in [1, 2)), so that fp16 keeps them under strong decay, and their products are
scaled back, ``dS = F3 dS + 2^-x (Q^T D1 - K^T D2)``.

Hand-offs through single shared tiles and mbarriers completed once a chunk (waited on at parity ``i % 2`` of the
chunk's position ``i`` in the pass; a tile's "free" barrier at ``(i + 1) % 2``, which a fresh barrier passes).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.lo8 import LO8, lo8_code_of
from kernels.common.prologue import dynamic_dims, lo_shape, load_state_kt, seq_span, split_into, split_products, \
    store_state_kt
from kernels.forward.cumsum import LOG2E

from .scales import EXP_MAX, times

BT = 64
WG = 128


def chunk_pow2(g0, sign: int = 1):
    """``2^(sign x)`` (fp32, built from its exponent bits: exact), ``x = floor(-g0 log2 e)`` clamped to
    [-EXP_MAX, EXP_MAX]: the power of two of a chunk whose first gate cumsum is ``g0`` (fp32)."""
    x = T.cast(T.max(T.min(T.floor(-g0 * LOG2E), float(EXP_MAX)), -float(EXP_MAX)), "int32")
    return T.reinterpret((127 + sign * x) << 23, "float32")


@T.macro
def split_transposed(x_f, hi_s, lo_s, with_lo=True):
    """``hi_s = rd(x^T)``, ``lo_s = rd(x^T - hi^T)`` in the dtype of ``hi_s``: the two-term split of the fp32
    fragment ``x_f [R, C]`` written transposed into the shared tiles ``[C, R]`` (``with_lo`` False, a build-time
    bool: ``hi_s`` alone)."""
    for i, j in T.Parallel(*x_f.shape):
        hi_s[j, i] = T.cast(x_f[i, j], hi_s.dtype)
        if with_lo:
            lo_s[j, i] = T.cast(x_f[i, j] - T.cast(T.cast(x_f[i, j], hi_s.dtype), "float32"), hi_s.dtype)


def build_bwd_dh_ws(DK: int, DV: int, dtype: str, BV: int = 32, single: bool = False, tinv_lo: bool = True,
                    lo8: bool = False, one: bool = False, io: str = ""):
    """TileLang prim_func of ``gdn_bwd_dh_ws``: ``build_bwd_dh``'s forms (``single``, ``tinv_lo``, ``lo8``) and
    arguments, with ``BV = 32`` value columns a CTA.  ``one`` (with ``single``): every operand and table one
    input-dtype term, dS' and F1 dO too, the dS' and dY tables their hi terms alone (``dSl, dYl`` not written):
    4 wgmma a chunk, F1 dO and F0 dX under the chunk's power of two (``chunk_pow2``), dv stored times ``factors[0,
    hv]`` (``backward.scales``).  ``io``: the dtype of ``dv`` where it is not ``dtype`` (the caller's).  Arguments:
    ``build_bwd_dh``'s, then ``factors [2, HV]`` fp32 (read by the one form alone)."""
    assert DK in (64, 128) and DV == DK and BV == 32 and DV % BV == 0
    assert dtype in ("bfloat16", "float16")
    assert not (single and not tinv_lo), "single reads no Tinv lo term: tinv_lo is a form of the split dh"
    assert not one or (single and not lo8), "one (every term single) is a form of single without fp8 lo tables"
    olo = not single               # the lo products of dU, F0 dX
    tlo = olo and tinv_lo          # Tinv's lo term loaded and read
    slo = not one                  # the lo terms of dS', F1 dO and the dY tables
    dvt = io or dtype              # dv's dtype
    f32 = "float32"
    NV = DV // BV
    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")

    @T.macro
    def body(q, k, do, Th, Tl, Fb, dUl, cu_seqlens,
             chunk_offsets, dht, dSh, dSl, dYh, dYl, dv, dh0,
             use_dht, store_dh0, v_first, factors):
        with T.Kernel(NV, HV, N, threads=3 * WG) as (bv, hv, n):
            h = hv // (HV // H)
            bos, eos, c0, nchunks = seq_span(cu_seqlens, chunk_offsets, n)
            v0 = bv * BV

            # the inputs, two stages
            q_s = T.alloc_shared((2, BT, DK), dtype)
            k_s = T.alloc_shared((2, BT, DK), dtype)
            do_s = T.alloc_shared((2, BT, BV), dtype)
            th_s = T.alloc_shared((2, BT, BT), dtype)
            tl_s = T.alloc_shared(lo_shape((2, BT, BT), tlo), dtype)
            f_s = T.alloc_shared((2, 8, BT), f32)
            dul_s = T.alloc_shared((2, BV, BT), f32)
            # the chain's tiles: dS' (value-first, also stored), dU then F0 dX, dY (value-first, stored)
            dsh_s = T.alloc_shared((BV, DK), dtype)
            dsl_s = T.alloc_shared(lo_shape((BV, DK), slo), dtype)
            d8_s = T.alloc_shared(lo_shape((BV, DK), lo8), LO8)
            xh_s = T.alloc_shared((BT, BV), dtype)
            xl_s = T.alloc_shared(lo_shape((BT, BV), olo), dtype)
            yh_s = T.alloc_shared((BV, BT), dtype)
            yl_s = T.alloc_shared(lo_shape((BV, BT), slo), dtype)
            # F1 dO split, from WG1
            ah_s = T.alloc_shared((BT, BV), dtype)
            al_s = T.alloc_shared(lo_shape((BT, BV), slo), dtype)
            # 128-byte swizzles: dUloc^T read in the accumulator layout [64, BV] and the value-first tiles written
            # from it (rows 2 apart in one instruction) are at most 2-way bank conflicted
            swz = (dul_s, yh_s, dsh_s) + ((yl_s, dsl_s) if slo else ())
            T.annotate_layout({t: make_swizzled_layout(t) for t in swz})

            full = T.alloc_barrier(arrive_count=[32] * 2)          # a stage's loads landed (the loading warp)
            empty = T.alloc_barrier(arrive_count=[2 * WG] * 2)     # a stage read by WG0 and WG1
            s_ready = T.alloc_barrier(arrive_count=WG)             # dSh, dSl written (WG0)
            s_free = T.alloc_barrier(arrive_count=2 * WG)          # dSh, dSl read (WG0's products, WG1's store)
            y_ready = T.alloc_barrier(arrive_count=WG)             # dYh, dYl written (WG0)
            y_free = T.alloc_barrier(arrive_count=WG)              # dYh, dYl stored (WG1)
            a_ready = T.alloc_barrier(arrive_count=WG)             # D1h, D1l written (WG1)
            a_free = T.alloc_barrier(arrive_count=WG)              # D1h, D1l read (WG0)
            coded = T.alloc_barrier(arrive_count=WG)               # the fp8 codes of dSl written (WG1, lo8)

            tx = T.get_thread_binding()

            if tx < WG:
                # WG0: the chain
                T.set_max_nreg(240, 1)
                ds_f = T.alloc_fragment((DK, BV), f32)
                kd_f = T.alloc_fragment((BT, BV), f32)
                dy_f = T.alloc_fragment((BT, BV), f32)
                if one:
                    pq_f = T.alloc_fragment((DK, BV), f32)     # Q^T D1 - K^T D2
                    fac = T.alloc_local((1,), f32)             # dv's factor, read once
                    fac[0] = factors[0, hv]
                if use_dht != 0:
                    load_state_kt(dht, ds_f, v_first, n, hv, v0, BV, DK)
                else:
                    T.clear(ds_f)
                for i in T.serial(nchunks):
                    st = i % 2
                    ic = nchunks - 1 - i
                    t0 = bos + ic * BT
                    T.barrier_wait(full[st], (i // 2) % 2)
                    # the gradient of this chunk's end state, split, value-first
                    T.barrier_wait(s_free, (i + 1) % 2)
                    split_transposed(ds_f, dsh_s, dsl_s, slo)
                    T.fence_proxy_async()
                    T.barrier_arrive(s_ready)
                    # dU = dUloc + F2 (K dS)
                    if slo:
                        T.wgmma_gemm(k_s[st, :, :], dsh_s, kd_f, transpose_B=True, clear_accum=True)
                        T.gemm(k_s[st, :, :], dsl_s, kd_f, transpose_B=True)
                    else:           # the synchronous form: its accumulator is read next
                        T.gemm(k_s[st, :, :], dsh_s, kd_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(s_free)
                    for t, j in T.Parallel(BT, BV):
                        kd_f[t, j] = dul_s[st, j, t] + f_s[st, 2, t] * kd_f[t, j]
                    split_into(kd_f, xh_s, xl_s, olo)
                    T.fence_proxy_async()
                    # dY = Tinv^T dU
                    split_products(th_s[st, :, :], tl_s[st, :, :], xh_s, xl_s, dy_f, tlo, olo, True, True)
                    T.barrier_wait(y_free, (i + 1) % 2)
                    split_transposed(dy_f, yh_s, yl_s, slo)
                    T.fence_proxy_async()
                    T.barrier_arrive(y_ready)
                    # dX = F7 dY, formed before the stores' branch (no gate-table load under a branch per element)
                    for t, j in T.Parallel(BT, BV):
                        kd_f[t, j] = f_s[st, 7, t] * dy_f[t, j]
                    for t, j in T.Parallel(BT, BV):
                        if t0 + t < eos:
                            # one: times 2^ea, the group's power of two undone
                            dv[t0 + t, hv, v0 + j] = T.cast(times(kd_f[t, j], fac[0] if one else None), dvt)
                    # dS = F3 dS + Q^T D1 - K^T D2 (one: D1, D2 under the chunk's power of two, undone)
                    for t, j in T.Parallel(BT, BV):
                        kd_f[t, j] = times(-kd_f[t, j] * f_s[st, 0, t], chunk_pow2(f_s[st, 4, 0]) if one else None)
                    split_into(kd_f, xh_s, xl_s, olo)
                    T.fence_proxy_async()
                    if one:
                        T.barrier_wait(a_ready, i % 2)
                        T.wgmma_gemm(q_s[st, :, :], ah_s, pq_f, transpose_A=True, clear_accum=True)
                        T.gemm(k_s[st, :, :], xh_s, pq_f, transpose_A=True)
                        T.barrier_arrive(a_free)
                        for d, j in T.Parallel(DK, BV):
                            ds_f[d, j] = ds_f[d, j] * f_s[st, 3, 0] + pq_f[d, j] * chunk_pow2(f_s[st, 4, 0], -1)
                        T.barrier_arrive(empty[st])
                    else:
                        for d, j in T.Parallel(DK, BV):
                            ds_f[d, j] = ds_f[d, j] * f_s[st, 3, 0]
                        T.barrier_wait(a_ready, i % 2)
                        T.wgmma_gemm(q_s[st, :, :], ah_s, ds_f, transpose_A=True)
                        if slo:
                            T.wgmma_gemm(q_s[st, :, :], al_s, ds_f, transpose_A=True)
                        split_products(k_s[st, :, :], None, xh_s, xl_s, ds_f, False, olo, False, True)
                        T.barrier_arrive(a_free)
                        T.barrier_arrive(empty[st])
                if store_dh0 != 0:
                    store_state_kt(ds_f, dh0, v_first, n, hv, v0, BV, DK)
            elif tx < 2 * WG:
                # WG1: F1 dO, split; the table stores
                T.set_max_nreg(160, 0)
                a_f = T.alloc_fragment((BT, BV), f32)
                for i in T.serial(nchunks):
                    st = i % 2
                    c = c0 + nchunks - 1 - i
                    T.barrier_wait(full[st], (i // 2) % 2)
                    for t, j in T.Parallel(BT, BV):
                        a_f[t, j] = times(T.cast(do_s[st, t, j], f32) * f_s[st, 1, t],
                                          chunk_pow2(f_s[st, 4, 0]) if one else None)
                    T.barrier_arrive(empty[st])
                    T.barrier_wait(a_free, (i + 1) % 2)
                    split_into(a_f, ah_s, al_s, slo)
                    T.fence_proxy_async()
                    T.barrier_arrive(a_ready)
                    # the dS' tables of chunk c
                    T.barrier_wait(s_ready, i % 2)
                    if lo8:
                        for j, d in T.Parallel(BV, DK):
                            d8_s[j, d] = lo8_code_of(dsl_s[j, d], dsh_s[j, d], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(coded)
                        T.barrier_wait(coded, i % 2)
                        T.tma_copy(dsh_s, dSh[hv, c, v0:v0 + BV, 0:DK])
                        T.tma_copy(d8_s, dSl[hv, c, v0:v0 + BV, 0:DK])
                    else:
                        T.tma_copy(dsh_s, dSh[hv, c, v0:v0 + BV, 0:DK])
                        if slo:
                            T.tma_copy(dsl_s, dSl[hv, c, v0:v0 + BV, 0:DK])
                    T.tma_store_wait()
                    T.barrier_arrive(s_free)
                    # the dY tables of chunk c
                    T.barrier_wait(y_ready, i % 2)
                    T.tma_copy(yh_s, dYh[hv, c, v0:v0 + BV, 0:BT])
                    if slo:
                        T.tma_copy(yl_s, dYl[hv, c, v0:v0 + BV, 0:BT])
                    T.tma_store_wait()
                    T.barrier_arrive(y_free)
            else:
                # WG2: the producer (its first warp loads; the others wait out the kernel)
                T.set_max_nreg(24, 0)
                if tx < 2 * WG + 32:
                    for i in T.serial(nchunks):
                        st = i % 2
                        t0 = bos + (nchunks - 1 - i) * BT
                        c = c0 + nchunks - 1 - i
                        T.barrier_wait(empty[st], (i // 2 + 1) % 2)
                        T.tma_copy(q[t0:t0 + BT, h, 0:DK], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[t0:t0 + BT, h, 0:DK], k_s[st, :, :], barrier=full[st])
                        T.tma_copy(do[t0:t0 + BT, hv, v0:v0 + BV], do_s[st, :, :], barrier=full[st])
                        T.tma_copy(Th[hv, c, 0:BT, 0:BT], th_s[st, :, :], barrier=full[st])
                        if tlo:
                            T.tma_copy(Tl[hv, c, 0:BT, 0:BT], tl_s[st, :, :], barrier=full[st])
                        T.tma_copy(Fb[hv, c, 0:8, 0:BT], f_s[st, :, :], barrier=full[st])
                        T.tma_copy(dUl[hv, c, v0:v0 + BV, 0:BT], dul_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])

    @T.prim_func
    def gdn_bwd_dh_ws(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Th: T.Tensor((HV, NCg, BT, BT), dtype),
        Tl: T.Tensor((HV, NCg, BT, BT), dtype),
        Fb: T.Tensor((HV, NCg, 8, BT), f32),
        dUl: T.Tensor((HV, NCg, DV, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        dht: T.Tensor((Nh, HV, DK, DV), f32),
        dSh: T.Tensor((HV, NCg, DV, DK), dtype),
        dSl: T.Tensor((HV, NCg, DV, DK), LO8 if lo8 else dtype),
        dYh: T.Tensor((HV, NCg, DV, BT), dtype),
        dYl: T.Tensor((HV, NCg, DV, BT), dtype),
        dv: T.Tensor((Ttot, HV, DV), dvt),
        dh0: T.Tensor((Nt, HV, DK, DV), f32),
        Lb: T.Tensor((HV, NCg), f32),
        use_dht: T.int32,
        store_dh0: T.int32,
        v_first: T.int32,
        factors: T.Tensor((2, HV), f32),
    ):
        body(q, k, do, Th, Tl, Fb, dUl, cu_seqlens,
             chunk_offsets, dht, dSh, dSl, dYh, dYl, dv, dh0,
             use_dht, store_dh0, v_first, factors if one else None)

    return gdn_bwd_dh_ws
