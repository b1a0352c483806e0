"""Named sequence layouts: how T tokens are split into sequences (dense rows, varlen packs, padding).

A layout turns (T, B, rng) into sequence lengths. Dense layouts give every row T tokens; varlen
layouts pack sequences into one row (B=1) described by cu_seqlens; ``left-pad`` gives each dense row
a short prompt at its end, the tokens before it being zeros (q=k=v=0, g=0, beta=0), which leave the
state exactly unchanged; ``varlen-padded`` packs a few sequences and leaves the row's last tokens outside
every sequence (``cu_seqlens[-1] < T``: drawn like the rest, their o must be 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

BOUNDARY_LENGTHS = (1, 63, 64, 65, 127, 128, 129)


@dataclass(frozen=True)
class Layout:
    """name; rationale (one line); varlen: packed with cu_seqlens; lengths(T, B, gen) -> per-sequence lengths
    (varlen; with ``padded`` they sum to less than T) or per-row prompt lengths (left-pad) or None (dense);
    min_T: the smallest T it makes sense for."""

    name: str
    rationale: str
    varlen: bool
    lengths: Callable[[int, int, torch.Generator], list[int] | None]
    min_T: int = 1
    left_pad: bool = False
    padded: bool = False


def _fill(cycle, T: int) -> list[int]:
    out, total, i = [], 0, 0
    while total < T:
        n = min(cycle[i % len(cycle)], T - total)
        out.append(n)
        total += n
        i += 1
    return out


def _ragged(T: int, B: int, gen: torch.Generator) -> list[int]:
    n = max(1, min(8, T))
    cuts = sorted(torch.randperm(max(T - 1, 1), generator=gen)[: n - 1].add(1).tolist()) if n > 1 else []
    bounds = [0, *cuts, T]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _many_short(T: int, B: int, gen: torch.Generator) -> list[int]:
    out, total = [], 0
    while total < T:
        n = min(int(torch.randint(1, 49, (1,), generator=gen)), T - total)
        out.append(n)
        total += n
    return out


def _with_empty(T: int, B: int, gen: torch.Generator) -> list[int]:
    rest = T - 1
    half = rest // 2
    return [0, 1, 0, half, rest - half, 0]


def _padded(T: int, B: int, gen: torch.Generator) -> list[int]:
    """Three ragged sequences over the first T - T/5 tokens (at least one token of padding after them)."""
    used = T - max(1, T // 5)
    cuts = sorted(int(torch.randint(0, used + 1, (1,), generator=gen)) for _ in range(2))
    bounds = [0, *cuts, used]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _left_pad(T: int, B: int, gen: torch.Generator) -> list[int]:
    lo, hi = max(1, T // 16), max(1, T // 4)
    return [int(torch.randint(lo, hi + 1, (1,), generator=gen)) for _ in range(B)]


LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        Layout("dense", "equal-length rows [B, T]: the training layout (B=1 and B>1)", False, lambda T, B, gen: None),
        Layout("varlen-one", "one long sequence with cu_seqlens=[0, T]: the non-padded long-context prefill users ask "
               "about", True, lambda T, B, gen: [T]),
        Layout("varlen-boundary", "lengths cycling through 1, 63, 64, 65, 127, 128, 129: every chunk-boundary edge",
               True, lambda T, B, gen: _fill(BOUNDARY_LENGTHS, T)),
        Layout("varlen-ragged", "8 random lengths summing to T: a ragged serving batch", True, _ragged),
        Layout("varlen-short", "hundreds of sequences of 1-48 tokens: many tiny prompts, state resets everywhere",
               True, _many_short),
        Layout("varlen-empty", "zero-length and one-token sequences among two long ones: an empty sequence must pass "
               "its initial state through exactly", True, _with_empty, min_T=3),
        Layout("varlen-padded", "three ragged sequences then T/5 padding tokens past cu_seqlens[-1]: a serving "
               "batch padded to a fixed size (o and the gradients must be 0 there)", True, _padded, padded=True),
        Layout("left-pad", "a short prompt (T/16 to T/4 tokens) left-padded with zeros to T in each row: padded "
               "batched inference", False, _left_pad, min_T=1, left_pad=True),
    )
}


def get_layout(name: str) -> Layout:
    """The layout called ``name``; ValueError listing the known names otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}") from None
