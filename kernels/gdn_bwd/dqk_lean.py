"""Backward kernel 3 in its "lean" form (chunk tables read as hi terms alone; opt-in, ``api``'s ``_tables``).

The emulation's ``_tables="lean_sd"`` (``emulation.py``, studied by ``accuracy.py``): the inter products read only
the hi terms of S, U, dS', dY, so a chunk's tiles take 82 instead of 146 KB of shared memory and two pipeline
stages fit; the ``S o dS'`` row sums (a dg term, which needs hi + lo) and the ``dY . V`` row dots move to a
parallel kernel of their own.

``gdn_bwd_dqk_inter_lean`` - grid (``cpb``-chunk block, 64-column block of DK, value head), 128 consumer threads
plus TileLang's TMA producer: the chunks in a ``T.Pipelined`` loop (the tiles of chunk i+1 load while chunk i
computes, as the forward's "pipe" output kernel)::

    Z = dO Sh^T,  W = dYh Sh^T,  R = Uh dSh'^T          (1 wgmma each)
    then the inter kernel's epilogue (``dqk.inter_epilogue``): dq~, dk~ rows and the q.Z, k.W, k.R row dots

``gdn_bwd_state_dots`` - grid (chunk, value head), 128 threads::

    sd[i] = sum_d (Sh + Sl)[d, i] (dSh' + dSl')[i, d]      yv[t] = sum_i (dYh + dYl)[i, t] v[t, i]

Run on an H200 in sessions 5 and 7 (the stage tests of ``tests/test_kernels_bwd_gpu.py``; session 7 with the row dots
from shared-memory tiles, as the split inter kernel).
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims

from .dqk import inter_epilogue, split_dot_rows, v_dy_row_dots

BT = 64


def build_bwd_dqk_inter_lean(DK: int, DV: int, dtype: str, BK: int = 64, cpb: int = 8, num_stages: int = 2):
    """Arguments as ``dqk.build_bwd_dqk_inter`` without the lo tables, ``v``, ``sd`` and ``yv``:
      q, k [Ttot, H, DK], do [Ttot, HV, DV] dtype;  Sch [HV, NC, DK, DV], Uh [HV, NC, 64, DV],
      dSh [HV, NC, DV, DK], dYh [HV, NC, DV, 64] dtype;  Fb [HV, NC, 8, 64] fp32;
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32;  dqv, dkv [Ttot, HV, DK] fp32 (out);
      qz, kw, kr [NK, HV, NC, 64] fp32 (out);  scale fp32
    """
    assert DK in (64, 128) and DV in (64, 128) and DK % BK == 0 and cpb >= 1
    f32 = "float32"
    NK = DK // BK
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")

    @T.prim_func
    def gdn_bwd_dqk_inter_lean(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        dSh: T.Tensor((HV, NC, DV, DK), dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dqv: T.Tensor((Ttot, HV, DK), f32),
        dkv: T.Tensor((Ttot, HV, DK), f32),
        qz: T.Tensor((NK, HV, NC, BT), f32),
        kw: T.Tensor((NK, HV, NC, BT), f32),
        kr: T.Tensor((NK, HV, NC, BT), f32),
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(NC, cpb), NK, HV, threads=128) as (cb, kb, hv):
            h = hv // (HV // H)
            k0 = kb * BK

            do_s = T.alloc_shared((BT, DV), dtype)
            sh_s = T.alloc_shared((BK, DV), dtype)
            dsh_s = T.alloc_shared((DV, BK), dtype)
            uh_s = T.alloc_shared((BT, DV), dtype)
            dyh_s = T.alloc_shared((DV, BT), dtype)
            f_s = T.alloc_shared((8, BT), f32)
            qd_s = T.alloc_shared((BT, BK), dtype)
            kd_s = T.alloc_shared((BT, BK), dtype)

            z_f = T.alloc_fragment((BT, BK), f32)
            w_f = T.alloc_fragment((BT, BK), f32)
            r_f = T.alloc_fragment((BT, BK), f32)
            tmp = T.alloc_fragment((BT, BK), f32)
            rs = T.alloc_fragment((BT,), f32)

            for it in T.Pipelined(cpb, num_stages=num_stages):
                c = T.min(cb * cpb + it, NC - 1)      # past the last chunk: chunk NC - 1 again
                eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
                T.copy(do[t0:t0 + BT, hv, 0:DV], do_s)
                T.copy(Sch[hv, c, k0:k0 + BK, 0:DV], sh_s)
                T.copy(dSh[hv, c, 0:DV, k0:k0 + BK], dsh_s)
                T.copy(Uh[hv, c, 0:BT, 0:DV], uh_s)
                T.copy(dYh[hv, c, 0:DV, 0:BT], dyh_s)
                T.copy(Fb[hv, c, 0:8, 0:BT], f_s)
                T.copy(q[t0:t0 + BT, h, k0:k0 + BK], qd_s)
                T.copy(k[t0:t0 + BT, h, k0:k0 + BK], kd_s)

                T.gemm(do_s, sh_s, z_f, transpose_B=True, clear_accum=True)
                T.gemm(dyh_s, sh_s, w_f, transpose_A=True, transpose_B=True, clear_accum=True)
                T.gemm(uh_s, dsh_s, r_f, clear_accum=True)

                # rows past the sequence's end store nothing; a repeated chunk (past NC - 1) stores the same
                # values again, from this CTA, after its first pass (every output of the epilogue, the row dots
                # included, is a plain store of a value that depends on the chunk alone)
                nv = T.min(eos - t0, BT)
                inter_epilogue(qd_s, kd_s, f_s, z_f, w_f, r_f, tmp, rs, dqv, dkv, qz, kw, kr, t0, nv, hv, c, kb, k0,
                               scale)

    return gdn_bwd_dqk_inter_lean


def build_bwd_state_dots(DK: int, DV: int, dtype: str, BK: int = 64):
    """Arguments:
      v [Ttot, HV, DV] dtype;  Sch, Scl [HV, NC, DK, DV], dSh, dSl [HV, NC, DV, DK], dYh, dYl [HV, NC, DV, 64]
      dtype;  cu_seqlens [N + 1], chunk_indices [NC, 2] int32;  sd [1, HV, NC, DV], yv [HV, NC, 64] fp32 (out)
    """
    assert DK in (64, 128) and DV in (64, 128) and DK % BK == 0
    f32 = "float32"
    Ttot, HV, N, NC = dynamic_dims("Ttot HV N NC")

    @T.prim_func
    def gdn_bwd_state_dots(
        v: T.Tensor((Ttot, HV, DV), dtype),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), dtype),
        dSh: T.Tensor((HV, NC, DV, DK), dtype),
        dSl: T.Tensor((HV, NC, DV, DK), dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        dYl: T.Tensor((HV, NC, DV, BT), dtype),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        sd: T.Tensor((1, HV, NC, DV), f32),
        yv: T.Tensor((HV, NC, BT), f32),
    ):
        with T.Kernel(NC, HV, threads=128) as (c, hv):
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)

            sh_s = T.alloc_shared((BK, DV), dtype)
            sl_s = T.alloc_shared((BK, DV), dtype)
            dsh_s = T.alloc_shared((DV, BK), dtype)
            dsl_s = T.alloc_shared((DV, BK), dtype)
            dyh_s = T.alloc_shared((DV, BT), dtype)
            dyl_s = T.alloc_shared((DV, BT), dtype)
            v_s = T.alloc_shared((BT, DV), dtype)
            acc = T.alloc_local((1,), f32)
            tx = T.get_thread_binding()
            ty = T.alloc_fragment((BT, DV), f32)
            ry = T.alloc_fragment((BT,), f32)

            acc[0] = T.float32(0)
            for kb in T.serial(DK // BK):
                T.copy(Sch[hv, c, kb * BK:(kb + 1) * BK, 0:DV], sh_s)
                T.copy(Scl[hv, c, kb * BK:(kb + 1) * BK, 0:DV], sl_s)
                T.copy(dSh[hv, c, 0:DV, kb * BK:(kb + 1) * BK], dsh_s)
                T.copy(dSl[hv, c, 0:DV, kb * BK:(kb + 1) * BK], dsl_s)
                if tx < DV:
                    split_dot_rows(sh_s, sl_s, dsh_s, dsl_s, acc, tx)
            if tx < DV:
                sd[0, hv, c, tx] = acc[0]

            T.copy(dYh[hv, c, 0:DV, 0:BT], dyh_s)
            T.copy(dYl[hv, c, 0:DV, 0:BT], dyl_s)
            T.copy(v[t0:t0 + BT, hv, 0:DV], v_s)
            v_dy_row_dots(v_s, dyh_s, dyl_s, ty, ry, nv, yv, hv, c)

    return gdn_bwd_state_dots
