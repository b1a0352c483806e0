"""Error metrics of one tensor against its reference, computed in fp64 block by block.

``compare(out, ref)`` never holds an fp64 copy of a whole large tensor: it walks both flattened
tensors in blocks of ``BLOCK`` elements, upcasting one block at a time (so T=131072 with 64 heads
fits), on whatever device the tensors live on. NaN/Inf in ``out`` are counted first and make the
difference metrics NaN: a non-finite output is never "close".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

BLOCK = 1 << 24

TOKEN_KIND = "tokens"  # [B, T, heads(, channels)]: o, dq, dk, dv, dg, dbeta
STATE_KIND = "state"  # [N, HV, d1, d2]: final state, dh0
CHUNK_KIND = "chunks"  # [B, NT, HV, d1, d2]: the state at the start of every chunk (FLA's h)
CHUNK_SIZE = 64


@dataclass(frozen=True)
class Location:
    """Where an element sits: sequence (batch row or varlen sequence), token within it (None for a state),
    head, and channel (an int for token tensors, 'k,v' indices for states, None for per-head scalars). For chunk
    states the token is the first token of the chunk."""

    seq: int
    token: int | None
    head: int
    channel: int | str | None

    def __str__(self) -> str:
        tok = "final" if self.token is None else f"token {self.token}"
        ch = "" if self.channel is None else f", channel {self.channel}"
        return f"sequence {self.seq}, {tok}, head {self.head}{ch}"


@dataclass(frozen=True)
class Metrics:
    """max_diff = max|x - r|; mean_diff = mean|x - r|; rel_rmse = RMS(x - r) / RMS(r); cos_sim = <x, r> / (|x| |r|);
    max_ref = max|r|; rms_ref = RMS(r); max_out = max|x| over finite x; nan_count / inf_count of x; numel; where:
    the location of max_diff (of the first non-finite element when there is one)."""

    max_diff: float
    mean_diff: float
    rel_rmse: float
    cos_sim: float
    max_ref: float
    rms_ref: float
    max_out: float
    nan_count: int
    inf_count: int
    numel: int
    where: Location | None

    def as_row(self) -> dict:
        """Flat dict for a result row (location split into where_seq/where_token/where_head/where_channel)."""
        d = asdict(self)
        loc = d.pop("where")
        for key in ("seq", "token", "head", "channel"):
            d[f"where_{key}"] = None if loc is None else loc[key]
        return d

    @property
    def finite(self) -> bool:
        return self.nan_count == 0 and self.inf_count == 0


def locate(flat_index: int, shape: tuple[int, ...], kind: str = TOKEN_KIND,
           cu_seqlens: list[int] | None = None) -> Location:
    """Map a flat index of a tensor of ``shape`` to a Location. Token tensors are [B, T, heads(, channels)] (with
    cu_seqlens the packed token is mapped to (sequence, token in it); a token past cu_seqlens[-1], padding, to
    (N, token past the end)); state tensors are [N, heads, d1, d2]."""
    idx = []
    rem = int(flat_index)
    for size in reversed(shape):
        idx.append(rem % size)
        rem //= size
    idx = idx[::-1]
    if kind == STATE_KIND:
        return Location(seq=idx[0], token=None, head=idx[1], channel=f"{idx[2]},{idx[3]}")
    if kind == CHUNK_KIND:  # token = the first token of the chunk whose start state this is
        return Location(seq=idx[0], token=idx[1] * CHUNK_SIZE, head=idx[2], channel=f"{idx[3]},{idx[4]}")
    b, t, h = idx[0], idx[1], idx[2]
    ch = idx[3] if len(idx) > 3 else None
    if cu_seqlens is not None and t >= cu_seqlens[-1]:
        return Location(seq=len(cu_seqlens) - 1, token=t - cu_seqlens[-1], head=h, channel=ch)
    if cu_seqlens is not None:
        seq = max(i for i in range(len(cu_seqlens) - 1) if cu_seqlens[i] <= t and t < cu_seqlens[i + 1])
        return Location(seq=seq, token=t - cu_seqlens[seq], head=h, channel=ch)
    return Location(seq=b, token=t, head=h, channel=ch)


def compare(out: torch.Tensor, ref: torch.Tensor, kind: str = TOKEN_KIND,
            cu_seqlens: list[int] | torch.Tensor | None = None) -> Metrics:
    """Metrics of ``out`` (any float dtype) against ``ref`` (normally fp64), same shape and device."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: output {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if out.device != ref.device:
        raise ValueError(f"device mismatch: output on {out.device}, reference on {ref.device}")
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = [int(x) for x in cu_seqlens.tolist()]
    x_all, r_all = out.reshape(-1), ref.reshape(-1)
    n = x_all.numel()
    s_abs = s_d2 = s_r2 = s_x2 = s_xr = 0.0
    max_diff, max_ref, max_out, arg = -1.0, 0.0, 0.0, None
    nan_count = inf_count = 0
    first_bad = None
    for i in range(0, n, BLOCK):
        x = x_all[i:i + BLOCK].to(torch.float64)
        r = r_all[i:i + BLOCK].to(torch.float64)
        nan = torch.isnan(x)
        inf = torch.isinf(x)
        bad = nan | inf
        nb, ni = int(nan.sum()), int(inf.sum())
        if (nb or ni) and first_bad is None:
            first_bad = i + int(torch.nonzero(bad)[0, 0])
        nan_count += nb
        inf_count += ni
        d = (x - r).abs_()
        s_abs += float(d.sum())
        s_d2 += float((d * d).sum())
        s_r2 += float((r * r).sum())
        s_x2 += float((x * x).sum())
        s_xr += float((x * r).sum())
        if d.numel():
            j = int(torch.argmax(torch.where(bad, torch.zeros_like(d), d)))
            if float(d[j]) > max_diff:
                max_diff, arg = float(d[j]), i + j
            max_ref = max(max_ref, float(r.abs().max()))
            fin = x[~bad]
            if fin.numel():
                max_out = max(max_out, float(fin.abs().max()))
    nonfinite = nan_count + inf_count
    if n == 0:
        max_diff = 0.0
    if nonfinite:
        max_diff = s_abs = s_d2 = s_xr = s_x2 = math.nan
        arg = first_bad
    mean_diff = s_abs / n if n else 0.0
    rel_rmse = math.sqrt(s_d2 / s_r2) if s_r2 > 0 else (0.0 if s_d2 == 0 else math.inf)
    if nonfinite:
        rel_rmse, cos_sim = math.nan, math.nan
    elif s_x2 == 0 and s_r2 == 0:
        cos_sim = 1.0
    elif s_x2 == 0 or s_r2 == 0:
        cos_sim = 0.0
    else:
        cos_sim = s_xr / math.sqrt(s_x2 * s_r2)
    where = locate(arg, tuple(out.shape), kind, cu_seqlens) if arg is not None and n else None
    return Metrics(max_diff=max_diff, mean_diff=mean_diff, rel_rmse=rel_rmse, cos_sim=cos_sim, max_ref=max_ref,
                   rms_ref=math.sqrt(s_r2 / n) if n else 0.0, max_out=max_out, nan_count=nan_count,
                   inf_count=inf_count, numel=n, where=where)
