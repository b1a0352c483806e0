"""Where the error sits: rel_rmse by token position within the sequence and by head, computed when a row is made.

Outputs are not stored, so the runner (parity.execute._metric_row) adds these columns to every row against fp64
(never to pairwise rows):

``pos_rel_rmse`` (token tensors o, dq, dk, dv, dg, dbeta): N_BINS=16 values. Bin i holds the tokens whose
    0-based position p within their own sequence, of length L, has floor(16 * p / L) == i: the position is
    normalised by each sequence's length. A dense row is one sequence of length T, so there bin i is tokens
    [ceil(i*T/16), ceil((i+1)*T/16)) of every row; with cu_seqlens each packed sequence is split into its own
    sixteenths (a 3-token sequence fills bins 0, 5 and 10), so bin 15 is "the last sixteenth of every
    sequence". Left-padded rows are binned over the whole row (the padding is the early bins, where the
    reference is exactly 0). Convention tag in the row: ``pos_convention`` = POS_CONVENTION.
``head_rel_rmse`` (token tensors and the states ht, dh0): one value per head (dim 2 of a token tensor
    [B, T, heads, ...], dim 1 of a state [N, heads, d1, d2]), over every token and channel of that head.

Each value is RMS(out - ref) / RMS(ref) over its slice, as in parity.metrics.compare: 0.0 when both are zero,
inf when only the reference is zero. A slice with a NaN/Inf output element is NaN; an empty bin (a sequence
shorter than 16 tokens leaves some bins empty) is NaN. Values are rounded to 4 significant digits. In the JSON
row (strict JSON) NaN is stored as null and inf as the string "inf"; ``decode`` turns a stored list back
into floats and returns None for rows written before these columns existed.

Computed in fp64 block by block like parity.metrics.compare: at most metrics.BLOCK elements of each tensor
are upcast at a time (whole tokens, or whole states), so T=131072 with 64 heads never holds a second full
fp64 copy.
"""

from __future__ import annotations

import math

import torch

from parity import metrics

N_BINS = 16
POS_CONVENTION = "seqfrac16"  # bin = floor(16 * position in sequence / sequence length)
POSITION_TENSORS = ("o", "dq", "dk", "dv", "dg", "dbeta")
STATE_TENSORS = ("ht", "dh0")
COLUMNS = ("pos_rel_rmse", "head_rel_rmse", "pos_convention")
DIGITS = 4


def _rel(d2: float, r2: float, bad: float, count: float | None = None) -> float:
    if count is not None and count == 0:
        return math.nan
    if bad:
        return math.nan
    if r2 > 0:
        return math.sqrt(d2 / r2)
    return 0.0 if d2 == 0 else math.inf


def _round(x: float) -> float:
    return x if not math.isfinite(x) or x == 0 else float(f"{x:.{DIGITS - 1}e}")


def _block_sums(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For fp64 blocks [rows, heads, channels]: sum of squared differences, of squared reference, and the count
    of non-finite output elements, each [rows, heads]."""
    bad = ~torch.isfinite(x)
    d = x - r
    d2 = torch.where(bad, torch.zeros_like(d), d * d).sum(-1)
    return d2, (r * r).sum(-1), bad.sum(-1).to(torch.float64)


def bin_index(t: torch.Tensor, T: int, cu_seqlens: torch.Tensor | None, bins: int = N_BINS) -> torch.Tensor:
    """The bin of each token index ``t`` (of a dense row of length T, or packed with ``cu_seqlens``; tokens past
    ``cu_seqlens[-1]``, padding, are binned as one more sequence)."""
    if cu_seqlens is None:
        return torch.div(t * bins, max(T, 1), rounding_mode="floor")
    cu = cu_seqlens.to(device=t.device, dtype=torch.int64)
    if int(cu[-1]) < T:
        cu = torch.cat([cu, cu.new_tensor([T])])
    seq = torch.searchsorted(cu[1:], t, right=True)
    start, length = cu[seq], cu[seq + 1] - cu[seq]
    return torch.div((t - start) * bins, length.clamp_min(1), rounding_mode="floor")


def token_profile(out: torch.Tensor, ref: torch.Tensor, cu_seqlens: torch.Tensor | list[int] | None = None,
                  bins: int = N_BINS) -> tuple[list[float], list[float]]:
    """(rel_rmse per position bin, rel_rmse per head) of a token tensor [B, T, heads(, channels...)]."""
    if tuple(out.shape) != tuple(ref.shape) or out.dim() < 3:
        raise ValueError(f"token tensors must be [B, T, heads, ...] of one shape; got {tuple(out.shape)} and "
                         f"{tuple(ref.shape)}")
    if isinstance(cu_seqlens, list):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    B, T, H = out.shape[:3]
    dev, f64 = ref.device, torch.float64
    per_token = max(1, out[0, 0].numel()) if B and T else 1
    step = max(1, metrics.BLOCK // per_token)
    pos = torch.zeros(4, bins, dtype=f64, device=dev)  # d2, r2, bad, count
    head = torch.zeros(3, H, dtype=f64, device=dev)  # d2, r2, bad
    for b in range(B):
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            x = out[b, t0:t1].to(device=dev, dtype=f64).reshape(t1 - t0, H, -1)
            r = ref[b, t0:t1].to(f64).reshape(t1 - t0, H, -1)
            d2, r2, bad = _block_sums(x, r)
            del x, r
            head[0] += d2.sum(0)
            head[1] += r2.sum(0)
            head[2] += bad.sum(0)
            idx = bin_index(torch.arange(t0, t1, device=dev), T, cu_seqlens, bins)
            per_tok = torch.stack([d2.sum(1), r2.sum(1), bad.sum(1), torch.ones_like(bad[:, 0])])
            pos.index_add_(1, idx, per_tok)
    p, h = pos.tolist(), head.tolist()
    return ([_round(_rel(p[0][i], p[1][i], p[2][i], p[3][i])) for i in range(bins)],
            [_round(_rel(h[0][j], h[1][j], h[2][j])) for j in range(H)])


def state_profile(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """rel_rmse per head of a state [N, heads, d1, d2]."""
    if tuple(out.shape) != tuple(ref.shape) or out.dim() < 2:
        raise ValueError(f"states must be [N, heads, ...] of one shape; got {tuple(out.shape)} and {tuple(ref.shape)}")
    N, H = out.shape[:2]
    dev, f64 = ref.device, torch.float64
    step = max(1, metrics.BLOCK // max(1, out[0].numel())) if N else 1
    head = torch.zeros(3, H, dtype=f64, device=dev)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        x = out[n0:n1].to(device=dev, dtype=f64).reshape(n1 - n0, H, -1)
        r = ref[n0:n1].to(f64).reshape(n1 - n0, H, -1)
        d2, r2, bad = _block_sums(x, r)
        head[0] += d2.sum(0)
        head[1] += r2.sum(0)
        head[2] += bad.sum(0)
    h = head.tolist()
    return [_round(_rel(h[0][j], h[1][j], h[2][j])) for j in range(H)]


def encode(values: list[float]) -> list:
    """Strict-JSON list: NaN -> None, +-inf -> 'inf' / '-inf'."""
    return [None if math.isnan(v) else ("inf" if v == math.inf else "-inf") if math.isinf(v) else v for v in values]


def decode(values) -> list[float] | None:
    """A stored list back to floats (None -> NaN, 'inf' -> inf); None for a missing value (an older row)."""
    if values is None or isinstance(values, float) or not hasattr(values, "__iter__") or isinstance(values, str):
        return None
    return [math.nan if v is None else float(v) for v in values]  # float("inf") reads the stored "inf"


def row_columns(tensor: str, out: torch.Tensor, ref: torch.Tensor, cu_seqlens=None) -> dict:
    """The columns this module adds to a row against fp64 for ``tensor`` (empty for tensors it does not cover)."""
    if tensor in POSITION_TENSORS and out.dim() >= 3:
        pos, head = token_profile(out, ref, cu_seqlens)
        return {"pos_rel_rmse": encode(pos), "head_rel_rmse": encode(head), "pos_convention": POS_CONVENTION}
    if tensor in STATE_TENSORS and out.dim() >= 2:
        return {"head_rel_rmse": encode(state_profile(out, ref))}
    return {}
