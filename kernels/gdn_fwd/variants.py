"""Precision presets of the v2 ("split2") path; imports nothing heavy (used by the API, the
emulation, the build and the benchmark).

Every field names one rounding of an fp32 value that becomes a wgmma operand or is stored between
kernels: "bf16" = one input-dtype term (``rd(x)``), "split" = two terms ``rd(x) + rd(x - rd(x))``
(~16 mantissa bits); ``merge`` also allows "fp32" (emulation only).

* ``merge`` - the two block-merge levels of the 64x64 triangular inverse (intra kernel);
* ``ag``    - ``Ag = Tinv diag(beta)`` as stored by the intra kernel and used in ``U = Ag X``;
* ``ks``    - the chunk-start state ``S`` in ``K @ S`` (state kernel);
* ``x``     - ``X = V - F0 (K S)`` in ``U = Ag X``;
* ``u``     - ``U`` (v_new) as stored for the output kernel (``P @ U``);
* ``upd``   - ``F2 U`` in the state update ``S += K^T (F2 U)``;
* ``s``     - the chunk-start state as stored for ``Q @ S`` in the output kernel;
* ``p``     - ``P`` (gated, scaled ``Q K^T``, computed in fp32 by the output kernel) in ``P @ U``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PrecisionV2:
    merge: str = "bf16"
    ag: str = "bf16"
    ks: str = "bf16"
    x: str = "bf16"
    u: str = "bf16"
    upd: str = "bf16"
    s: str = "bf16"
    p: str = "bf16"

    def for_scan(self) -> "PrecisionV2":
        """The CP scan stores no chunk tables: ``s`` and ``u`` do not change its code."""
        from dataclasses import replace
        return replace(self, s="bf16", u="bf16", p="bf16")

    def state_splits(self, scan: bool = False) -> tuple[bool, bool, bool, bool, bool, bool]:
        """(ks, s, x, ag, u, upd): which operands the state kernels (``state2`` / ``state3``) split into hi + lo.
        The CP scan (``scan``) stores no chunk tables, so its ``s`` and ``u`` are never split."""
        sp = lambda f: getattr(self, f) == "split"   # noqa: E731
        return sp("ks"), sp("s") and not scan, sp("x"), sp("ag"), sp("u") and not scan, sp("upd")

    def tag(self) -> str:
        """Short name: the fields that are split, e.g. 'sp[ag,upd]' ('bf16' when none)."""
        on = [k for k, v in asdict(self).items() if v == "split"]
        return "sp[" + "+".join(on) + "]" if on else "bf16"

    def mma_units(self, DV: int = 128) -> dict:
        """64x64x64-MMA units per (chunk, value head) at DK = DV = 128: intra / state / output."""
        sp = lambda f: 2 if getattr(self, f) == "split" else 1   # noqa: E731
        merge = {"split": 6, "bf16": 2, "fp32": 0}[self.merge] * 2
        intra = 2 + merge                                     # KK^T (64x64x128) + merges
        v = DV // 64
        ag_x = 1 + (self.ag == "split") + (self.x == "split")
        state = v * (2 * sp("ks") + ag_x + 2 * sp("upd"))      # K S, Ag X, K^T (F2 U)
        out = 2 + v * (2 * sp("s") + (1 + (self.p == "split") + (self.u == "split")))
        return {"intra": intra, "state": state, "output": out}

    def bytes_per_chunk(self, DK: int = 128, DV: int = 128, esize: int = 2) -> dict:
        """Bytes written + read per (chunk, value head) for the intermediates between kernels."""
        sp = lambda f: 2 if getattr(self, f) == "split" else 1   # noqa: E731
        ag = 64 * 64 * esize * sp("ag")
        f = 8 * 64 * 4
        s = DK * DV * esize * sp("s")
        u = 64 * DV * esize * sp("u")
        return {"Ag": 2 * ag, "F": 2 * f, "S": 2 * s, "U": 2 * u, "total": 2 * (ag + f + s + u)}


PRECISIONS_V2 = {
    # every operand a single input-dtype term: FLA-like traffic and MMA count, but o ~2.1x the
    # rounding floor (slightly worse than FLA): not acceptable as a default, kept for timing
    "bf16": PrecisionV2(),
    # the default: split only where emulation shows it buys accuracy (kernels/NOTES.md):
    # Ag and X (U = Ag X), F2 U (state update), U and P (output)
    "default": PrecisionV2(ag="split", u="split", p="split", upd="split", x="split"),
    # dispatched instead of "default" when an initial state is given: a large carried-in state
    # makes rd(S) in Q S the dominant error (1.41x the floor, FLA's level); the split S fixes it
    "default_h0": PrecisionV2(ag="split", u="split", p="split", upd="split", x="split", s="split"),
    # cheaper state chain (no split X / update): still below FLA's errors but with less margin
    "lean": PrecisionV2(ag="split", u="split", p="split"),
    # adds the chunk-start state split for Q S (large h0) and K S / X (beta near 0, heavy tails)
    "max": PrecisionV2(ag="split", u="split", p="split", upd="split", s="split", ks="split", x="split"),
}
