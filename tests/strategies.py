"""Shared hypothesis strategies for the tests (array-api-tests style: one helpers module).

Layouts favour the chunk boundaries (1, 63, 64, 65), GVA ratios 1, 2 and 4, and every dtype a case
can name. Everything here is drawn small enough for an fp64 reference on a CPU.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

BOUNDARY_LENGTHS = (1, 2, 63, 64, 65, 127, 128, 129)
GVA_RATIOS = (1, 2, 4)
INPUT_DTYPES = ("fp16", "bf16", "fp32")
GATE_DTYPES = ("fp32", "bf16", "fp16")


def seq_length(max_len: int = 140, allow_empty: bool = False):
    """A sequence length, biased towards chunk boundaries."""
    lo = 0 if allow_empty else 1
    return st.one_of(st.sampled_from([n for n in BOUNDARY_LENGTHS if n <= max_len] + ([0] if allow_empty else [])),
                     st.integers(lo, max_len))


@st.composite
def varlen_lengths(draw, max_seqs: int = 4, max_len: int = 140, allow_empty: bool = False):
    """A list of 1..max_seqs sequence lengths with at least one token in total."""
    lens = draw(st.lists(seq_length(max_len, allow_empty), min_size=1, max_size=max_seqs))
    if sum(lens) == 0:
        lens[0] = 1
    return lens


@st.composite
def head_config(draw, max_h: int = 2):
    """(H, HV, K, V): H q/k heads, HV = H * ratio value heads, small head dims."""
    H = draw(st.integers(1, max_h))
    ratio = draw(st.sampled_from(GVA_RATIOS))
    K = draw(st.sampled_from((4, 8, 16)))
    V = draw(st.sampled_from((4, 8, 16)))
    return H, H * ratio, K, V


@st.composite
def strided_lane_access(draw):
    """(base, stride, width): 32 lanes of a warp accessing shared memory at byte ``base + lane * stride``, each
    ``width`` bytes (1, 2, 4, 8 or 16; the base and stride multiples of the width, as aligned accesses are) - the
    bank-conflict model's meta-tests (``kernels.common.bank_conflicts``)."""
    width = draw(st.sampled_from((1, 2, 4, 8, 16)))
    base = draw(st.integers(0, 4096 // width)) * width
    stride = draw(st.one_of(st.sampled_from((0, 1, 2, 4, 8, 16, 32, 64)), st.integers(0, 64))) * width
    return base, stride, width


def gdn_tensors(B: int, T: int, H: int, HV: int, K: int, V: int, seed: int, dtype=torch.float64,
                gate_scale: float = 1.0):
    """Random q, k (L2-normalised), v, g (log-space, negative), beta in (0, 1): the gauss-l2 family."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype) * gate_scale
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(x - ref) / RMS(ref) in fp64 (0 when both are zero)."""
    x, ref = x.double(), ref.double()
    den = ref.pow(2).sum().sqrt()
    num = (x - ref).pow(2).sum().sqrt()
    return float(num / den) if den > 0 else float(num)
