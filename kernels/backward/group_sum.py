"""``gdn_bwd_group_sum``: dq~ / dk~ of every value head summed over each GVA group (after ``gdn_bwd_dqk``).

``x [Ttot, HV, D]`` fp32 (one row per value head) -> ``y [Ttot, H, D]``, ``y[t, h] = sum_j x[t, h r + j]`` in the
order j = 0, 1, .., r - 1 (``r = HV / H``), in fp32, stored as the output dtype: the input dtype when it is the final
dq / dk (no L2 norm), fp32 when the host still chains the L2 norm.  The torch form (``common.group_sum`` and a cast)
reads the fp32 sums again to round them; here each element is read once and written once.

The scaled form (``gdn_bwd_group_sum_scaled``, the fused kernel's ``dq16``) reads ``x`` in fp16 under the GVA
group's powers of two and stores ``y[t, h] = (sum_j x[t, h r + j]) f[1, h r]`` (``f`` the one-term plan's factors
[2, HV]: a power of two, the same for the group's value heads); it runs for groups of one value head too.
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

ELEMENTS = 1024   # elements per CTA of 128 threads (8 a thread): 8 token rows at D 128, 16 at D 64


def build_group_sum(D: int, out_dtype: str, scaled: bool = False):
    """Arguments: x [Ttot, HV, D] fp32; y [Ttot, H, D] ``out_dtype`` (out).  ``scaled``: x fp16, then f [2, HV] fp32
    (the factors), then y."""
    f32 = "float32"
    ROWS = ELEMENTS // D          # token rows per CTA
    Ttot, H, HV = dynamic_dims("Ttot H HV")

    @T.macro
    def sum_rows(x, bt, h, a_f):
        """``a_f[i, :]`` = the fp32 sum of x's rows of the group of q/k head ``h`` (rows past Ttot: 0)."""
        r = HV // H
        for i, d in T.Parallel(ROWS, D):
            a_f[i, d] = T.if_then_else(bt * ROWS + i < Ttot, T.cast(x[bt * ROWS + i, h * r, d], f32), T.float32(0))
        for j in T.serial(r - 1):
            for i, d in T.Parallel(ROWS, D):
                a_f[i, d] = a_f[i, d] + T.if_then_else(bt * ROWS + i < Ttot,
                                                       T.cast(x[bt * ROWS + i, h * r + 1 + j, d], f32), T.float32(0))

    if scaled:
        @T.prim_func
        def gdn_bwd_group_sum_scaled(
            x: T.Tensor((Ttot, HV, D), "float16"),
            f: T.Tensor((2, HV), f32),
            y: T.Tensor((Ttot, H, D), out_dtype),
        ):
            with T.Kernel(T.ceildiv(Ttot, ROWS), H, threads=128) as (bt, h):
                a_f = T.alloc_fragment((ROWS, D), f32)
                fac = T.alloc_local((1,), f32)
                fac[0] = f[1, h * (HV // H)]
                sum_rows(x, bt, h, a_f)
                for i, d in T.Parallel(ROWS, D):
                    if bt * ROWS + i < Ttot:
                        y[bt * ROWS + i, h, d] = T.cast(a_f[i, d] * fac[0], out_dtype)

        return gdn_bwd_group_sum_scaled

    @T.prim_func
    def gdn_bwd_group_sum(
        x: T.Tensor((Ttot, HV, D), f32),
        y: T.Tensor((Ttot, H, D), out_dtype),
    ):
        with T.Kernel(T.ceildiv(Ttot, ROWS), H, threads=128) as (bt, h):
            a_f = T.alloc_fragment((ROWS, D), f32)
            sum_rows(x, bt, h, a_f)
            for i, d in T.Parallel(ROWS, D):
                if bt * ROWS + i < Ttot:
                    y[bt * ROWS + i, h, d] = T.cast(a_f[i, d], out_dtype)

    return gdn_bwd_group_sum
