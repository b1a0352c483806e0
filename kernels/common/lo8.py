"""fp8 lo terms: the lo term of a two-term split stored as fp8 e4m3 under the power of two that its own hi term
sets, element by element (no scale table; ``kernels.backward.emulation.lo8`` gives the values read back, in torch).

For ``x`` fp32, ``hi = rd(x)`` in the input dtype of ``m`` mantissa bits and the stored lo term ``lo = rd(x - hi)``
(input dtype), ``|lo|`` is at most half an ulp of hi, ``2^(E - shift)`` with ``E`` hi's exponent and
``shift = m + 1``; the code is ``e4m3(lo 2^(shift - E))`` (in [-1, 1] for a normal hi: e4m3's 4 significant bits,
subnormals down to 2^-9; the conversion saturates) and the value read back ``code 2^(E - shift)``.
Both powers of two are built from hi's fp32 exponent bits ``eb``; where ``eb <= shift`` (hi below 2^-118 for
bf16, or zero) the lo term is dropped.  ``lo8_code``, ``lo8_code_of`` and ``lo8_value`` are expression builders
for TileLang kernel bodies, without branches (a select on hi kept the generated code from batching the loads and
conversions of a tile); ``widen_lo8`` widens a global table's tile into shared memory.
"""

import tilelang.language as T
import torch

from kernels.interface import LO8_DTYPE, lo8_shift as _shift

LO8 = str(LO8_DTYPE).removeprefix("torch.")          # TileLang's name of the table dtype: "float8_e4m3fn"


def lo8_shift(dtype: str) -> int:
    """``kernels.interface.lo8_shift`` of the hi terms' dtype by its TileLang name ("bfloat16": 8, "float16": 11)."""
    return _shift(getattr(torch, dtype))


def _exponent_bits(hi32):
    return (T.reinterpret(hi32, "int32") >> 23) & 255


def lo8_code_of(lo, hi, dtype: str):
    """The fp8 code of the lo term ``lo`` (its value in ``dtype`` or fp32) under its hi term ``hi`` (``dtype``).  No
    branch: where ``eb <= shift`` the scale is capped at 2^127 (the code is then a finite value that ``lo8_value``
    reads back as 0)."""
    shift = lo8_shift(dtype)
    up = T.reinterpret(T.min(254 + shift - _exponent_bits(T.cast(hi, "float32")), 254) << 23, "float32")
    return T.cast(T.cast(lo, "float32") * up, LO8)


def lo8_code(x, dtype: str):
    """The fp8 code of the stored lo term ``rd(x - rd(x))`` (``dtype``) of fp32 ``x``: the code of the input-dtype
    lo term, as ``kernels.backward.emulation.lo8`` takes it."""
    hi = T.cast(x, dtype)
    return lo8_code_of(T.cast(x - T.cast(hi, "float32"), dtype), hi, dtype)


def lo8_value(code, hi, dtype: str, masked: bool = False):
    """The lo term (fp32) that the fp8 ``code`` holds under its hi term ``hi`` (``dtype``).  No branch: where
    ``eb <= shift`` the power of two's bits are 0 (the float 0), so that a load of ``code`` is never conditional on
    ``hi`` (a branch kept each load of a code behind the read of its hi term: one memory latency each).
    ``masked``: the power of two's bits as ``max((bits & 0x7F800000) - (shift << 23), 0)`` of hi's fp32 bits, the
    same value as ``max(eb - shift, 0) << 23`` for every hi, in fewer integer instructions."""
    shift = lo8_shift(dtype)
    if masked:
        bits = T.reinterpret(T.cast(hi, "float32"), "int32") & 0x7F800000
        down = T.reinterpret(T.max(bits - (shift << 23), 0), "float32")
    else:
        eb = _exponent_bits(T.cast(hi, "float32"))
        down = T.reinterpret(T.max(eb - shift, 0) << 23, "float32")
    return T.cast(code, "float32") * down


@T.macro
def widen_lo8(codes, hv, c, hi_s, lo_s, tx, c8, w8, threads, masked=False):
    """``lo_s = lo8_value(codes[hv, c], hi_s)`` in ``lo_s``'s dtype: fp8 codes ``codes [HV, NC, R, C]`` (global),
    shared tiles ``hi_s, lo_s [R, C]``; ``c8`` (fp8) and ``w8`` (``lo_s``'s dtype) local buffers of 8.  Each of the
    ``threads`` threads ``tx`` takes 8 consecutive elements at a time: one 8-byte load of codes and one 16-byte
    shared read and write.  ``R C`` a multiple of ``8 threads``; ``masked``: ``lo8_value``'s."""
    R, C = lo_s.shape
    for r in T.unroll(R * C // (8 * threads)):       # unrolled: the loads of every step issued together
        e = (r * threads + tx) * 8
        for u in T.vectorized(8):
            c8[u] = codes[hv, c, e // C, e % C + u]
        for u in T.vectorized(8):
            w8[u] = hi_s[e // C, e % C + u]
        for u in T.unroll(8):
            w8[u] = T.cast(lo8_value(c8[u], w8[u], lo_s.dtype, masked), lo_s.dtype)
        for u in T.vectorized(8):
            lo_s[e // C, e % C + u] = w8[u]
