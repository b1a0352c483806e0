"""Sequence bookkeeping shared by the references: varlen segments, padding and state layout."""

from __future__ import annotations

import torch

from reference.validate import Dims


def segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(bos, eos)] of each sequence in a varlen pack. cu_seqlens: [N+1] integer."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def state_in(initial_state, dims: Dims, dtype, device, state_v_first: bool) -> torch.Tensor:
    """The initial state as [N, HV, K, V] in ``dtype`` (zeros when None; transposed when V-first)."""
    if initial_state is None:
        return torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=dtype, device=device)
    S = initial_state.to(device=device, dtype=dtype)
    return S.transpose(-1, -2) if state_v_first else S


def state_out(S: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    """[N, HV, K, V] -> the caller's layout ([N, HV, V, K] when V-first), contiguous."""
    return (S.transpose(-1, -2) if state_v_first else S).contiguous()


def _pad_index(cu_seqlens: torch.Tensor, length: int):
    """Token index [N, length] into the packed dim and its validity mask, on cu_seqlens' device."""
    cu = cu_seqlens.to(torch.long)
    pos = torch.arange(length, device=cu.device)
    idx = cu[:-1, None] + pos[None, :]
    valid = pos[None, :] < (cu[1:] - cu[:-1])[:, None]
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def pad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, length: int, value: float = 0.0) -> torch.Tensor:
    """[1, T, ...] packed -> [N, length, ...], each sequence left-aligned and padded with ``value`` at its end."""
    idx, valid = _pad_index(cu_seqlens.to(x.device), length)
    out = x[0][idx]
    mask = valid.view(*valid.shape, *([1] * (x.ndim - 2)))
    return torch.where(mask, out, torch.full_like(out, value))


def unpad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of pad_varlen: [N, length, ...] -> [1, T, ...]."""
    _, valid = _pad_index(cu_seqlens.to(x.device), x.shape[1])
    return x[valid][None]


def _neutral_pad(x: torch.Tensor, L: int) -> torch.Tensor:
    """Zero-pad dim 1 to length L. Zero q/k/v/g/beta tokens leave the state unchanged."""
    if x.shape[1] == L:
        return x
    pad = x.new_zeros((x.shape[0], L - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def to_chunks(xs, dims: Dims, cu_seqlens, C: int) -> list[torch.Tensor]:
    """[B or 1, T, ...] tensors -> [N, L, ...] with L a multiple of C: dense rows zero-padded at their end, varlen
    sequences one per row, each padded with neutral tokens to the longest sequence's whole chunks."""
    if dims.varlen:
        L = -(-max([e - b for b, e in segments(cu_seqlens)] + [0]) // C) * C
        return [pad_varlen(x, cu_seqlens, L) for x in xs]
    L = -(-dims.T // C) * C
    return [_neutral_pad(x, L) for x in xs]


def pad_tokens(o: torch.Tensor, T: int) -> torch.Tensor:
    """A packed output [1, T', ...] zero-padded to T tokens: o past the last sequence (padded varlen) is 0."""
    if o.shape[1] == T:
        return o
    return torch.cat([o, o.new_zeros((o.shape[0], T - o.shape[1], *o.shape[2:]))], dim=1)


def from_chunks(o: torch.Tensor, dims: Dims, cu_seqlens) -> torch.Tensor:
    """Inverse of to_chunks for an output [N, L, ...] -> [B or 1, T, ...] (zero past the last sequence),
    contiguous."""
    return (pad_tokens(unpad_varlen(o, cu_seqlens), dims.T) if dims.varlen else o[:, : dims.T]).contiguous()
