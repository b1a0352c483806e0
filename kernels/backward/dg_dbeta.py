"""``gdn_bwd_dg_dbeta``: dg and dbeta of every token from the per-chunk row terms, one CTA of 64 threads (one per
chunk row) per (chunk, value head): the dg / dbeta part of ``finish.finish`` in one kernel instead of about 25 torch
launches on [HV, NC, 64] tensors.

Row t of chunk c, value head hv (``vm = [t < nv]``, the gate table ``Fb`` as in ``finish``'s docstring; the row dots
by the halves the dqk kernel stores, added here in the order half 0 + half 1):

    own_t  = (e^G_t F5_t qz_t - F7_t F0_t kw_t) vm          upd_t = F2_t kr_t vm
    dg_t   = sum_{u >= t} own_u + sum_{u < t} upd_u + F3_0 sum_d sd_d + rect_t
    dbeta_t = (-F0_t kw_t + yv_t) vm + db2_t

the same terms as ``finish.finish`` (so the same "no two O(1) terms cancel" grouping); the within-chunk sums are
serial in each thread (the reverse sum from u = 63 down to t, the prefix from u = 0 up), the S o dS' total in the
same order in every thread.  Only the summation order differs from the torch form (fp32 either way).
"""

import tilelang.language as T

from kernels.common.prologue import chunk_span, dynamic_dims
from kernels.forward.cumsum import LOG2E

from .dqk_terms import BT


def build_dg_dbeta(DV: int):
    """Arguments:
      Fb                  [HV, NC, 8, 64]  fp32   (gdn_bwd_prep's gate table)
      qz, kw, kr, yv, db2 [2, HV, NC, 64]  fp32   (gdn_bwd_dqk's row dots, two halves)
      sd                  [2, HV, NC, DV]  fp32   (the S o dS' row dots, two halves of the key dim)
      rect                [HV, NC, 64]     fp32   (the dg rectangle sums)
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32
      dg, db              [Ttot, HV]       fp32   (out: every token row)
    """
    assert DV % BT == 0, DV
    f32 = "float32"
    Ttot, HV, N, NC = dynamic_dims("Ttot HV N NC")

    @T.prim_func
    def gdn_bwd_dg_dbeta(
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        qz: T.Tensor((2, HV, NC, BT), f32),
        kw: T.Tensor((2, HV, NC, BT), f32),
        kr: T.Tensor((2, HV, NC, BT), f32),
        yv: T.Tensor((2, HV, NC, BT), f32),
        db2: T.Tensor((2, HV, NC, BT), f32),
        sd: T.Tensor((2, HV, NC, DV), f32),
        rect: T.Tensor((HV, NC, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dg: T.Tensor((Ttot, HV), f32),
        db: T.Tensor((Ttot, HV), f32),
    ):
        with T.Kernel(NC, HV, threads=BT) as (c, hv):
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)
            t = T.get_thread_binding()
            own = T.alloc_shared((BT,), f32)
            upd = T.alloc_shared((BT,), f32)
            sdp = T.alloc_shared((BT,), f32)
            acc = T.alloc_local((3,), f32)
            kwt = T.alloc_local((1,), f32)
            kwt[0] = kw[0, hv, c, t] + kw[1, hv, c, t]
            if t < nv:
                own[t] = (T.exp2(Fb[hv, c, 4, t] * LOG2E) * Fb[hv, c, 5, t] * (qz[0, hv, c, t] + qz[1, hv, c, t])
                          - Fb[hv, c, 7, t] * Fb[hv, c, 0, t] * kwt[0])
                upd[t] = Fb[hv, c, 2, t] * (kr[0, hv, c, t] + kr[1, hv, c, t])
            else:
                own[t] = T.float32(0)
                upd[t] = T.float32(0)
            acc[2] = T.float32(0)
            for h in T.serial(2):
                for j in T.serial(DV // BT):
                    acc[2] = acc[2] + sd[h, hv, c, j * BT + t]
            sdp[t] = acc[2]
            T.sync_threads()
            acc[0] = T.float32(0)
            for i in T.serial(BT):
                if BT - 1 - i >= t:
                    acc[0] = acc[0] + own[BT - 1 - i]
            acc[1] = T.float32(0)
            for u in T.serial(BT):
                if u < t:
                    acc[1] = acc[1] + upd[u]
            acc[2] = T.float32(0)
            for u in T.serial(BT):
                acc[2] = acc[2] + sdp[u]
            if t < nv:
                dg[t0 + t, hv] = acc[0] + acc[1] + Fb[hv, c, 3, 0] * acc[2] + rect[hv, c, t]
                db[t0 + t, hv] = (-Fb[hv, c, 0, t] * kwt[0] + (yv[0, hv, c, t] + yv[1, hv, c, t])) + (
                    db2[0, hv, c, t] + db2[1, hv, c, t])

    return gdn_bwd_dg_dbeta
