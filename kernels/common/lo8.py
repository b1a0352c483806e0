"""fp8 lo terms: the lo term of a two-term split stored as fp8 e4m3 under the power of two that its own hi term
sets, element by element (no scale table; ``kernels.backward.emulation.lo8`` gives the values read back, in torch).

For ``x`` fp32 and ``hi = rd(x)`` in the input dtype of ``m`` mantissa bits, ``|x - hi|`` is at most half an ulp of
hi, ``2^(E - shift)`` with ``E`` hi's exponent and ``shift = m + 1``; the code is ``e4m3((x - hi) 2^(shift - E))``
(in [-1, 1] for a normal hi: e4m3's 4 significant bits, subnormals down to 2^-9; the conversion saturates) and the
value read back ``code 2^(E - shift)``.
Both powers of two are built from hi's fp32 exponent bits ``eb``; where ``eb <= shift`` (hi below 2^-118 for
bf16, or zero) the lo term is dropped.  These are expression builders for TileLang kernel bodies, without branches
(a select on hi kept the generated code from batching the loads and conversions of a tile).
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


def lo8_code(x, dtype: str):
    """The fp8 code of fp32 ``x``'s lo term under ``rd(x)`` in ``dtype``.  No branch: where ``eb <= shift`` the scale
    is capped at 2^127 (the code is then a finite value that ``lo8_value`` reads back as 0)."""
    shift = lo8_shift(dtype)
    hi = T.cast(T.cast(x, dtype), "float32")
    up = T.reinterpret(T.min(254 + shift - _exponent_bits(hi), 254) << 23, "float32")
    return T.cast((x - hi) * up, LO8)


def lo8_value(code, hi, dtype: str):
    """The lo term (fp32) that the fp8 ``code`` holds under its hi term ``hi`` (``dtype``).  No branch: where
    ``eb <= shift`` the power of two's bits are 0 (the float 0), so that a load of ``code`` is never conditional on
    ``hi`` (a branch kept each load of a code behind the read of its hi term: one memory latency each)."""
    shift = lo8_shift(dtype)
    eb = _exponent_bits(T.cast(hi, "float32"))
    down = T.reinterpret(T.max(eb - shift, 0) << 23, "float32")
    return T.cast(code, "float32") * down
