"""A test case is data: a small frozen dataclass with a stable, readable id.

The id is the pytest id and the key of every result row; ``Case.from_id`` parses it back, so a
failure message's id is enough to rerun that cell. Inputs depend only on the case (its seed
included): see ``cases.inputs.make_inputs``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from cases.dtypes import DTYPES

_ID_RE = re.compile(
    r"^(?P<layout>[a-z0-9-]+)_B(?P<B>\d+)_T(?P<T>\d+)_H(?P<H>\d+)-HV(?P<HV>\d+)_K(?P<K>\d+)-V(?P<V>\d+)"
    r"_(?P<dtype>[a-z0-9]+)_g-(?P<g_dtype>[a-z0-9]+)_beta-(?P<beta_dtype>[a-z0-9]+)_h0-(?P<h0_dtype>[a-z0-9]+)"
    r"_(?P<dist>[a-z0-9-]+)(?P<vfirst>_vfirst)?(?P<grad>_grad)?(?:_s(?P<seed>\d+))?$"
)


@dataclass(frozen=True)
class Case:
    """One GDN configuration.

    layout: a name in cases.layouts (dense, varlen-*, left-pad); B: batch rows (1 for varlen layouts);
    T: tokens per row (dense) or in total (varlen); H q/k heads, HV value heads (a multiple of H);
    K, V head dims; dtype of q/k/v, g_dtype of the gate, beta_dtype of beta, h0_dtype of the initial
    state (None: no initial state); dist: a name in cases.distributions; state_v_first: the state is
    [.., V, K]; grad: gradients are part of the case; seed: the input draw.
    """

    layout: str = "dense"
    B: int = 1
    T: int = 1024
    H: int = 4
    HV: int = 8
    K: int = 128
    V: int = 128
    dtype: str = "bf16"
    g_dtype: str = "fp32"
    beta_dtype: str = "fp32"
    h0_dtype: str | None = None
    dist: str = "gauss-l2"
    state_v_first: bool = False
    grad: bool = False
    seed: int = 0

    def __post_init__(self):
        from cases.distributions import get_distribution
        from cases.layouts import get_layout

        for name in ("B", "T", "H", "HV", "K", "V", "seed"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"Case.{name} must be a non-negative int, got {val!r}")
        for name in ("B", "H", "HV", "K", "V"):
            if getattr(self, name) == 0:
                raise ValueError(f"Case.{name} must be positive")
        if self.HV % self.H:
            raise ValueError(f"Case.HV={self.HV} must be a multiple of Case.H={self.H}")
        for name in ("dtype", "g_dtype", "beta_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"Case.{name}={getattr(self, name)!r} is not one of {', '.join(DTYPES)}")
        if self.h0_dtype is not None and self.h0_dtype not in DTYPES:
            raise ValueError(f"Case.h0_dtype={self.h0_dtype!r} is not None or one of {', '.join(DTYPES)}")
        layout = get_layout(self.layout)
        if layout.varlen and self.B != 1:
            raise ValueError(f"layout {self.layout!r} packs sequences varlen-style and needs B=1, got B={self.B}")
        if self.T < layout.min_T:
            raise ValueError(f"layout {self.layout!r} needs T >= {layout.min_T}, got T={self.T}")
        dist = get_distribution(self.dist)
        if dist.needs_h0 and self.h0_dtype is None:
            raise ValueError(f"distribution {self.dist!r} is about the initial state and needs h0_dtype")

    @property
    def id(self) -> str:
        """Stable readable id, e.g. dense_B1_T4096_H4-HV8_K128-V128_bf16_g-fp32_beta-fp32_h0-none_gauss-l2_s0."""
        return f"{self.group_id}_s{self.seed}"

    @property
    def group_id(self) -> str:
        """The id without the seed: the cell that several seeds of one configuration share."""
        parts = [
            self.layout, f"B{self.B}", f"T{self.T}", f"H{self.H}-HV{self.HV}", f"K{self.K}-V{self.V}", self.dtype,
            f"g-{self.g_dtype}", f"beta-{self.beta_dtype}", f"h0-{self.h0_dtype or 'none'}", self.dist,
        ]
        if self.state_v_first:
            parts.append("vfirst")
        if self.grad:
            parts.append("grad")
        return "_".join(parts)

    def replace(self, **changes) -> "Case":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_id(cls, case_id: str) -> "Case":
        """Parse an id (with or without its _s<seed> suffix) back into a Case."""
        m = _ID_RE.match(case_id)
        if not m:
            raise ValueError(f"not a case id: {case_id!r} (expected the form of Case().id: {cls().id})")
        d = m.groupdict()
        return cls(
            layout=d["layout"], B=int(d["B"]), T=int(d["T"]), H=int(d["H"]), HV=int(d["HV"]), K=int(d["K"]),
            V=int(d["V"]), dtype=d["dtype"], g_dtype=d["g_dtype"], beta_dtype=d["beta_dtype"],
            h0_dtype=None if d["h0_dtype"] == "none" else d["h0_dtype"], dist=d["dist"],
            state_v_first=bool(d["vfirst"]), grad=bool(d["grad"]), seed=int(d["seed"] or 0),
        )

    def __str__(self) -> str:
        return self.id


# The configuration's fields, in declaration order: every field but the seed. A result row carries them as columns
# (next to case_id, group_id and seed); grouping by them gathers a configuration's seeds.
CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Case) if f.name != "seed")
