"""Segment-parallel ("CP") form of the backward's reverse pass for calls with few value heads (host side only: the
``gdn_bwd_dh`` kernel is unchanged, it runs on segments of the sequences as if they were sequences).

The reverse recurrence of one value head is affine in the state gradient, acting on its key rows:
``dS_{c-1} = M_c dS_c + b_c`` with ``M_c = e^GL I - K~^T diag(F0 beta) Tinv^T diag(F2) K~`` ([K, K]), and the value
columns of dS evolve independently.  Cut a sequence into segments at chunk boundaries.  Three launches of
``gdn_bwd_dh``, each over all segments at once (so with NSEG times the CTAs):

  A. every segment from a zero end gradient (the last segment of a sequence from the caller's dht): its start
     gradient ``a_j``;
  B. every segment from dht = I with dO = 0 and dUloc = 0 (so b = 0): its transfer matrix ``P_j = M_first ... M_last``
     (or, given, the forward CP scan's ``M_j^T`` over the same segments: ``M_c`` is the forward chunk map's
     transpose, so ``P_j`` is the transpose of the forward segment map);
  C. every segment from its true end gradient ``E_j`` (the host's scan below): every per-chunk output (dS' tables,
     dY, dv; they overwrite A's and B's) and, for each sequence's first segment, dh0.

The scan runs in fp64 from the last segment of each sequence backwards: ``E_last = dht``, the segment before the
last gets ``a_last``, and before that ``E_j = a_{j+1} + P_{j+1} E_{j+1}``.  The per-chunk arithmetic of pass C is the
sequential kernel's; only the state gradient entering a segment comes through the scan (from fp32 kernel results).
On the GPU the scan is one launch of the forward's fp64 walk (``gdn_cp_fixup``) over each sequence's segments in
reverse order: value-first, ``E_j^T = E_{j+1}^T P_{j+1}^T + a_{j+1}^T`` is the forward's ``S^T M^T + Z^T``.

The warm form (``BackwardPlan.dh_warm``) replaces passes A, B and the scan: one launch of ``gdn_bwd_dh_warm`` in
which every segment starts from its warm-up chunks after its end (``forward.cp_warm``'s bound run backwards,
``warm_back_host``) or runs on to its sequence's end (``warm_table``: the kernel's segment table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.forward.cp_warm import warm_offsets
from kernels.interface import unused

BT = 64
MIN_CHUNKS = 8          # chunks per segment at least: three passes must beat one
# chunks of the longest sequence at least: the three-pass form lost at B1 T8192 H4 HV8 (128 chunks) and won at B1
# T65536 H2 HV4 (1024 chunks).  The warm form at 64 (H100, baebdad) took B1 T8192 H4 HV8's backward from 0.78 to
# 0.41 ms under logsigmoid gates and to 1.16 under the qwen gates, whose slow-decay heads find no warm-up and run
# on to the sequence's end: 256 stays, between the measured points, not a measured crossover.
MIN_SEQ_CHUNKS = 256


@dataclass(frozen=True)
class SegmentPlan:
    """The segments of one call's sequences (host lists; ``plan_tensors`` makes the device tables).

    cu [NS + 1]: token boundaries (inner ones at chunk boundaries), chunk_offsets [NS + 1]: the global index of each
    segment's first chunk (the original layout's chunk numbering), seq [NS]: the sequence of each segment, first [N]
    / last [N]: each sequence's first / last segment (an empty sequence has one empty segment)."""
    cu: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    seq: tuple[int, ...]
    first: tuple[int, ...]
    last: tuple[int, ...]

    @property
    def n_segments(self) -> int:
        return len(self.seq)


def plan(cu_host: list[int], HV: int, n_value_blocks: int, n_sms: int) -> SegmentPlan | None:
    """The segments for sequences ``cu_host`` (token boundaries), or None when the sequential pass already has
    about half the SMs' worth of CTAs (N x HV x value blocks), when no sequence has ``MIN_SEQ_CHUNKS`` chunks, or
    when none is long enough to cut into at least four segments of ``MIN_CHUNKS`` chunks."""
    N = len(cu_host) - 1
    ctas = N * HV * n_value_blocks
    if ctas * 2 >= n_sms:
        return None
    want = n_sms // ctas                                         # segments per sequence for about one wave
    nch = [-(-(cu_host[n + 1] - cu_host[n]) // BT) for n in range(N)]
    if max(nch, default=0) < MIN_SEQ_CHUNKS:
        return None
    segs = [max(1, min(want, c // MIN_CHUNKS)) for c in nch]
    if max(segs) < 4:
        return None
    cu, offs, seq, first, last = [0], [0], [], [], []
    for n in range(N):
        first.append(len(seq))
        s, c, bos, eos = segs[n], nch[n], cu_host[n], cu_host[n + 1]
        bounds = [(c * i) // s for i in range(s + 1)]              # chunk boundaries, as even as they come
        for i in range(s):
            seq.append(n)
            cu.append(eos if i == s - 1 else bos + bounds[i + 1] * BT)
            offs.append(offs[-1] + bounds[i + 1] - bounds[i])
        last.append(len(seq) - 1)
    return SegmentPlan(tuple(cu), tuple(offs), tuple(seq), tuple(first), tuple(last))


@dataclass(frozen=True)
class PlanTensors:
    """A plan's device tables, built once per layout and device (``api`` caches them; an index tensor built from a
    host list at call time would be a pageable copy, which waits for the stream)."""
    cu: torch.Tensor                # [NS + 1] int32
    chunk_offsets: torch.Tensor     # [NS + 1] int32
    last: torch.Tensor              # [N] int64
    first: torch.Tensor             # [N] int64
    seg_of: torch.Tensor            # [N + 1] int32: each sequence's first segment, then NS
    steps: tuple                    # ((js, successors) int64 tensors, successor-is-last flag) by distance from the end
    rev: torch.Tensor               # [NS] int64: each sequence's segments in reverse order (an involution)
    warm_co: torch.Tensor           # [4 NS + 1] int32: ``warm_table``


def plan_tensors(p: SegmentPlan, dev) -> PlanTensors:
    """The device tables of plan ``p``."""
    by_dist: dict[int, list[int]] = {}
    for j in range(p.n_segments):
        by_dist.setdefault(p.last[p.seq[j]] - j, []).append(j)
    steps = []
    for d in sorted(by_dist):
        if d == 0:
            continue
        js = by_dist[d]
        steps.append((torch.tensor(js, device=dev), torch.tensor([j + 1 for j in js], device=dev), d == 1))

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=dev)

    rev = [p.first[p.seq[j]] + p.last[p.seq[j]] - j for j in range(p.n_segments)]
    return PlanTensors(i32(p.cu), i32(p.chunk_offsets), torch.tensor(p.last, device=dev),
                       torch.tensor(p.first, device=dev), i32(list(p.first) + [p.n_segments]), tuple(steps),
                       torch.tensor(rev, device=dev), i32(warm_table(p)))


def warm_table(p: SegmentPlan) -> list:
    """The warm forms' ``chunk_offsets`` of plan ``p`` (``gdn_bwd_dh_warm``, the recompute's
    ``gdn_state_tables_ws`` with warm-up starts): ``cp_warm``'s table of the segments (their first chunks ``[NS +
    1]``, each one's sequence's first and last segment ``[NS]`` each), then each segment's sequence ``[NS]``."""
    return warm_offsets(list(p.chunk_offsets), list(p.first) + [p.n_segments]) + list(p.seq)


def end_gradients(t: PlanTensors, a: torch.Tensor, P: torch.Tensor, dht: torch.Tensor | None,
                  walk=None) -> torch.Tensor:
    """E [NS, HV, K, V] fp32: the true gradient at the end of every segment, from pass A's start gradients ``a``
    [NS, HV, K, V], pass B's transfer matrices ``P`` [NS, HV, K, K] (fp32; each sequence's last one not read) and
    the caller's ``dht`` [N, HV, K, V] (key-first, fp32; None = 0).  fp64, no host sync.  ``walk``: the
    ``gdn_cp_fixup`` kernel of K = V (one launch, ``walk_ends``); None: torch, one batched step per segment
    position from the end."""
    if walk is not None:
        return walk_ends(t, a, P, dht, walk)
    f64 = torch.float64
    E = torch.zeros(a.shape, dtype=f64, device=a.device)
    if dht is not None:
        E[t.last] = dht.to(f64)
    a64, P64 = a.to(f64), P.to(f64)
    for js, nxt, succ_is_last in t.steps:
        if succ_is_last:                 # the last segment's start gradient is already the true one
            E[js] = a64[nxt]
        else:
            E[js] = a64[nxt] + P64[nxt] @ E[nxt]
    return E.to(torch.float32)


def walk_ends(t: PlanTensors, a: torch.Tensor, P: torch.Tensor, dht: torch.Tensor | None, walk) -> torch.Tensor:
    """``end_gradients`` by the forward's fp64 walk ``walk`` (``gdn_cp_fixup``, K = V = D): its segments are each
    sequence's in reverse order, its table ``[a_j^T ; P_j^T]`` (``[Z^T ; M^T]``) with P = 0 at each sequence's last
    segment (whose ``a`` already holds dht's part) and its start state dht."""
    NS, HV, D = a.shape[0], a.shape[1], a.shape[-1]
    assert a.shape[-2] == D == P.shape[-1], "the walk is the K = V kernel's"
    tbl = torch.empty(NS, HV, 2, D, D, device=a.device, dtype=torch.float32)
    tbl.copy_(torch.stack((a, P), 2).index_select(0, t.rev).transpose(-1, -2))
    # each sequence's last segment, first in the reversed order (a fill by scalar: no host tensor to copy over)
    tbl[:, :, 1].index_fill_(0, t.first, 0.0)
    out = torch.empty_like(a)
    gates = unused((HV, 1, 8, BT), torch.float32, a.device)       # read only by the walk's warm form
    vf = dht is not None and not dht.is_contiguous() and dht.transpose(-1, -2).is_contiguous()
    h0 = a if dht is None else (dht.transpose(-1, -2) if vf else dht.contiguous())     # a: not read
    walk(tbl.view(NS, HV, 2 * D, D), h0, t.seg_of, t.seg_of, gates, out, int(dht is not None), int(vf))
    return out.index_select(0, t.rev).transpose(-1, -2).contiguous()
