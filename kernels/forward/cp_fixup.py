"""``gdn_cp_fixup``: phase 2 of the forward's segment-parallel (CP) state passing, in fp64, one launch.

The scan (phase 1, ``gdn_scan_rv``) gives every segment p of a sequence the affine map of its chunks,
``S -> M_p S + Z_p``, as ``ZM [Nseg, HV, 2D, D]`` fp32 in the value-first layout of the rv kernels:
rows ``[0, D)`` are ``Z_p^T`` and rows ``[D, 2D)`` are ``M_p^T``.  The segment start states are then
``S_0 = h0`` (or 0) and ``S_{p+1} = M_p S_p + Z_p``, value-first: ``S_{p+1}^T = S_p^T M_p^T + Z_p^T``.

A CTA walks the segments of one sequence for one value head and ``ROWS`` rows of ``S^T`` (the rows are
independent), holding them in fp64 shared memory; each step reads ``M_p^T`` and its ``Z_p^T`` rows once into
shared memory (fp32, as stored; by TMA, the next step's during this one) and accumulates every product and sum in
fp64 (FMA on the fp64 pipes, no tensor cores), so the result is the fp64 walk rounded once to fp32.  Segments
of different sequences may differ in number (varlen): ``seg_of [N + 1]`` holds each sequence's first segment id.
With ``warm`` the walk ends at the last segment of the sequence that needs an exact start state (``cp_warm``; the
later ones start from their warm-up), writing the start states up to it.
"""

import tilelang.language as T

from kernels.common.prologue import dynamic_dims

from .cp_warm import BT, MAX_SEGMENTS, WARM_CHUNKS, macros

_, exact_after = macros()

ROWS = 8           # rows of S^T (value index) per CTA: D / 8 CTAs per sequence and value head


def build_cp_fixup(D: int, warm: bool = False):
    """Arguments: ZM [Nseg, HV, 2 D, D] fp32 (``[Z^T ; M^T]``); h0 [Nh, HV, D, D] fp32, read when ``use_h0``
    (Nh = N), value-first when ``h0_vf`` else key-first; seg_of [N + 1] int32; co int32 and F [HV, NC, 8, 64]
    fp32, read with ``warm`` alone (``cp_warm``'s [3 Nseg + 1] table and the gate table); out [Nseg, HV, D, D]
    fp32 value-first (every segment's start state; with ``warm``, up to the last that needs it); use_h0, h0_vf
    int32."""
    f32, f64 = "float32", "float64"
    Nseg, HV, N, Nh, Nco, NC = dynamic_dims("Nseg HV N Nh Nco NC")

    @T.prim_func
    def gdn_cp_fixup(
        ZM: T.Tensor((Nseg, HV, 2 * D, D), f32),
        h0: T.Tensor((Nh, HV, D, D), f32),
        seg_of: T.Tensor((N + 1,), "int32"),
        co: T.Tensor((Nco,), "int32"),
        F: T.Tensor((HV, NC, 8, BT), f32),
        out: T.Tensor((Nseg, HV, D, D), f32),
        use_h0: T.int32,
        h0_vf: T.int32,
    ):
        with T.Kernel(D // ROWS, HV, N, threads=128) as (rb, hv, n):
            s_s = T.alloc_shared((ROWS, D), f64)
            m_s = T.alloc_shared((D, D), f32)
            z_s = T.alloc_shared((ROWS, D), f32)
            acc = T.alloc_fragment((ROWS, D), f64)
            a0 = seg_of[n]
            if warm:    # steps up to the last segment that needs its exact start state
                steps = T.alloc_local((1,), "int32")
                wacc = T.alloc_local((1,), f32)
                wl_s = T.alloc_shared((MAX_SEGMENTS * WARM_CHUNKS,), f32)
                ca_s = T.alloc_shared((MAX_SEGMENTS,), "int32")
                exact_after(F, co, Nseg + 1, a0 + 1, seg_of[n + 1] - a0 - 1, hv, steps, wacc, wl_s, ca_s)
                count = steps[0] + 1
            else:
                count = seg_of[n + 1] - a0
            if use_h0 != 0 and h0_vf != 0:
                for i, j in T.Parallel(ROWS, D):
                    s_s[i, j] = T.cast(h0[n, hv, rb * ROWS + i, j], f64)
            elif use_h0 != 0:
                for i, j in T.Parallel(ROWS, D):
                    s_s[i, j] = T.cast(h0[n, hv, j, rb * ROWS + i], f64)
            else:
                for i, j in T.Parallel(ROWS, D):
                    s_s[i, j] = T.float64(0)
            # count >= 1 (an empty sequence has one empty segment); step p + 1's M^T and Z^T rows load during step p
            for p in T.Pipelined(count - 1, num_stages=2):
                T.copy(ZM[a0 + p, hv, D:2 * D, 0:D], m_s)
                T.copy(ZM[a0 + p, hv, rb * ROWS:(rb + 1) * ROWS, 0:D], z_s)
                for i, j in T.Parallel(ROWS, D):
                    out[a0 + p, hv, rb * ROWS + i, j] = T.cast(s_s[i, j], f32)
                for i, j in T.Parallel(ROWS, D):
                    acc[i, j] = T.cast(z_s[i, j], f64)
                for a in T.unroll(D):          # loads scheduled ahead of the fp64 FMA chain
                    for i, j in T.Parallel(ROWS, D):
                        acc[i, j] = acc[i, j] + s_s[i, a] * T.cast(m_s[a, j], f64)
                T.copy(acc, s_s)
            for i, j in T.Parallel(ROWS, D):
                out[a0 + count - 1, hv, rb * ROWS + i, j] = T.cast(s_s[i, j], f32)

    return gdn_cp_fixup
