"""The roundings of the forward's wgmma operands and stored tables, and the presets the dispatch chooses;
imports nothing heavy.

Every field names one rounding of an fp32 value that becomes a wgmma operand or is stored between
kernels: "bf16" = one input-dtype term (``rd(x)``), "split" = two terms ``rd(x) + rd(x - rd(x))``
(~16 mantissa bits), "fp16" = one fp16 term (11 mantissa bits, at a one-term product's cost: every operand field
"fp16" or none, since both operands of a product share a type; q and k enter as the intra kernel's row-scaled fp16
copies), or ``p`` and ``u`` alone "fp16" (``pu16``: the output's ``P @ U`` one fp16 product, P's rows past 2^15 and
U's value columns under powers of two; the emulation's study: its kernel form measured slower than the split
precision's, benchmarks/RESULTS.md); ``merge`` also allows "fp32" (products and sums in fp32 on the CUDA cores,
no operand rounding: the dispatch's).

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

from dataclasses import asdict, dataclass, fields

OPERANDS = ("ag", "ks", "x", "u", "upd", "s", "p")     # the fields that round a wgmma operand (all but merge)


@dataclass(frozen=True)
class Precision:
    merge: str = "bf16"
    ag: str = "bf16"
    ks: str = "bf16"
    x: str = "bf16"
    u: str = "bf16"
    upd: str = "bf16"
    s: str = "bf16"
    p: str = "bf16"

    def __post_init__(self):
        for f in fields(self):
            allowed = ("fp32", "bf16", "split") if f.name == "merge" else ("bf16", "split", "fp16")
            if getattr(self, f.name) not in allowed:
                raise ValueError(f"Precision.{f.name} must be one of {allowed}, got {getattr(self, f.name)!r}")
        half = {f for f in OPERANDS if getattr(self, f) == "fp16"}
        if half and half != set(OPERANDS) and half != {"p", "u"}:
            raise ValueError(f"fp16 operands are all, p and u alone (P @ U), or none (a product's two operands share "
                             f"a type): {self}")

    @property
    def half(self) -> bool:
        """Every operand one fp16 term (``operand_dtype``)."""
        return self.ag == "fp16"

    @property
    def pu16(self) -> bool:
        """``P @ U`` alone one fp16 product, every other operand as its field says."""
        return self.p == "fp16" and not self.half

    def operand_dtype(self, dtype: str) -> str:
        """The wgmma operand type of the kernels after the intra kernel's merges for inputs of ``dtype``."""
        return "float16" if self.half else dtype

    def for_scan(self) -> "Precision":
        """The CP scan stores no chunk tables: ``s`` and ``u`` do not change its code."""
        from dataclasses import replace
        return replace(self, s="bf16", u="bf16", p="bf16")

    def state_splits(self, scan: bool = False) -> tuple[bool, bool, bool, bool, bool, bool]:
        """(ks, s, x, ag, u, upd): which operands the state kernels (``state_smem`` / ``state_registers``) split into hi + lo.
        The CP scan (``scan``) stores no chunk tables, so its ``s`` and ``u`` are never split."""
        sp = lambda f: getattr(self, f) == "split"   # noqa: E731
        return sp("ks"), sp("s") and not scan, sp("x"), sp("ag"), sp("u") and not scan, sp("upd")

    def past_intra(self) -> "Precision":
        """The fields the kernels after the intra kernel read: ``merge`` (the intra kernel's alone) at "bf16", so
        that their configurations do not depend on it."""
        from dataclasses import replace
        return replace(self, merge="bf16")

    def tag(self) -> str:
        """Short name: the fields that are split, e.g. 'sp[ag,upd]' ('bf16' when none, 'fp16' with fp16 operands,
        'fp16+sp[merge]' with split merges)."""
        on = [k for k, v in asdict(self).items() if v == "split"]
        sp = "sp[" + "+".join(on) + "]" if on else ""
        if self.half:
            return "fp16" + ("+" + sp if sp else "")
        if self.pu16:
            return (sp + "+" if sp else "") + "pu16"
        return sp or "bf16"


PRESETS = {
    # split where the emulation shows it buys accuracy: Ag and X (U = Ag X), F2 U (state update), U and P (output),
    # the chunk-start state S in both K S (state kernel) and Q S (output kernel); the intra kernel's block merges in
    # fp32. Under slow decays one term of S put o at up to 1.54x its bf16 rounding floor (split: at most 1.07x, H200
    # standard matrix, 60d6e0a and d09c518); one-term merges left the final state only 4.9x closer to fp64 than FLA
    # Triton's (split: at least 360x in every cell, 7bc563f); fp32 merges give Ag as close to fp64 as split ones, the
    # intra kernel in 0.65x their time (H200, benchmarks/RESULTS.md)
    "default": Precision(merge="fp32", ag="split", u="split", p="split", upd="split", x="split", s="split",
                         ks="split"),
    # every operand one fp16 term, the merges in fp32 (the fused ws form with P tables alone): the one-term products'
    # cost with 3 more mantissa bits than bf16 operands
    "half": Precision(merge="fp32", ag="fp16", ks="fp16", x="fp16", u="fp16", upd="fp16", s="fp16", p="fp16"),
    # "default" with P @ U one fp16 product (P's large rows, U's value columns under powers of two): the final state
    # bitwise "default"'s (the chain is unchanged), o within 1.6% of "default"'s error on the emulation's rows
    # (benchmarks/precision_fwd.py); a study, no kernel computes it
    "pu16": Precision(merge="fp32", ag="split", u="fp16", p="fp16", upd="split", x="split", s="split", ks="split"),
    # the backward's forward recompute: S and U stored hi + lo for its products, S split in K S as in "default".
    # With K S one term the recomputed states drift from the exact ones by up to about 2^-9 under slow decay, and
    # dg / dbeta follow: 8.2e-4 / 5.2e-4 against 4.9e-5 / 2.0e-5 split (the emulation, K = 64, slow-decay, T 4096;
    # their bf16 rounding floors 1.7e-3)
    "recompute": Precision(merge="fp32", ag="split", u="split", p="split", upd="split", x="split", s="split",
                           ks="split"),
}


def preset() -> Precision:
    """The precision the forward's dispatch chooses: "default"."""
    return PRESETS["default"]
