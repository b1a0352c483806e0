"""Inputs of a case: drawn on the CPU from a generator seeded by the case, then cast and moved.

The draw depends on (layout, B, T, H, HV, K, V, dist, seed) only, not on the dtypes, so a bf16-gate
case and its fp32-gate twin see the same numbers rounded differently.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import torch

from cases.case import Case
from cases.distributions import get_distribution
from cases.dtypes import to_torch
from cases.layouts import get_layout

PAD_LOGIT = -1.0e4  # raw gate input / beta logit in padding: softplus and sigmoid of it are exactly 0 in fp32


@dataclass
class GDNInputs:
    """One GDN call's arguments, named as in FLA's ``chunk_gated_delta_rule``.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (raw gate input / beta logits when the transform
    is in-kernel); initial_state [N, HV, K, V] ([N, HV, V, K] when state_v_first) or None; cu_seqlens [N+1]
    int64 or None; A_log, dt_bias [HV] fp32 when use_gate_in_kernel. ``seq_lens`` has the N lengths.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    scale: float | None = None
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    use_beta_sigmoid_in_kernel: bool = False
    state_v_first: bool = False
    seq_lens: list[int] = field(default_factory=list)

    TENSORS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")

    def to(self, device) -> "GDNInputs":
        """A copy with every tensor on ``device``."""
        moved = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in self._tensors().items()}
        return dataclasses.replace(self, **moved)

    def _tensors(self) -> dict:
        return {n: getattr(self, n) for n in self.TENSORS}

    def kwargs(self) -> dict:
        """Keyword arguments for FLA-style calls (and the references); A_log/dt_bias only when used."""
        kw = dict(q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, scale=self.scale,
                  initial_state=self.initial_state, output_final_state=True,
                  use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel, state_v_first=self.state_v_first,
                  cu_seqlens=self.cu_seqlens)
        if self.use_gate_in_kernel:
            kw.update(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
        if self.use_beta_sigmoid_in_kernel:
            kw.update(use_beta_sigmoid_in_kernel=True)
        return kw

    def reference_kwargs(self) -> dict:
        """kwargs() plus A_log and dt_bias always (the references take them, None or not)."""
        return {**self.kwargs(), "A_log": self.A_log, "dt_bias": self.dt_bias}

    @property
    def grad_names(self) -> list[str]:
        """Inputs that get gradients: q, k, v, g, beta and h0 when present."""
        return ["q", "k", "v", "g", "beta"] + (["initial_state"] if self.initial_state is not None else [])


def draw_seed(case: Case) -> int:
    """The generator seed: a stable hash of what determines the draw (never the dtypes)."""
    key = f"{case.layout}|{case.B}|{case.T}|{case.H}|{case.HV}|{case.K}|{case.V}|{case.dist}|{case.seed}"
    return zlib.crc32(key.encode())


def make_inputs(case: Case, device: str | torch.device = "cpu") -> GDNInputs:
    """Draw the inputs of ``case`` (deterministic), cast each to its case dtype and move them to ``device``."""
    gen = torch.Generator().manual_seed(draw_seed(case))
    layout, dist = get_layout(case.layout), get_distribution(case.dist)
    lengths = layout.lengths(case.T, case.B, gen)
    d = dist.sample(case.B, case.T, case.H, case.HV, case.K, case.V, gen)
    if layout.left_pad:
        _zero_left_padding(d, lengths, case.T, dist)
    if layout.varlen:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        seq_lens, N = list(lengths), len(lengths)
    else:
        cu, seq_lens, N = None, [case.T] * case.B, case.B
    h0 = None
    if case.h0_dtype is not None:
        h0 = torch.randn((N, case.HV, case.K, case.V), generator=gen, dtype=torch.float32) * dist.h0_std
        if case.state_v_first:
            h0 = h0.transpose(-1, -2).contiguous()
        h0 = h0.to(to_torch(case.h0_dtype))
    dt, g_dt, b_dt = to_torch(case.dtype), to_torch(case.g_dtype), to_torch(case.beta_dtype)
    inp = GDNInputs(
        q=d["q"].to(dt), k=d["k"].to(dt), v=d["v"].to(dt), g=d["g"].to(g_dt), beta=d["beta"].to(b_dt),
        initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=dist.qk_l2norm_in_kernel,
        use_gate_in_kernel=dist.gate_in_kernel, A_log=d.get("A_log"), dt_bias=d.get("dt_bias"),
        use_beta_sigmoid_in_kernel=dist.beta_sigmoid_in_kernel, state_v_first=case.state_v_first, seq_lens=seq_lens,
    )
    return inp.to(device) if str(device) != "cpu" else inp


def _zero_left_padding(d: dict, prompt_lens: list[int], T: int, dist) -> None:
    """Padding tokens before each row's prompt: q=k=v=0 and a gate and beta of exactly 0 (after any in-kernel
    transform), so the padding leaves the state untouched."""
    for b, p in enumerate(prompt_lens):
        pad = slice(0, T - p)
        for name in ("q", "k", "v"):
            d[name][b, pad] = 0.0
        d["g"][b, pad] = PAD_LOGIT if dist.gate_in_kernel else 0.0
        d["beta"][b, pad] = PAD_LOGIT if dist.beta_sigmoid_in_kernel else 0.0
