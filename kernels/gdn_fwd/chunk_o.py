"""Stage 4: the chunk output, as a TileLang macro fused into the recurrent kernel.

For one chunk (64 rows) and one block of ``BV`` value columns::

    O = F1 * (Q @ S) + P @ U        (then rounded once to the output dtype)

* ``Q @ S``: wgmma, ``Q`` exact input (bf16/fp16), ``S = S_hi + S_lo`` (the
  fp32 state split in two input-dtype terms, already in shared memory for the
  ``K @ S`` of the recurrence), fp32 accumulation;
* ``F1 = scale exp(G_t) rq_t`` (fp32 row factor, from the intra kernel);
* ``P @ U``: ``P = P_hi + P_lo`` (gated, scaled ``QK^T``) and
  ``U = U_hi + U_lo`` (the fp32 ``v_new`` of this chunk), three wgmmas
  ``P_hi U_hi + P_lo U_hi + P_hi U_lo`` accumulated in fp32 (the dropped
  ``P_lo U_lo`` term is ~2^-16 relative).

Rows past the end of the sequence are computed on padding (zeros or finite
neighbour tokens, all multiplied by zero factors) and are not stored.
"""

import tilelang.language as T

BT = 64


@T.macro
def chunk_output(q_s, sh_s, sl_s, ph_s, pl_s, uh_s, ul_s, f_s, o_f, o, t0, eos, hv, v0, BV, dtype):
    T.gemm(q_s, sh_s, o_f, clear_accum=True)
    T.gemm(q_s, sl_s, o_f)
    for i, j in T.Parallel(BT, BV):
        o_f[i, j] = o_f[i, j] * f_s[1, i]
    T.gemm(ph_s, uh_s, o_f)
    T.gemm(pl_s, uh_s, o_f)
    T.gemm(ph_s, ul_s, o_f)
    for i, j in T.Parallel(BT, BV):
        if t0 + i < eos:
            o[t0 + i, hv, v0 + j] = T.cast(o_f[i, j], dtype)


def build_output_kernel(DK: int, DV: int, dtype: str, BV: int = 64, split_s: bool = True):
    """Return the TileLang prim_func of the parallel output kernel ``gdn_output_fwd`` (split path).

    One CTA (128 threads) per (chunk, block of ``BV`` value columns, value head); nothing
    sequential::

        O = F1 * (Q @ (Sch + Scl)) + Ph Uh + Pl Uh + Ph Ul      (5 wgmma, fp32 accumulation)

    ``Sch + Scl`` is the chunk-start state as a two-term split (``split_s=False``, the
    "fast" precision: ``Sch`` only, 4 wgmma; with a large initial state that costs o up
    to ~40% of the rounding floor), ``P = Ph + Pl`` (intra kernel) and ``U = Uh + Ul``
    (state kernel) keep their two-term splits (dropping either lo term costs ~40% of the
    floor).  These are exactly the fused kernel's products.  Rows past the end of a sequence have zero
    ``P`` rows and ``F1`` and are not stored.

    Arguments:
      q               [Ttot, H, DK]      dtype
      Ph, Pl          [HV, NC, 64, 64]   dtype
      F               [HV, NC, 4, 64]    fp32
      Sch, Scl        [HV, NC, DK, DV]   dtype  (Scl not read when split_s=False)
      Uh, Ul          [HV, NC, 64, DV]   dtype
      cu_seqlens      [N + 1]            int32
      chunk_indices   [NC, 2]            int32
      o               [Ttot, HV, DV]     dtype  (output)
    """
    assert DK in (64, 128) and DV == DK and DV % BV == 0
    assert dtype in ("bfloat16", "float16")
    f32 = "float32"
    NV = DV // BV
    Ttot = T.dynamic("Ttot")
    H = T.dynamic("H")
    HV = T.dynamic("HV")
    N = T.dynamic("N")
    NC = T.dynamic("NC")

    @T.prim_func
    def gdn_output_fwd(
        q: T.Tensor((Ttot, H, DK), dtype),
        Ph: T.Tensor((HV, NC, BT, BT), dtype),
        Pl: T.Tensor((HV, NC, BT, BT), dtype),
        F: T.Tensor((HV, NC, 4, BT), f32),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        o: T.Tensor((Ttot, HV, DV), dtype),
    ):
        with T.Kernel(NC, NV, HV, threads=128) as (c, bv, hv):
            h = hv // (HV // H)
            seq = chunk_indices[c, 0]
            ic = chunk_indices[c, 1]
            eos = cu_seqlens[seq + 1]
            t0 = cu_seqlens[seq] + ic * BT
            v0 = bv * BV

            q_s = T.alloc_shared((BT, DK), dtype)
            s_s = T.alloc_shared((DK, BV), dtype)
            sl_s = T.alloc_shared((DK, BV), dtype)
            ph_s = T.alloc_shared((BT, BT), dtype)
            pl_s = T.alloc_shared((BT, BT), dtype)
            uh_s = T.alloc_shared((BT, BV), dtype)
            ul_s = T.alloc_shared((BT, BV), dtype)
            f_s = T.alloc_shared((BT,), f32)
            o_f = T.alloc_fragment((BT, BV), f32)

            T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
            T.copy(Sch[hv, c, 0:DK, v0:v0 + BV], s_s)
            if split_s:
                T.copy(Scl[hv, c, 0:DK, v0:v0 + BV], sl_s)
            T.copy(Ph[hv, c, 0:BT, 0:BT], ph_s)
            T.copy(Pl[hv, c, 0:BT, 0:BT], pl_s)
            T.copy(Uh[hv, c, 0:BT, v0:v0 + BV], uh_s)
            T.copy(Ul[hv, c, 0:BT, v0:v0 + BV], ul_s)
            T.copy(F[hv, c, 1, 0:BT], f_s)

            T.gemm(q_s, s_s, o_f, clear_accum=True)
            if split_s:
                T.gemm(q_s, sl_s, o_f)
            for i, j in T.Parallel(BT, BV):
                o_f[i, j] = o_f[i, j] * f_s[i]
            T.gemm(ph_s, uh_s, o_f)
            T.gemm(pl_s, uh_s, o_f)
            T.gemm(ph_s, ul_s, o_f)
            for i, j in T.Parallel(BT, BV):
                if t0 + i < eos:
                    o[t0 + i, hv, v0 + j] = T.cast(o_f[i, j], dtype)

    return gdn_output_fwd
