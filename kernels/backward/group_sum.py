"""``gdn_bwd_group_sum``: dq~ / dk~ of every value head summed over each GVA group (after ``gdn_bwd_dqk``).

``x [Ttot, HV, D]`` fp32 (one row per value head) -> ``y [Ttot, H, D]``, ``y[t, h] = sum_j x[t, h r + j]`` in the
order j = 0, 1, .., r - 1 (``r = HV / H``), in fp32, stored as the output dtype: the input dtype when it is the final
dq / dk (no L2 norm), fp32 when the host still chains the L2 norm.  The torch form (``common.group_sum`` and a cast)
reads the fp32 sums again to round them; here each element is read once and written once.
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

ELEMENTS = 1024   # elements per CTA of 128 threads (8 a thread): 8 token rows at D 128, 16 at D 64


def build_group_sum(D: int, out_dtype: str):
    """Arguments: x [Ttot, HV, D] fp32; y [Ttot, H, D] ``out_dtype`` (out)."""
    f32 = "float32"
    ROWS = ELEMENTS // D          # token rows per CTA
    Ttot, H, HV = dynamic_dims("Ttot H HV")

    @T.prim_func
    def gdn_bwd_group_sum(
        x: T.Tensor((Ttot, HV, D), f32),
        y: T.Tensor((Ttot, H, D), out_dtype),
    ):
        with T.Kernel(T.ceildiv(Ttot, ROWS), H, threads=128) as (bt, h):
            r = HV // H
            a_f = T.alloc_fragment((ROWS, D), f32)
            for i, d in T.Parallel(ROWS, D):
                a_f[i, d] = T.if_then_else(bt * ROWS + i < Ttot, x[bt * ROWS + i, h * r, d], T.float32(0))
            for j in T.serial(r - 1):
                for i, d in T.Parallel(ROWS, D):
                    a_f[i, d] = a_f[i, d] + T.if_then_else(bt * ROWS + i < Ttot, x[bt * ROWS + i, h * r + 1 + j, d],
                                                           T.float32(0))
            for i, d in T.Parallel(ROWS, D):
                if bt * ROWS + i < Ttot:
                    y[bt * ROWS + i, h, d] = T.cast(a_f[i, d], out_dtype)

    return gdn_bwd_group_sum
