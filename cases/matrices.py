"""Named matrices: lists of cases built as a union of small sweeps, each sweep varying one axis.

- ``smoke``: seconds on a CPU; small heads (K=V=32), fp32 and bf16, every distribution and layout.
- ``standard``: an H200 in minutes; K=V=128 (what FlashQLA needs), T from 64 to 32768 including 20468,
  both gate dtypes, every distribution and layout, fp16, GVA variants, initial states, V-first states.
- ``long``: T up to 131072 with up to 64 value heads.
- ``full``: standard and long together, plus the T sweep for every distribution.
Every configuration is repeated over ``seeds`` (default 3); the seed is part of the case id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from cases.case import Case
from cases.distributions import DISTRIBUTIONS
from cases.layouts import BOUNDARY_LENGTHS, LAYOUTS

DEFAULT_SEEDS = 3
STANDARD_T = (64, 512, 2048, 8192, 20468, 32768)


@dataclass(frozen=True)
class Matrix:
    """name; description; build() -> configurations (seed 0); seeds: default number of seeds."""

    name: str
    description: str
    build: Callable[[], list[Case]]
    seeds: int = DEFAULT_SEEDS

    def cases(self, seeds: int | None = None) -> list[Case]:
        """Every configuration times every seed, deduplicated, in a stable order."""
        n = self.seeds if seeds is None else seeds
        if n < 1:
            raise ValueError(f"seeds must be >= 1, got {n}")
        return with_seeds(self.build(), n)


def with_seeds(configs: Iterable[Case], seeds: int) -> list[Case]:
    """Each configuration at seeds 0..seeds-1, duplicates removed, order kept."""
    out, seen = [], set()
    for c in configs:
        for s in range(seeds):
            case = c.replace(seed=s)
            if case.id not in seen:
                seen.add(case.id)
                out.append(case)
    return out


def _both_gate_dtypes(c: Case) -> list[Case]:
    """The fp32 pair (g, beta fp32) and the input-dtype pair, as inference engines pass both."""
    return [c.replace(g_dtype="fp32", beta_dtype="fp32"), c.replace(g_dtype=c.dtype, beta_dtype=c.dtype)]


def _h0_for(dist: str) -> str | None:
    return "fp32" if DISTRIBUTIONS[dist].needs_h0 else None


def smoke() -> list[Case]:
    base = Case(T=64, H=2, HV=4, K=32, V=32, dtype="fp32", dist="qwen-gates")
    out = []
    for T in (1, 63, 64, 65, 200):
        out += [base.replace(T=T), base.replace(T=T, dtype="bf16"), base.replace(T=T, dtype="bf16", g_dtype="bf16",
                                                                                   beta_dtype="bf16")]
    for d in DISTRIBUTIONS:
        out.append(base.replace(T=64, dist=d, h0_dtype=_h0_for(d)))
    for lay in LAYOUTS:
        out.append(base.replace(T=200, layout=lay))
    out += [
        base.replace(layout="dense", B=2, T=130),
        base.replace(T=130, h0_dtype="fp32"),
        base.replace(T=130, h0_dtype="fp32", state_v_first=True),
        base.replace(T=70, H=1, HV=4),
        base.replace(T=64, grad=True, h0_dtype="fp32"),
        base.replace(T=100, dtype="bf16", grad=True),
    ]
    return out


def standard() -> list[Case]:
    base = Case(T=8192, H=4, HV=8, K=128, V=128, dtype="bf16", dist="qwen-gates")
    out = []
    for dist in ("gauss-l2", "qwen-gates"):  # T sweep, both gate dtypes
        for T in STANDARD_T:
            out += _both_gate_dtypes(base.replace(T=T, dist=dist))
    for T in (512, 8192, 32768):  # fp16 inputs
        out += _both_gate_dtypes(base.replace(T=T, dtype="fp16"))
    for d in DISTRIBUTIONS:  # every distribution, both gate dtypes
        out += _both_gate_dtypes(base.replace(dist=d, h0_dtype=_h0_for(d)))
    for lay in LAYOUTS:  # every layout but padded varlen (most backends leave padding undefined: smoke has it)
        if not LAYOUTS[lay].padded:
            out.append(base.replace(layout=lay))
    out += [
        base.replace(B=4, T=2048),
        base.replace(layout="varlen-short", h0_dtype="fp32"),
        base.replace(layout="varlen-boundary", T=sum(BOUNDARY_LENGTHS) * 4, h0_dtype="fp32"),
        base.replace(T=4096, h0_dtype="fp32"),
        base.replace(T=4096, h0_dtype="fp32", state_v_first=True),
        base.replace(T=4096, state_v_first=True, layout="varlen-ragged", h0_dtype="fp32"),
        base.replace(H=16, HV=32),  # the Qwen3.5-size GVA
        base.replace(H=8, HV=8),  # no GVA
        base.replace(H=2, HV=8),  # GVA ratio 4
        base.replace(T=4096, K=64, V=64),  # head dim 64 (FlashQLA rejects it)
    ]
    for dist in ("gauss-l2", "strong-decay", "slow-decay"):  # gradients
        out += [base.replace(T=T, dist=dist, grad=True) for T in (1024, 8192)]
    out += [  # gradients in the configurations the forward rows cover: initial state, varlen with the value-first
        # state, gates and beta in the input dtype, fp16 inputs, GVA ratio 4
        base.replace(T=4096, grad=True, h0_dtype="fp32"),
        base.replace(T=4096, grad=True, layout="varlen-ragged", h0_dtype="fp32", state_v_first=True),
        base.replace(T=1024, grad=True, g_dtype="bf16", beta_dtype="bf16"),
        base.replace(T=1024, grad=True, dtype="fp16"),
        base.replace(T=1024, grad=True, H=2, HV=8),
    ]
    return out


def long() -> list[Case]:
    base = Case(T=65536, H=4, HV=8, K=128, V=128, dtype="bf16", dist="qwen-gates")
    out = []
    for T in (65536, 131072):
        out += _both_gate_dtypes(base.replace(T=T))
        out.append(base.replace(T=T, layout="varlen-one"))
        out.append(base.replace(T=T, dist="slow-decay"))
    out.append(base.replace(T=131072, H=16, HV=64))
    out.append(base.replace(T=131072, layout="varlen-ragged"))
    return out


def full() -> list[Case]:
    out = standard() + long()
    base = Case(T=8192, H=4, HV=8, K=128, V=128, dtype="bf16")
    for d in DISTRIBUTIONS:
        for T in STANDARD_T:
            out += _both_gate_dtypes(base.replace(T=T, dist=d, h0_dtype=_h0_for(d)))
    return out


MATRICES: dict[str, Matrix] = {
    m.name: m
    for m in (
        Matrix("smoke", "seconds on a CPU: K=V=32, fp32 and bf16, every distribution and layout", smoke, seeds=1),
        Matrix("standard", "an H200 in minutes: K=V=128, T 64..32768 (incl. 20468), every distribution, layout and "
               "gate dtype", standard),
        Matrix("long", "T up to 131072, up to 64 value heads", long),
        Matrix("full", "standard + long + every distribution over the T sweep", full),
    )
}


def get_matrix(name: str) -> Matrix:
    """The matrix called ``name``; ValueError listing the known names otherwise."""
    try:
        return MATRICES[name]
    except KeyError:
        raise ValueError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}") from None
