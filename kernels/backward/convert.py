"""``gdn_bwd_convert``: the one-term backward's inputs (``BackwardPlan.one_term``) in one launch: v and dO times
their GVA groups' powers of two (``scales``), q, k, v, dO in the kernels' input dtype.

``q, k [Ttot, H, D]``, ``v, do [Ttot, HV, D]`` in ``src``, ``scales [2, HV]`` fp32 (row 0 dO's, row 1 v's) -> the
same shapes in ``dst``: ``rd(x s)`` (round to nearest even: exact for bf16 values within fp16's normal range, +-inf
past 65504, subnormal or 0 below 2^-14).  Where ``src == dst`` q and k are not copied (``q2, k2`` not written).
Grid (row block, value head): the CTA of value head ``hv`` converts its rows of v and dO, and those of q and k where
``hv < H``.
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

ROWS = 16         # token rows per CTA of 128 threads (16 elements a thread at D 128)


def build_convert(D: int, src: str, dst: str):
    """Arguments: q, k [Ttot, H, D], v, do [Ttot, HV, D] in ``src``, scales [2, HV] fp32; q2, k2, v2, do2 in
    ``dst`` (out)."""
    Ttot, H, HV = dynamic_dims("Ttot H HV")
    f32 = "float32"
    qk = src != dst

    @T.prim_func
    def gdn_bwd_convert(
        q: T.Tensor((Ttot, H, D), src),
        k: T.Tensor((Ttot, H, D), src),
        v: T.Tensor((Ttot, HV, D), src),
        do: T.Tensor((Ttot, HV, D), src),
        scales: T.Tensor((2, HV), f32),
        q2: T.Tensor((Ttot, H, D), dst),
        k2: T.Tensor((Ttot, H, D), dst),
        v2: T.Tensor((Ttot, HV, D), dst),
        do2: T.Tensor((Ttot, HV, D), dst),
    ):
        with T.Kernel(T.ceildiv(Ttot, ROWS), HV, threads=128) as (bt, hv):
            t0 = bt * ROWS
            for i, d in T.Parallel(ROWS, D):
                if t0 + i < Ttot:
                    v2[t0 + i, hv, d] = T.cast(T.cast(v[t0 + i, hv, d], f32) * scales[1, hv], dst)
                    do2[t0 + i, hv, d] = T.cast(T.cast(do[t0 + i, hv, d], f32) * scales[0, hv], dst)
            if qk:
                if hv < H:
                    for i, d in T.Parallel(ROWS, D):
                        if t0 + i < Ttot:
                            q2[t0 + i, hv, d] = T.cast(q[t0 + i, hv, d], dst)
                            k2[t0 + i, hv, d] = T.cast(k[t0 + i, hv, d], dst)

    return gdn_bwd_convert
