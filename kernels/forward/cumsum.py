"""Stage 1: chunk-local gate cumsum (fp32), as a TileLang macro.

It is fused into the intra-chunk kernel (`intra_chunk.py`) and the backward's prep
kernel (`backward/prep.py`); it is not a kernel of its own.  For one chunk of
``BT = 64`` tokens of one value head it loads ``g[t0 : t0 + nv, hv]`` (fp32 on
the device; the API casts bf16/fp16 gates to fp32 first, exactly) into a shared
fp32 vector, zero-fills the ``64 - nv`` rows past the end of the sequence, and
scans it in place:

    G[i] = sum_{s <= i} g[t0 + s]          (fp32, i in [0, 64))

Because the padded rows add exact zeros, ``G[63] == G[nv - 1]`` is the gate of
the last valid token, which the later stages use as ``G_L``.
"""

import tilelang.language as T

BT = 64
LOG2E = 1.4426950408889634


@T.macro
def load_chunk_gate_cumsum(g, beta, hv, t0, nv, g_s, b_s):
    """g, beta: global ``[Ttot, HV]`` fp32.  g_s, b_s: shared ``[BT]`` fp32.

    On return ``g_s`` holds the inclusive chunk-local cumsum G (fp32) and
    ``b_s`` holds beta (0 for rows >= nv).
    """
    for r in T.Parallel(BT):
        g_s[r] = T.if_then_else(r < nv, g[t0 + r, hv], T.float32(0))
        b_s[r] = T.if_then_else(r < nv, beta[t0 + r, hv], T.float32(0))
    T.cumsum(g_s, dim=0)
