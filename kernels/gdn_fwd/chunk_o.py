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
