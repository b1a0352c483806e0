"""The benchmarks' shapes and inputs: ``SHAPES`` (name -> (B, T, H, HV, varlen lengths or None)), K = V = ``D``,
``DEFAULT_SHAPES`` (the scripts' default: the five target shapes) and ``make``, the inputs of one shape, which
depend only on (shape, seed, gates)."""

from __future__ import annotations

import torch
import torch.nn.functional as Fn

__all__ = ["D", "DEFAULT_SHAPES", "GATES", "SHAPES", "make", "shrunk"]

SHAPES = {
    # name: (B, T, H, HV, varlen lengths or None)
    "B1_T32768_H16_HV32": (1, 32768, 16, 32, None),
    "B8_T4096_H16_HV32": (8, 4096, 16, 32, None),
    "B1_T8192_H4_HV8": (1, 8192, 4, 8, None),
    "B1_T65536_H2_HV4": (1, 65536, 2, 4, None),
    "varlen8_T32768_H16_HV32": (1, 32768, 16, 32, [1000, 7000, 2500, 6000, 300, 9000, 4000, 2968]),
    # 16 sequences, the longest last: the order in which a kernel issues its sequences' CTAs shows in its time
    "last16_T24000_H16_HV32": (1, 24000, 16, 32, [500] * 15 + [16500]),
}
DEFAULT_SHAPES = tuple(SHAPES)[:5]
D = 128
GATES = ("logsigmoid", "qwen")


def make(B, T, H, HV, lens, dev, seed=0, gen=None, gates="logsigmoid"):
    """(q, k, v, g, beta, cu_seqlens); ``gen``: draw from this generator instead of a new one seeded
    with ``seed`` (the backward benchmark draws its further inputs from the same one); ``gates`` (``GATES``):
    "qwen" replaces g by ``cases.distributions.qwen_gates`` (a CPU generator seeded with ``seed``), every other
    draw unchanged."""
    if gates not in GATES:
        raise ValueError(f"unknown gates {gates!r}; known: {GATES}")
    gen = gen if gen is not None else torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T, H, D, device=dev, generator=gen).to(torch.bfloat16)
    k = Fn.normalize(torch.randn(B, T, H, D, device=dev, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, D, device=dev, generator=gen).to(torch.bfloat16)
    g = Fn.logsigmoid(torch.randn(B, T, HV, device=dev, generator=gen))
    beta = torch.rand(B, T, HV, device=dev, generator=gen)
    if gates == "qwen":
        from cases.distributions import qwen_gates
        g = qwen_gates(B, T, HV, torch.Generator().manual_seed(seed)).to(dev)
    cu = None
    if lens:
        assert sum(lens) == T and B == 1
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=dev)
    return q, k, v, g, beta, cu


def shrunk(table: dict, factor: int = 256) -> dict:
    """A copy of a shape table with every length divided by ``factor`` (at least 1; T the sum of a varlen case's
    lengths): the CPU dry runs' shapes."""
    out = {}
    for name, (B, T, H, HV, lens) in table.items():
        small = [max(1, x // factor) for x in lens] if lens else None
        out[name] = (B, sum(small) if small else T // factor, H, HV, small)
    return out
