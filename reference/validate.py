"""Input validation shared by the references, the harness and the adapters.

Every problem raises ``ValueError`` with a message that names the tensor and what is wrong, so a
bad case is reported as such instead of surfacing as an indexing error deep inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Dims:
    """Sizes of one GDN call. N is the number of sequences (B dense, len(cu_seqlens)-1 varlen)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    varlen: bool


def _shape(name: str, x: torch.Tensor, ndim: int, expect: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {expect}, got {tuple(x.shape)} ({x.ndim} dims)")


def _float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")


def check_finite(name: str, x: torch.Tensor | None) -> None:
    """Raise ValueError if ``x`` holds NaN or Inf (counting both)."""
    if x is None or not x.is_floating_point():
        return
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(f"{name} contains {n_nan} NaN and {n_inf} Inf values")


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """Validate cu_seqlens ([N+1] integer, starts at 0, non-decreasing, ends at most at T: the tokens past its end
    are padding, outside every sequence); return it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    bad = [i for i in range(1, len(cu)) if cu[i] < cu[i - 1]]
    if bad:
        i = bad[0]
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i}]={cu[i]} < cu_seqlens[{i-1}]={cu[i-1]}")
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens must end at most at T={T} (tokens past its end are padding), got {cu[-1]}")
    return cu


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    check_values: bool = True,
) -> Dims:
    """Check shapes, dtypes, cu_seqlens and (optionally) finiteness of a GDN call.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V]
    ([N, HV, V, K] with state_v_first); cu_seqlens: [N+1] (B must be 1); A_log, dt_bias: [HV].
    """
    _shape("q", q, 4, "[B, T, H, K]")
    _shape("k", k, 4, "[B, T, H, K]")
    _shape("v", v, 4, "[B, T, HV, V]")
    _shape("g", g, 3, "[B, T, HV]")
    _shape("beta", beta, 3, "[B, T, HV]")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _float(name, x)
    B, T, H, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must be [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"HV={HV} (value heads) must be a multiple of H={H} (q/k heads) for GVA")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1:
            raise ValueError(f"B must be 1 when cu_seqlens is given (flatten the batch), got B={B}")
        N = len(check_cu_seqlens(cu_seqlens, T)) - 1
    else:
        N = B
    if initial_state is not None:
        _shape("initial_state", initial_state, 4, "[N, HV, K, V]")
        _float("initial_state", initial_state)
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be {layout} = {want}, got {tuple(initial_state.shape)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and tuple(x.shape) != (HV,):
            raise ValueError(f"{name} must be [HV] = ({HV},), got {tuple(x.shape)}")
    if check_values:
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                        ("A_log", A_log), ("dt_bias", dt_bias)):
            check_finite(name, x)
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, varlen=varlen)
