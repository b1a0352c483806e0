"""The one-term backward's element-wise passes (``BackwardPlan.one_term``), one launch each:

* ``gdn_bwd_amax``: the largest magnitudes of dO and v per value head, as fp32 bits (``bits [2, HV]`` int32, row 0
  dO's, row 1 v's; zeroed by the caller, atomically maxed: ``|x|``'s bits order as its values, NaN above inf);
* ``gdn_bwd_convert``: each GVA group's exponents from ``bits`` (``scales.exponents_of_bits``; row 0 dO's and
  dht's, row 1 v's and h0's), v and dO times their groups' powers of two, q, k, v, dO in the kernels' input dtype:
  ``rd(x s)`` (round to nearest even: exact for bf16 values within fp16's normal range, +-inf past 65504, subnormal
  or 0 below 2^-14; inputs below 2^-126 are flushed to 0: fast math); where ``src == dst`` q and k are not copied
  (``q2, k2`` not written).  It also writes ``scales.scales_and_factors``: the powers of two it applied and the
  ``factors`` that undo them.

Prep's converting form (``prep.py``, the fused plan's) does ``gdn_bwd_convert``'s work per chunk with the same group
scales (``group_scales``, ``store_scales``).

``q, k [Ttot, H, D]``, ``v, do [Ttot, HV, D]``.  Grid (row block, value head): the CTA of value head ``hv`` takes its
rows of v and dO, and those of q and k where ``hv < H``.  The gradients are scaled back as dh_ws and dqk store them
(their one forms' ``factors``).
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

from .scales import EXP_MAX

ROWS = 16         # token rows per CTA of 128 threads (16 elements a thread at D 128)
AMAX_ROWS = 128   # token rows per CTA of gdn_bwd_amax (16 steps of 8 elements a thread at D 128)
THREADS = 128


def exponent(b):
    """``scales.exponents_of_bits`` of one maximum's bits ``b``: floor(log2 m) clamped, 0 for 0 or inf / NaN."""
    field = (b >> 23) & 255
    return T.if_then_else((b == 0) | (field == 255), 0, T.max(T.min(field - 127, EXP_MAX), -EXP_MAX))


def pow2(e):
    """``2^e`` fp32 from its exponent bits (e in [-126, 127])."""
    return T.reinterpret((e + 127) << 23, "float32")


@T.macro
def group_scales(bits, hv, G, m, e, s, h0):
    """Value head ``hv``'s GVA group (``G`` value heads): ``m`` its largest magnitudes' bits (dO's, v's) from
    ``bits``, ``e`` their exponents, ``s`` the powers of two ``2^-e`` applied (``h0`` the group's first value
    head; all local arrays of 2, 2, 2, 1)."""
    h0[0] = hv - hv % G
    m[0] = 0
    m[1] = 0
    for j in T.serial(G):
        m[0] = T.max(m[0], bits[0, h0[0] + j])
        m[1] = T.max(m[1], bits[1, h0[0] + j])
    e[0] = exponent(m[0])
    e[1] = exponent(m[1])
    s[0] = pow2(-e[0])
    s[1] = pow2(-e[1])


@T.macro
def store_scales(out, hv, e, s):
    """``out[:, hv]`` = ``scales.scales_and_factors``' column of value head ``hv`` from ``group_scales``' e, s."""
    out[0, hv] = s[0]
    out[1, hv] = s[1]
    out[2, hv] = pow2(e[0])
    out[3, hv] = pow2(T.max(T.min(e[0] + e[1], 127), -126))


def build_amax(D: int, src: str):
    """Arguments: v, do [Ttot, HV, D] in ``src``; bits [2, HV] int32 (in: zero; out: the maxima's fp32 bits)."""
    Ttot, HV = dynamic_dims("Ttot HV")
    f32, i32 = "float32", "int32"
    assert AMAX_ROWS * D % (8 * THREADS) == 0
    steps = AMAX_ROWS * D // (8 * THREADS)

    @T.macro
    def absmax_bits(x, hv, t0, tx, buf, acc):
        """``acc[0] = max(acc[0], bits |x|)`` over the CTA's rows of value head ``hv``: 8 consecutive elements a
        thread a step, the steps unrolled without a branch (rows past ``Ttot`` read the last row again, which
        leaves the maximum as it is), so that their loads are issued together."""
        for s in T.unroll(steps):
            e0 = (s * THREADS + tx) * 8
            for e in T.vectorized(8):
                buf[e] = x[T.min(t0 + e0 // D, Ttot - 1), hv, e0 % D + e]
            for e in T.unroll(8):
                acc[0] = T.max(acc[0], T.reinterpret(T.cast(buf[e], f32), i32) & 0x7FFFFFFF)

    @T.prim_func
    def gdn_bwd_amax(
        v: T.Tensor((Ttot, HV, D), src),
        do: T.Tensor((Ttot, HV, D), src),
        bits: T.Tensor((2, HV), i32),
    ):
        with T.Kernel(T.ceildiv(Ttot, AMAX_ROWS), HV, threads=THREADS) as (bt, hv):
            tx = T.get_thread_binding()
            t0 = bt * AMAX_ROWS
            bv = T.alloc_local((8,), src)
            bd = T.alloc_local((8,), src)
            mv = T.alloc_local((1,), i32)
            md = T.alloc_local((1,), i32)
            mv[0] = 0
            md[0] = 0
            absmax_bits(v, hv, t0, tx, bv, mv)
            absmax_bits(do, hv, t0, tx, bd, md)
            mv[0] = T.warp_reduce_max(mv[0])
            md[0] = T.warp_reduce_max(md[0])
            if tx % 32 == 0:
                T.atomic_max(bits[1, hv], mv[0])
                T.atomic_max(bits[0, hv], md[0])

    return gdn_bwd_amax


def build_convert(D: int, src: str, dst: str):
    """Arguments: q, k [Ttot, H, D], v, do [Ttot, HV, D] in ``src``; bits [2, HV] int32 (``gdn_bwd_amax``'s, with
    dht's and h0's maxima); q2, k2, v2, do2 in ``dst`` (out); out [4, HV] fp32 (``scales.scales_and_factors``)."""
    Ttot, H, HV = dynamic_dims("Ttot H HV")
    f32, i32 = "float32", "int32"
    qk = src != dst

    @T.prim_func
    def gdn_bwd_convert(
        q: T.Tensor((Ttot, H, D), src),
        k: T.Tensor((Ttot, H, D), src),
        v: T.Tensor((Ttot, HV, D), src),
        do: T.Tensor((Ttot, HV, D), src),
        bits: T.Tensor((2, HV), i32),
        q2: T.Tensor((Ttot, H, D), dst),
        k2: T.Tensor((Ttot, H, D), dst),
        v2: T.Tensor((Ttot, HV, D), dst),
        do2: T.Tensor((Ttot, HV, D), dst),
        out: T.Tensor((4, HV), f32),
    ):
        with T.Kernel(T.ceildiv(Ttot, ROWS), HV, threads=THREADS) as (bt, hv):
            tx = T.get_thread_binding()
            m = T.alloc_local((2,), i32)
            e = T.alloc_local((2,), i32)
            s = T.alloc_local((2,), f32)
            h0 = T.alloc_local((1,), i32)          # the group's first value head
            group_scales(bits, hv, HV // H, m, e, s, h0)
            if bt == 0 and tx == 0:
                store_scales(out, hv, e, s)
            t0 = bt * ROWS
            for i, d in T.Parallel(ROWS, D):
                if t0 + i < Ttot:
                    v2[t0 + i, hv, d] = T.cast(T.cast(v[t0 + i, hv, d], f32) * s[1], dst)
                    do2[t0 + i, hv, d] = T.cast(T.cast(do[t0 + i, hv, d], f32) * s[0], dst)
            if qk:
                if hv < H:
                    for i, d in T.Parallel(ROWS, D):
                        if t0 + i < Ttot:
                            q2[t0 + i, hv, d] = T.cast(q[t0 + i, hv, d], dst)
                            k2[t0 + i, hv, d] = T.cast(k[t0 + i, hv, d], dst)

    return gdn_bwd_convert
