"""Named input distributions, each with a one-line rationale.

A distribution draws fp32 tensors for one case from a torch.Generator: q, k [B, T, H, K], v [B, T, HV, V],
g and beta [B, T, HV] (or the raw gate input / beta logits, with A_log and dt_bias [HV], when the
transform happens in the kernel). The initial state is drawn separately (cases.inputs) with the
distribution's ``h0_std``. Everything is drawn in a fixed order so a draw depends only on the
generator's seed and the sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from reference.prepare import gate_from_raw, l2norm


@dataclass(frozen=True)
class Distribution:
    """name; rationale (one line); sample(B, T, H, HV, K, V, gen) -> dict of fp32 tensors; flags for the
    transforms the kernel applies; needs_h0: the case must have an initial state; h0_std: its scale."""

    name: str
    rationale: str
    sample: Callable[..., dict]
    qk_l2norm_in_kernel: bool = False
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    needs_h0: bool = False
    h0_std: float = 1.0


def _randn(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def _rand(shape, gen, lo=0.0, hi=1.0):
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo


def _qkv(B, T, H, HV, K, V, gen, normalize=True):
    q, k, v = _randn((B, T, H, K), gen), _randn((B, T, H, K), gen), _randn((B, T, HV, V), gen)
    if normalize:
        q, k = l2norm(q), l2norm(k)
    return q, k, v


def _mamba_gate_params(B, T, HV, gen):
    """Raw gate input a [B, T, HV] and A_log, dt_bias [HV]: A ~ U[1, 16], dt ~ logU[1e-3, 1e-1] (Mamba init),
    dt_bias = softplus^-1(dt)."""
    A = _rand((HV,), gen, 1.0, 16.0)
    dt = torch.exp(_rand((HV,), gen, math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = _randn((B, T, HV), gen)
    return a, torch.log(A), dt_bias


def qwen_gates(B, T, HV, gen):
    """g [B, T, HV] fp32 of the ``qwen-gates`` distribution alone: ``-exp(A_log) softplus(a + dt_bias)`` with
    the Mamba initialisation of A_log and dt_bias per head (the benchmarks' realistic gates)."""
    return gate_from_raw(*_mamba_gate_params(B, T, HV, gen))


def _fla_test(B, T, H, HV, K, V, gen):
    q, k, v = _qkv(B, T, H, HV, K, V, gen)
    g = F.logsigmoid(_rand((B, T, HV), gen))
    beta = _rand((B, T, HV), gen).sigmoid()
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _qwen(B, T, H, HV, K, V, gen):
    q, k, v = _qkv(B, T, H, HV, K, V, gen)
    a, A_log, dt_bias = _mamba_gate_params(B, T, HV, gen)
    beta_logits = _randn((B, T, HV), gen)
    return dict(q=q, k=k, v=v, g=gate_from_raw(a, A_log, dt_bias), beta=beta_logits.sigmoid(),
                a=a, A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits)


def _qwen_in_kernel(B, T, H, HV, K, V, gen):
    d = _qwen(B, T, H, HV, K, V, gen)
    return dict(q=d["q"], k=d["k"], v=d["v"], g=d["a"], beta=d["beta_logits"], A_log=d["A_log"], dt_bias=d["dt_bias"])


def _with_gate(fn):
    def sample(B, T, H, HV, K, V, gen):
        d = _qwen(B, T, H, HV, K, V, gen)
        d["g"] = fn(d["g"], gen)
        return {key: d[key] for key in ("q", "k", "v", "g", "beta")}
    return sample


def _slow(g, gen):
    return -torch.exp(_rand(g.shape, gen, math.log(1e-5), math.log(1e-2)))


def _strong(g, gen):
    return -_rand(g.shape, gen, 15.0, 25.0)


def _mixed_heads(g, gen):
    strong = -_rand(g.shape, gen, 15.0, 25.0)
    odd = (torch.arange(g.shape[-1]) % 2 == 1)
    return torch.where(odd, strong, torch.zeros_like(g))


def _masked(g, gen):
    keep = _rand(g.shape, gen) >= 0.3
    return torch.where(keep, g, torch.zeros_like(g))


def _heavy_tail_v(B, T, H, HV, K, V, gen):
    d = _with_gate(lambda g, gen: g)(B, T, H, HV, K, V, gen)
    d["v"] = d["v"] * torch.exp(1.5 * _randn((B, T, HV, 1), gen))
    return d


def _raw_qk(B, T, H, HV, K, V, gen):
    d = _with_gate(lambda g, gen: g)(B, T, H, HV, K, V, gen)
    q, k, _ = _qkv(B, T, H, HV, K, V, gen, normalize=False)
    d["q"] = q * torch.exp(_randn((B, T, H, 1), gen))
    d["k"] = k * torch.exp(_randn((B, T, H, 1), gen))
    return d


def _beta_edges(B, T, H, HV, K, V, gen):
    d = _with_gate(lambda g, gen: g)(B, T, H, HV, K, V, gen)
    shape = d["beta"].shape
    near_one = _rand(shape, gen) < 0.5
    d["beta"] = torch.where(near_one, _rand(shape, gen, 0.99, 1.0), _rand(shape, gen, 0.0, 0.01))
    return d


DISTRIBUTIONS: dict[str, Distribution] = {
    d.name: d
    for d in (
        Distribution("gauss-l2", "Gaussian v, L2-normalised Gaussian q/k, g=logsigmoid(U[0,1]), beta=sigmoid(U[0,1]): "
                     "the distribution upstream maintainers quote", _fla_test),
        Distribution("qwen-gates", "Qwen3-Next/Mamba gates g=-exp(A_log)*softplus(a+dt_bias), A in [1,16], "
                     "dt in [1e-3,1e-1], beta=sigmoid(N(0,1)): what a real layer feeds the kernel", _with_gate(
                         lambda g, gen: g)),
        Distribution("qwen-gates-kernel", "the same Qwen gates with the gate and the beta sigmoid computed inside the "
                     "kernel (FLA's use_gate_in_kernel / use_beta_sigmoid_in_kernel)", _qwen_in_kernel,
                     gate_in_kernel=True, beta_sigmoid_in_kernel=True),
        Distribution("slow-decay", "g in [-1e-2, -1e-5]: long memory, the state accumulates over thousands of tokens",
                     _with_gate(_slow)),
        Distribution("strong-decay", "g in [-25, -15]: the state forgets at every token; exponents of cumulative "
                     "gates underflow unless taken as differences", _with_gate(_strong)),
        Distribution("mixed-heads", "even heads g=0 exactly (no decay), odd heads g in [-25,-15]: both extremes in "
                     "one call", _with_gate(_mixed_heads)),
        Distribution("gate-mask", "Qwen gates with 30% of positions set to exactly 0: masked / skipped decays",
                     _with_gate(_masked)),
        Distribution("heavy-tail-v", "v scaled per token by a log-normal exp(1.5 N(0,1)): outliers in the values",
                     _heavy_tail_v),
        Distribution("raw-qk-l2", "unnormalised Gaussian q/k with log-normal per-token norms, L2-normalised inside "
                     "the kernel (use_qk_l2norm_in_kernel), as Qwen3-Next calls it", _raw_qk, qk_l2norm_in_kernel=True),
        Distribution("beta-edges", "beta in [0, 0.01] or [0.99, 1]: writes that barely happen and writes that fully "
                     "replace", _beta_edges),
        Distribution("large-h0", "gauss-l2 inputs with an initial state of std 50: a large carried-in state dominates "
                     "the output", _fla_test, needs_h0=True, h0_std=50.0),
    )
}


def get_distribution(name: str) -> Distribution:
    """The distribution called ``name``; ValueError listing the known names otherwise."""
    try:
        return DISTRIBUTIONS[name]
    except KeyError:
        raise ValueError(f"unknown distribution {name!r}; known: {', '.join(DISTRIBUTIONS)}") from None
