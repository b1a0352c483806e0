"""Sequential state kernel, shared-memory-operand form ``gdn_state_smem``.

One CTA (128 threads) per (block of ``BV`` value columns, value head, sequence or segment); the fp32
state block ``S[DK, BV]`` lives in registers; chunk loads (k, v, Ag, F) are TMA through TileLang's
warp-specialised ``T.Pipelined``.  Per chunk (``prec``: ``precision.Precision``)::

    Sh (+ Sl) = split(S)                 -> Sch (+ Scl)  chunk-start state for the output kernel
    X  = V - F0 * (K @ Sh (+ K @ Sl))     K@S lo term only when prec.ks == "split"
    U  = Ah Xh (+ Al Xh) (+ Ah Xl)        per prec.ag / prec.x
    Uh (+ Ul) = split(U)                 -> Uh (+ Ul)    v_new for the output kernel
    S  = F3 * S + K^T @ (rd(F2 U) (+ lo)) per prec.upd

All products accumulate in fp32 (wgmma); nothing is TF32.  With the all-"bf16" preset this is 4
wgmma per chunk (K S, Ag X, update) like FLA's ``chunk_gated_delta_rule_fwd_h``, and 48 KB written per chunk and head.
The CP scan is the register-operand form's (``state_registers.py``).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.lo8 import LO8, lo8_code
from kernels.common.prologue import (dynamic_dims, lo_shape, load_state_kt, seq_span, split_into, split_products,
                                     store_state_kt)

BT = 64
THREADS = 128


def build_state_smem(DK: int, DV: int, BV: int, dtype: str, prec, num_stages: int = 2, ctas_per_sm: int = 1,
                     swizzle_sl: bool = False, lo8: bool = False):
    """TileLang prim_func of ``gdn_state_smem``.

    Arguments:
      k        [Ttot, H, DK]          dtype
      v        [Ttot, HV, DV]         dtype
      Ah, Al   [HV, NCg, 64, 64]      dtype   (Al read only when prec.ag == "split")
      F        [HV, NCg, 8, 64]       fp32
      cu_seqlens    [N + 1]  int32    token boundaries of the sequences (segments for CP)
      chunk_offsets [N + 1]  int32    their first global chunk ids
      h0       [Nh, HV, DK, DV]       fp32 (read as [.., DV, DK] when v_first)
      Sch, Scl [HV, NCg, DK, DV]      dtype   (outputs; Scl only when prec.s == "split"; fp8 e4m3 with lo8)
      Uh, Ul   [HV, NCg, 64, DV]      dtype   (outputs; Ul only when prec.u == "split")
      ht       [Nt, HV, DK, DV]       fp32    (written as [.., DV, DK] when v_first)
      use_h0, store_ht, v_first       int32

    ``ctas_per_sm = 2`` asks for two resident CTAs per SM (``__launch_bounds__(256, 2)``, at most 128
    registers a thread, no ``setmaxnreg`` hand-over from the producer warps): two independent chunk chains
    interleave on each SM, hiding the latency of the per-chunk chain of small dependent products.  Fits only
    for BV <= 32 (shared memory: 82 / 98 KiB per CTA at BV 16 / 32).

    ``lo8`` (the backward recompute's form, with ``prec.s == "split"``): ``Scl`` is fp8 e4m3, S's lo term under its
    hi term's exponent (``kernels.common.lo8``), computed from the fp32 state into its own staging tile.

    ``swizzle_sl`` (the backward recompute's form): the S lo staging tile ``sl_s`` in a swizzled
    layout when it is only stored (precision ``s`` split, ``ks`` not): row-major, its fragment stores are 4-way
    bank conflicts at BV 32 (8-way at 64, 2-way at 16; 16 a chunk and thread), swizzled none, by the degrees
    ``kernels.common.bank_conflicts`` works out from the generated CUDA; the same values stored.

    The products of one split (``K Sh (+ K Sl)``, ``Ah Xh + Al Xh + Ah Xl``, the update's hi + lo) are issued as
    one group of wgmma with one wait, instead of a wait after each: the same instructions in the same order on
    the same accumulator, so bitwise the same result with two to three fewer waits on the per-chunk chain.
    Every product but the last is ``T.wgmma_gemm`` (no wait); the last is a ``T.gemm``, whose
    wait covers the group (``kernels.common.prologue.split_products``), and it reads every pipelined buffer of its
    group, so TileLang hands those buffers back to the TMA producer only after the wait (Ah and Al then share one
    buffer, ``a_s``).
    """
    assert DK in (64, 128) and DV == DK
    assert DV % BV == 0 and BV in (16, 32, 64, 128)
    assert dtype in ("bfloat16", "float16")
    assert ctas_per_sm in (1, 2) and (ctas_per_sm == 1 or BV <= 32)
    f32 = "float32"
    NV = DV // BV
    ks_sp, s_sp, x_sp, ag_sp, u_sp, upd_sp = prec.state_splits()
    assert not (lo8 and not s_sp), "lo8 stores S's lo term: a form of the split S tables"
    sl_need = ks_sp or (s_sp and not lo8)

    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")

    @T.prim_func
    def gdn_state_smem(
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        Ah: T.Tensor((HV, NCg, BT, BT), dtype),
        Al: T.Tensor((HV, NCg, BT, BT), dtype),
        F: T.Tensor((HV, NCg, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor((Nh, HV, DK, DV), f32),
        Sch: T.Tensor((HV, NCg, DK, DV), dtype),
        Scl: T.Tensor((HV, NCg, DK, DV), LO8 if lo8 else dtype),
        Uh: T.Tensor((HV, NCg, BT, DV), dtype),
        Ul: T.Tensor((HV, NCg, BT, DV), dtype),
        ht: T.Tensor((Nt, HV, DK, DV), f32),
        use_h0: T.int32,
        store_ht: T.int32,
        v_first: T.int32,
    ):
        with T.Kernel(NV, HV, N, threads=THREADS) as (bv, hv, n):
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.no_set_max_nreg()
            h = hv // (HV // H)
            bos, eos, c0, nchunks = seq_span(cu_seqlens, chunk_offsets, n)
            v0 = bv * BV

            k_s = T.alloc_shared((BT, DK), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            # with Al, Ah and Al in one pipelined buffer a_s[2, BT, BT] (see the docstring); its planes are written
            # inline as a_s[i, :, :] (a slice bound to a name in the kernel body becomes a let-bound load of the whole
            # buffer)
            if ag_sp:
                a_s = T.alloc_shared((2, BT, BT), dtype)
            else:
                ah_s = T.alloc_shared((BT, BT), dtype)
            f_s = T.alloc_shared((4, BT), f32)
            sh_s = T.alloc_shared((DK, BV), dtype)
            sl_s = T.alloc_shared(lo_shape((DK, BV), sl_need), dtype)
            sl8_s = T.alloc_shared(lo_shape((DK, BV), lo8), LO8)
            xh_s = T.alloc_shared((BT, BV), dtype)
            xl_s = T.alloc_shared(lo_shape((BT, BV), x_sp or upd_sp), dtype)
            uh_s = T.alloc_shared((BT, BV), dtype)
            ul_s = T.alloc_shared(lo_shape((BT, BV), u_sp), dtype)

            s_f = T.alloc_fragment((DK, BV), f32)
            ks_f = T.alloc_fragment((BT, BV), f32)
            u_f = T.alloc_fragment((BT, BV), f32)
            # v and U are no wgmma operands, so TileLang would give them a plain row-major layout, in which the
            # accumulator fragment's reads (v) and stores (U) hit the same banks from 4 rows at once (BV 32: 64 B
            # rows); a swizzled layout (the TMA load of v writes it swizzled) has no conflicts
            swz = {v_s: make_swizzled_layout(v_s)}
            if swizzle_sl and sl_need and not ks_sp:
                # S lo only stored (no K @ Sl wgmma lays it out), so row-major: each bf16x2 store from the fragment
                # is a 4-way bank conflict at BV 32; swizzled like sh_s, none (kernels.common.bank_conflicts)
                swz[sl_s] = make_swizzled_layout(sl_s)
            if lo8 and BV >= 32:
                # the fp8 S lo tile: row-major, its byte stores from the fragment are 2-way (BV 32) and 4-way (64) bank
                # conflicts; swizzled, none
                swz[sl8_s] = make_swizzled_layout(sl8_s)
            swz[uh_s] = make_swizzled_layout(uh_s)
            if u_sp:
                swz[ul_s] = make_swizzled_layout(ul_s)
            T.annotate_layout(swz)

            if use_h0 != 0:
                load_state_kt(h0, s_f, v_first, n, hv, v0, BV, DK)
            else:
                T.clear(s_f)

            for ic in T.Pipelined(nchunks, num_stages=num_stages):
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(v[t0:t0 + BT, hv, v0:v0 + BV], v_s)
                if ag_sp:
                    T.copy(Ah[hv, c, 0:BT, 0:BT], a_s[0, :, :])
                    T.copy(Al[hv, c, 0:BT, 0:BT], a_s[1, :, :])
                else:
                    T.copy(Ah[hv, c, 0:BT, 0:BT], ah_s)
                T.copy(F[hv, c, 0:4, 0:BT], f_s)

                split_into(s_f, sh_s, sl_s, sl_need)
                if lo8:
                    for i, j in T.Parallel(DK, BV):
                        sl8_s[i, j] = lo8_code(s_f[i, j], dtype)
                T.copy(sh_s, Sch[hv, c, 0:DK, v0:v0 + BV], disable_tma=True)
                if lo8:
                    T.copy(sl8_s, Scl[hv, c, 0:DK, v0:v0 + BV], disable_tma=True)
                elif s_sp:
                    T.copy(sl_s, Scl[hv, c, 0:DK, v0:v0 + BV], disable_tma=True)

                # X = V - F0 * (K @ S)
                split_products(k_s, None, sh_s, sl_s, ks_f, False, ks_sp, True, False)
                for i, j in T.Parallel(BT, BV):
                    ks_f[i, j] = T.cast(v_s[i, j], f32) - f_s[0, i] * ks_f[i, j]
                split_into(ks_f, xh_s, xl_s, x_sp)

                # U = Ag @ X
                if ag_sp:
                    split_products(a_s[0, :, :], a_s[1, :, :], xh_s, xl_s, u_f, True, x_sp, True, False)
                else:
                    split_products(ah_s, None, xh_s, xl_s, u_f, False, x_sp, True, False)
                split_into(u_f, uh_s, ul_s, u_sp)
                T.copy(uh_s, Uh[hv, c, 0:BT, v0:v0 + BV], disable_tma=True)
                if u_sp:
                    T.copy(ul_s, Ul[hv, c, 0:BT, v0:v0 + BV], disable_tma=True)

                # S = F3 * S + K^T @ (F2 * U)
                for i, j in T.Parallel(BT, BV):
                    u_f[i, j] = f_s[2, i] * u_f[i, j]
                split_into(u_f, xh_s, xl_s, upd_sp)
                for i, j in T.Parallel(DK, BV):
                    s_f[i, j] = s_f[i, j] * f_s[3, 0]
                split_products(k_s, None, xh_s, xl_s, s_f, False, upd_sp, False, True)

            if store_ht != 0:
                store_state_kt(s_f, ht, v_first, n, hv, v0, BV, DK)

    return gdn_state_smem
