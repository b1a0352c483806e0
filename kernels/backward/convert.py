"""``gdn_bwd_convert``: q, k, v, dO to the kernels' input dtype in one launch (bf16 inputs for the fp16 kernels of a
one-term backward, ``BackwardPlan.io_dtype``).

``q, k [Ttot, H, D]``, ``v, do [Ttot, HV, D]`` in ``src`` -> the same shapes in ``dst`` (round to nearest even:
exact for bf16 values within fp16's normal range, +-inf past 65504, subnormal or 0 below 2^-14).  Grid (row block,
value head): the CTA of value head ``hv`` converts its rows of v and dO, and those of q and k where ``hv < H``.
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

ROWS = 16         # token rows per CTA of 128 threads (16 elements a thread at D 128)


def build_convert(D: int, src: str, dst: str):
    """Arguments: q, k [Ttot, H, D], v, do [Ttot, HV, D] in ``src``; q2, k2, v2, do2 in ``dst`` (out)."""
    Ttot, H, HV = dynamic_dims("Ttot H HV")

    @T.prim_func
    def gdn_bwd_convert(
        q: T.Tensor((Ttot, H, D), src),
        k: T.Tensor((Ttot, H, D), src),
        v: T.Tensor((Ttot, HV, D), src),
        do: T.Tensor((Ttot, HV, D), src),
        q2: T.Tensor((Ttot, H, D), dst),
        k2: T.Tensor((Ttot, H, D), dst),
        v2: T.Tensor((Ttot, HV, D), dst),
        do2: T.Tensor((Ttot, HV, D), dst),
    ):
        with T.Kernel(T.ceildiv(Ttot, ROWS), HV, threads=128) as (bt, hv):
            t0 = bt * ROWS
            for i, d in T.Parallel(ROWS, D):
                if t0 + i < Ttot:
                    v2[t0 + i, hv, d] = T.cast(v[t0 + i, hv, d], dst)
                    do2[t0 + i, hv, d] = T.cast(do[t0 + i, hv, d], dst)
            if hv < H:
                for i, d in T.Parallel(ROWS, D):
                    if t0 + i < Ttot:
                        q2[t0 + i, hv, d] = T.cast(q[t0 + i, hv, d], dst)
                        k2[t0 + i, hv, d] = T.cast(k[t0 + i, hv, d], dst)

    return gdn_bwd_convert
