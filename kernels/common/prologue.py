"""TileLang kernel prologues shared by the forward and backward GDN kernels (``T.macro``: inlined where
they are called, so the generated TIR and CUDA are those of the code written out in place).

A macro renames a TIR variable passed to it after its own parameter (TileLang binds macro arguments by
name), so every parameter below that receives a variable is named like the variable at every call site
(``c``, ``n``, ``hv``, ``v0``, ``v_first``, ...); buffers and Python values may have any name.
Variables a macro returns take the caller's names.

* ``dynamic_dims``: the runtime sizes (``T.dynamic``) of a kernel's signature;
* ``lo_shape``: the shape of a two-term split's lo buffer (a placeholder when the split is off);
* ``chunk_span``: the token range of chunk ``c`` of the varlen chunk table (parallel kernels);
* ``seq_span``: the token and chunk range of sequence ``n`` (sequential kernels);
* ``zero_rows_past``: the rows of a tile past the sequence's end set to zero (after a TMA copy of whole chunks);
* ``load_state_vt`` / ``store_state_vt``: a value-first fp32 state block ``[BV, DK]`` from / to a
  ``[N, HV, DK, DV]`` tensor stored in either layout (``v_first``).
"""

import tilelang.language as T

BT = 64


def dynamic_dims(names: str):
    """One ``T.dynamic`` per blank-separated name, e.g. ``Ttot, H, HV = dynamic_dims("Ttot H HV")``."""
    return tuple(T.dynamic(name) for name in names.split())


def lo_shape(shape, need: bool):
    """``shape`` when the lo term of a split operand is used, else a placeholder of the same rank with 8 x 8 last
    dims (never read)."""
    return shape if need else (*shape[:-2], 8, 8)


@T.macro
def chunk_span(chunk_indices, cu_seqlens, c, bind_bos):
    """(eos, t0) of chunk ``c``: ``chunk_indices[c] = (sequence, chunk within it)``, ``t0`` its first token,
    ``eos`` the end of its sequence.  ``bind_bos`` also names the sequence start ``bos`` (the kernels that
    spell it so; it changes the generated code's text, not its meaning)."""
    seq = chunk_indices[c, 0]
    ic = chunk_indices[c, 1]
    if bind_bos:
        bos = cu_seqlens[seq]
        eos = cu_seqlens[seq + 1]
        t0 = bos + ic * BT
    else:
        eos = cu_seqlens[seq + 1]
        t0 = cu_seqlens[seq] + ic * BT
    return eos, t0


@T.macro
def seq_span(cu_seqlens, chunk_offsets, n):
    """(bos, eos, c0, nchunks) of sequence ``n``: its tokens ``[bos, eos)``, its first global chunk id and
    its number of chunks."""
    bos = cu_seqlens[n]
    eos = cu_seqlens[n + 1]
    c0 = chunk_offsets[n]
    nchunks = T.ceildiv(eos - bos, BT)
    return bos, eos, c0, nchunks


@T.macro
def zero_rows_past(tile, nv):
    """Rows ``r >= nv`` of the 2-D shared tile ``tile`` set to zero: a TMA copy of a whole chunk reads the next
    sequence's tokens there (or zeros past the tensor's end)."""
    for r, d in T.Parallel(*tile.shape):
        if r >= nv:
            tile[r, d] = T.cast(0, tile.dtype)


@T.macro
def load_state_vt(src, s_f, v_first, n, hv, v0, BV, DK):
    """``s_f [BV, DK] = S^T`` of columns ``[v0, v0 + BV)`` of ``src[n, hv]`` (``[DV, DK]`` when
    ``v_first``, else ``[DK, DV]``)."""
    if v_first != 0:
        T.copy(src[n, hv, v0:v0 + BV, 0:DK], s_f)
    else:
        for i, d in T.Parallel(BV, DK):
            s_f[i, d] = src[n, hv, d, v0 + i]


@T.macro
def store_state_vt(s_f, dst, v_first, n, hv, v0, BV, DK):
    """The inverse of ``load_state_vt``: ``s_f [BV, DK]`` into ``dst[n, hv]`` in its layout."""
    if v_first != 0:
        T.copy(s_f, dst[n, hv, v0:v0 + BV, 0:DK])
    else:
        for i, d in T.Parallel(BV, DK):
            dst[n, hv, d, v0 + i] = s_f[i, d]


@T.macro
def load_state_kt(src, s_f, v_first, n, hv, v0, BV, DK):
    """``s_f [DK, BV] = S`` of columns ``[v0, v0 + BV)`` of ``src[n, hv]`` (``[DV, DK]`` when ``v_first``, else
    ``[DK, DV]``): the key-first counterpart of ``load_state_vt``."""
    if v_first != 0:
        for i, j in T.Parallel(DK, BV):
            s_f[i, j] = src[n, hv, v0 + j, i]
    else:
        T.copy(src[n, hv, 0:DK, v0:v0 + BV], s_f)


@T.macro
def store_state_kt(s_f, dst, v_first, n, hv, v0, BV, DK):
    """The inverse of ``load_state_kt``: ``s_f [DK, BV]`` into ``dst[n, hv]`` in its layout."""
    if v_first != 0:
        for i, j in T.Parallel(DK, BV):
            dst[n, hv, v0 + j, i] = s_f[i, j]
    else:
        T.copy(s_f, dst[n, hv, 0:DK, v0:v0 + BV])


@T.macro
def split_into(x_f, hi, lo, with_lo):
    """``hi = rd(x)`` and, where ``with_lo`` (a build-time bool), ``lo = rd(x - hi)``: a two-term split of the fp32
    tile ``x_f`` into the dtype of ``hi`` (any 2-D shape; two loops, the hi one first)."""
    dtype = hi.dtype
    for i, j in T.Parallel(*x_f.shape):
        hi[i, j] = T.cast(x_f[i, j], dtype)
    if with_lo:
        for i, j in T.Parallel(*x_f.shape):
            lo[i, j] = T.cast(x_f[i, j] - T.cast(T.cast(x_f[i, j], dtype), "float32"), dtype)


@T.macro
def split_products(ah, al, bh, bl, acc, a_lo, b_lo, clear, transpose_A):
    """``acc (+)= ah bh (+ al bh) (+ ah bl)``: the products of two operands split into hi + lo (``a_lo``, ``b_lo``:
    build-time bools; the lo tile is not read without them), in that order, as one group of wgmma with one wait:
    every product but the last issued with ``T.wgmma_gemm`` (no wait), the last a ``T.gemm``, whose wait covers the
    group.  ``clear``: the first product overwrites ``acc``."""
    if a_lo or b_lo:
        T.wgmma_gemm(ah, bh, acc, transpose_A=transpose_A, clear_accum=clear)
        if a_lo and b_lo:
            T.wgmma_gemm(al, bh, acc, transpose_A=transpose_A)
            T.gemm(ah, bl, acc, transpose_A=transpose_A)
        elif a_lo:
            T.gemm(al, bh, acc, transpose_A=transpose_A)
        else:
            T.gemm(ah, bl, acc, transpose_A=transpose_A)
    else:
        T.gemm(ah, bh, acc, transpose_A=transpose_A, clear_accum=clear)
