"""``gdn_bwd_dh``: the reverse sequential pass over the chunks of each sequence.

One warpgroup owns ``BV = 64`` value columns of one value head and keeps the state gradient
transposed, ``dS^T [BV, DK]`` fp32, in registers for the whole sequence (value-first like
``forward/state_registers.py``; every A operand is a register fragment, wgmma_rs).  Per chunk, last to first::

    dSa, dSl = split(dS^T)                                  -> dSh, dSl [HV, NC, DV, DK]  (dS' of the chunk)
    dU^T = dUloc^T + (dSa K^T + dSl K^T) diag(F2)           (2 wgmma)
    dY^T = dU^T Tinv  as  dUa Th + dUl Th + dUa Tl          (3 wgmma)  -> dYh, dYl [HV, NC, DV, 64]
    dv   = rd(beta dY)                                      (direct stores, input dtype)
    dS^T = e^GL dS^T + split(dO^T diag(F1)) Q - split((beta dY)^T diag(F0)) K      (2 + 2 wgmma)

That is every operand split (9 wgmma a chunk).  On the forward's saved tables, which hold Tinv's hi term alone,
``tinv_lo=False`` drops ``dUa Tl`` (8 a chunk).  ``single`` takes Tinv, dU and F0 dX as one input-dtype term:
``dY^T = rd(dU^T) Th`` (1 wgmma) and ``- rd((beta dY)^T diag(F0)) K`` (1 wgmma), 6 a chunk.  Where Tinv's lo term
is not read, Tl is neither loaded nor read.

(F0 = e^G rk, F1 = scale e^G rq, F2 = e^(GL - G) rk: rows of the gate table ``Fb``.)  Rows past the end of
a sequence have zero F rows and zero dUloc, so the next sequence's tokens that the tile loads add nothing.
At the end ``dh0`` (the gradient of the initial state) is stored in the caller's layout.
The chunk loads (q, k, dO, Th, Tl, Fb, dUloc) go through a 2-stage ``T.Pipelined`` (TMA + mbarriers).
"""

import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from kernels.common.lo8 import LO8, lo8_code_of
from kernels.common.prologue import dynamic_dims, load_state_vt, seq_span, split_into, store_state_vt
from kernels.forward.cp_warm import WARM_CHUNKS, backward_macros

BT = 64
FR = T.GemmWarpPolicy.FullRow
warm_after, _ = backward_macros()


@T.macro
def store_split(hi, lo, hi_s, lo_s, dst_hi, dst_lo, keep=True):
    """Store a two-term split (``hi``, ``lo`` register fragments, input dtype) into the global regions ``dst_hi``,
    ``dst_lo`` through the shared tiles ``hi_s``, ``lo_s`` (stmatrix, then a TMA store each), issued without waiting
    for them (``T.tma_copy``); the caller waits (``T.tma_store_wait``) before ``hi_s`` or ``lo_s`` is written again
    and before the kernel ends.  An fp8 ``lo_s`` takes the codes of ``lo`` under ``hi`` (``kernels.common.lo8``).
    ``keep``: a condition on the TMA stores alone (the tiles are written either way: a branch around the whole
    store costs the register kernel its registers); True (a build-time constant): no branch."""
    T.copy(hi, hi_s)
    if lo_s.dtype == LO8:
        for i, j in T.Parallel(lo_s.shape[0], lo_s.shape[1]):
            lo_s[i, j] = lo8_code_of(lo[i, j], hi[i, j], hi.dtype)
    else:
        T.copy(lo, lo_s)
    if keep:
        T.tma_copy(hi_s, dst_hi)
        T.tma_copy(lo_s, dst_lo)


def build_bwd_dh(DK: int, DV: int, dtype: str, BV: int = 64, num_stages: int = 2, single: bool = False,
                 tinv_lo: bool = True, lo8: bool = False, warm: bool = False):
    """``single``: Tinv, dU and F0 dX as one input-dtype term each (dS' and F1 dO keep their lo products, the dY
    tables stay split): 6 instead of 9 wgmma a chunk (the emulation's ``dh(single=True)``).  ``tinv_lo=False``
    (split dU and F0 dX, Tinv's hi term alone: the forward's saved tables): 8 a chunk, Tl not read (the
    emulation's ``tinv_hi_only``).  The segmented pass (``dh_segmented``) runs every operand split.

    ``lo8``: the dS' table's lo term ``dSl`` is fp8 e4m3 under its hi term's exponent (``kernels.common.lo8``,
    computed from the fp32 state gradient); the recurrence itself keeps its input-dtype lo term.

    The split dS' and dY tables leave through shared tiles (one copy from the fragment, then one TMA store per
    tile); each chunk's stores are waited for at the next chunk's first store.  dv is stored element by element
    from the accumulator.

    ``warm`` (``gdn_bwd_dh_warm``, the segmented pass in one launch): the N "sequences" are CP segments of the
    call's sequences and ``chunk_offsets`` is ``[4 N + 1]`` (``dh_segmented.warm_table``: ``cp_warm``'s table, then
    each segment's sequence).  A segment starts ``w`` chunks after its end from a
    zero state gradient (``cp_warm``'s ``warm_after`` on prep's bounds ``Lb [HV, NCg]``; nothing is stored for
    those chunks), or, where that reaches its sequence's end, from the sequence's dht (exact); dht and dh0 are
    indexed by sequence, dh0 stored by each sequence's first segment.

    Arguments:
      q, k        [Ttot, H, DK]     dtype
      do          [Ttot, HV, DV]    dtype
      Th, Tl      [HV, NCg, 64, 64] dtype
      Fb          [HV, NCg, 8, 64]  fp32
      dUl         [HV, NCg, DV, 64] fp32    (dUloc^T from gdn_bwd_prep)
      cu_seqlens    [N + 1] int32;  chunk_offsets [N + 1] int32 ([4 N + 1] with ``warm``)
      dht         [Nh, HV, DK, DV]  fp32 (read as [.., DV, DK] when v_first)
      dSh, dSl    [HV, NCg, DV, DK] dtype   (out, value-first; dSl fp8 e4m3 with lo8)
      dYh, dYl    [HV, NCg, DV, 64] dtype   (out, value-first)
      dv          [Ttot, HV, DV]    dtype   (out)
      dh0         [Nt, HV, DK, DV]  fp32    (out; [.., DV, DK] when v_first)
      Lb          [HV, NCg]         fp32    (each chunk's log2 norm bound; read by ``warm`` alone)
      use_dht, store_dh0, v_first int32
    """
    assert DK in (64, 128) and DV == DK and BV == 64 and DV % BV == 0
    assert dtype in ("bfloat16", "float16")
    assert not (single and not tinv_lo), "single reads no Tinv lo term: tinv_lo is a form of the split dh"
    olo = not single               # the lo products of dU, F0 dX
    tlo = olo and tinv_lo          # Tinv's lo term loaded and read
    f32 = "float32"
    NV = DV // BV

    @T.macro
    def split_to(x_f, hi, lo_, with_lo):
        """hi = rd(x), and lo = rd(x - hi) where ``with_lo`` (a build-time bool)."""
        if with_lo:
            for i, t in T.Parallel(BV, BT):
                hi[i, t] = T.cast(x_f[i, t], dtype)
                lo_[i, t] = T.cast(x_f[i, t] - T.cast(T.cast(x_f[i, t], dtype), f32), dtype)
        else:
            for i, t in T.Parallel(BV, BT):
                hi[i, t] = T.cast(x_f[i, t], dtype)
    @T.macro
    def store_ds(dsa, dsl, dsa_s, dsl_s, dSh, dSl, hv, c, v0, keep):
        """The chunk's dS' split into the tables (where ``keep``), once the previous chunk's four table stores have
        read their tiles."""
        T.tma_store_wait()
        store_split(dsa, dsl, dsa_s, dsl_s, dSh[hv, c, v0:v0 + BV, 0:DK], dSl[hv, c, v0:v0 + BV, 0:DK], keep)

    Ttot, H, HV, N, NCg, Nh, Nt = dynamic_dims("Ttot H HV N NCg Nh Nt")
    n_co = 4 * N + 1 if warm else N + 1

    @T.macro
    def body(q, k, do, Th, Tl, Fb, dUl, cu_seqlens, chunk_offsets, dht, dSh, dSl, dYh, dYl, dv, dh0, use_dht,
             store_dh0, v_first, Lb):
        with T.Kernel(NV, HV, N, threads=128) as (bv, hv, n):
            h = hv // (HV // H)
            bos, eos, c0, nchunks = seq_span(cu_seqlens, chunk_offsets, n)
            v0 = bv * BV
            sq = chunk_offsets[3 * N + 1 + n] if warm else n          # the sequence: dht's and dh0's index
            if warm:
                w = T.alloc_local((1,), "int32")       # warm-up chunks after the segment
                wacc = T.alloc_local((1,), f32)
                wl = T.alloc_shared((WARM_CHUNKS,), f32)
                warm_after(Lb, hv, chunk_offsets[n + 1], chunk_offsets[chunk_offsets[2 * N + 1 + n] + 1], w, wacc, wl)
                # exact (from the sequence's dht) where the warm-up reaches the sequence's end
                from_dht = T.if_then_else(c0 + nchunks + w[0] == chunk_offsets[chunk_offsets[2 * N + 1 + n] + 1],
                                          use_dht, 0)
            else:
                from_dht = use_dht

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            do_s = T.alloc_shared((BT, BV), dtype)
            th_s = T.alloc_shared((BT, BT), dtype)
            # Tl only where read: an unread tile may share another tile's memory (TileLang's allocator merges
            # buffers by their reads), and its TMA load would overwrite that tile in flight
            tl_s = T.alloc_shared((BT, BT), dtype) if tlo else None
            f_s = T.alloc_shared((8, BT), f32)
            dul_s = T.alloc_shared((BV, BT), f32)
            # 128-byte swizzles: dUloc^T is read in the wgmma accumulator layout (rows 64 floats apart) and dO
            # transposed, element by element; unswizzled, 4-way bank conflicts on each of those loads; swizzled, at
            # most 2-way
            T.annotate_layout({dul_s: make_full_bank_swizzled_layout(dul_s),
                               do_s: make_full_bank_swizzled_layout(do_s)})
            dsa_s = T.alloc_shared((BV, DK), dtype)
            dsl_s = T.alloc_shared((BV, DK), LO8 if lo8 else dtype)
            dya_s = T.alloc_shared((BV, BT), dtype)
            dyl_s = T.alloc_shared((BV, BT), dtype)

            ds_f = T.alloc_fragment((BV, DK), f32)
            dsa = T.alloc_fragment((BV, DK), dtype)
            dsl = T.alloc_fragment((BV, DK), dtype)
            kd_f = T.alloc_fragment((BV, BT), f32)
            dy_f = T.alloc_fragment((BV, BT), f32)
            xa = T.alloc_fragment((BV, BT), dtype)
            xl = T.alloc_fragment((BV, BT), dtype)

            if from_dht != 0:
                load_state_vt(dht, ds_f, v_first, sq, hv, v0, BV, DK)
            else:
                T.clear(ds_f)

            if warm:
                # (a variable: a loop count read from a local array is renamed by the pipeline's warp
                # specialisation, which then fails)
                ntot = T.alloc_var("int32")
                ntot = nchunks + w[0]
            else:
                ntot = nchunks
            for icr in T.Pipelined(ntot, num_stages=num_stages):
                ic = ntot - 1 - icr
                t0 = bos + ic * BT
                c = c0 + ic
                T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
                T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
                T.copy(do[t0:t0 + BT, hv, v0:v0 + BV], do_s)
                T.copy(Th[hv, c, 0:BT, 0:BT], th_s)
                if tlo:
                    T.copy(Tl[hv, c, 0:BT, 0:BT], tl_s)
                T.copy(Fb[hv, c, 0:8, 0:BT], f_s)
                T.copy(dUl[hv, c, v0:v0 + BV, 0:BT], dul_s)

                # the gradient of this chunk's end state, split, stored for the parallel kernels
                split_into(ds_f, dsa, dsl, True)
                # (of a warm-up chunk, whose tokens lie past the segment's end: nothing stored)
                keep = t0 < eos if warm else True
                store_ds(dsa, dsl, dsa_s, dsl_s, dSh, dSl, hv, c, v0, keep)

                # dU^T = dUloc^T + (dS^T K^T) diag(F2)
                T.gemm(dsa, k_s, kd_f, transpose_B=True, clear_accum=True, policy=FR)
                T.gemm(dsl, k_s, kd_f, transpose_B=True, policy=FR)
                for i, t in T.Parallel(BV, BT):
                    kd_f[i, t] = T.cast(dul_s[i, t], f32) + f_s[2, t] * kd_f[i, t]
                split_to(kd_f, xa, xl, olo)

                # dY^T = dU^T Tinv
                T.gemm(xa, th_s, dy_f, clear_accum=True, policy=FR)
                if olo:
                    T.gemm(xl, th_s, dy_f, policy=FR)
                if tlo:
                    T.gemm(xa, tl_s, dy_f, policy=FR)
                split_to(dy_f, xa, xl, True)            # the dY tables: split in either form
                store_split(xa, xl, dya_s, dyl_s, dYh[hv, c, v0:v0 + BV, 0:BT], dYl[hv, c, v0:v0 + BV, 0:BT], keep)
                # dX = F7 dY in place (the tables above took dY), formed before the stores' branch: no gate-table
                # load under a branch per element
                for i, t in T.Parallel(BV, BT):
                    dy_f[i, t] = f_s[7, t] * dy_f[i, t]
                for i, t in T.Parallel(BV, BT):
                    if t0 + t < eos:
                        dv[t0 + t, hv, v0 + i] = T.cast(dy_f[i, t], dtype)

                # dS^T = e^GL dS^T + (dO^T diag(F1)) Q - ((beta dY)^T diag(F0)) K
                for i, d in T.Parallel(BV, DK):
                    ds_f[i, d] = ds_f[i, d] * f_s[3, 0]
                for i, t in T.Parallel(BV, BT):
                    kd_f[i, t] = T.cast(do_s[t, i], f32) * f_s[1, t]
                split_to(kd_f, xa, xl, True)            # split in either form (dh0's precision)
                T.gemm(xa, q_s, ds_f, policy=FR)
                T.gemm(xl, q_s, ds_f, policy=FR)
                for i, t in T.Parallel(BV, BT):
                    kd_f[i, t] = -dy_f[i, t] * f_s[0, t]
                split_to(kd_f, xa, xl, olo)
                T.gemm(xa, k_s, ds_f, policy=FR)
                if olo:
                    T.gemm(xl, k_s, ds_f, policy=FR)

            T.tma_store_wait()
            if warm:
                # each sequence's first segment (formed here, not held in registers over the loop)
                first = T.if_then_else(chunk_offsets[N + 1 + n] == n, 1, 0)
                if store_dh0 != 0 and first != 0:
                    store_state_vt(ds_f, dh0, v_first, sq, hv, v0, BV, DK)
            elif store_dh0 != 0:
                store_state_vt(ds_f, dh0, v_first, n, hv, v0, BV, DK)

    @T.prim_func
    def gdn_bwd_dh(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Th: T.Tensor((HV, NCg, BT, BT), dtype),
        Tl: T.Tensor((HV, NCg, BT, BT), dtype),
        Fb: T.Tensor((HV, NCg, 8, BT), f32),
        dUl: T.Tensor((HV, NCg, DV, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((n_co,), "int32"),
        dht: T.Tensor((Nh, HV, DK, DV), f32),
        dSh: T.Tensor((HV, NCg, DV, DK), dtype),
        dSl: T.Tensor((HV, NCg, DV, DK), LO8 if lo8 else dtype),
        dYh: T.Tensor((HV, NCg, DV, BT), dtype),
        dYl: T.Tensor((HV, NCg, DV, BT), dtype),
        dv: T.Tensor((Ttot, HV, DV), dtype),
        dh0: T.Tensor((Nt, HV, DK, DV), f32),
        Lb: T.Tensor((HV, NCg), f32),
        use_dht: T.int32,
        store_dh0: T.int32,
        v_first: T.int32,
    ):
        body(q, k, do, Th, Tl, Fb, dUl, cu_seqlens, chunk_offsets, dht, dSh, dSl, dYh, dYl, dv, dh0, use_dht,
             store_dh0, v_first, Lb if warm else None)

    # the warm form under its own kernel name
    return gdn_bwd_dh.with_attr("global_symbol", "gdn_bwd_dh_warm") if warm else gdn_bwd_dh
