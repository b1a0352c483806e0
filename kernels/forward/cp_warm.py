"""Warm-up starts of the forward's CP segments: where a segment's start state is not needed.

Over chunk ``c`` the state maps as ``S -> Phi_c S + (inputs)`` with ``||Phi_c||_2 <= 2^L_c``,
``L_c = sum_t (g_t log2 e + log2 max(1, |1 - beta_t ||k_t||^2|))`` (``||k_t||`` after the in-kernel L2 norm):
each token's factor ``e^g_t (I - beta_t k_t k_t^T)``.  The intra kernel stores the chunk-local inclusive cumsum
of those terms as row 7 of the gate table ``F`` (so ``F[hv, c, 7, 63]`` is ``L_c``).

A segment ``j`` that is not its sequence's first takes ``w`` warm-up chunks, the fewest of at most
``WARM_CHUNKS`` before its start whose ``L`` sum to at most ``WARM_LOG2``: its kernel starts ``w`` chunks early
from a zero state (o written from the segment's own first chunk), which drops a term of norm at most
``2^WARM_LOG2`` times the state's there.  Warm-up that reaches the sequence's first chunk starts there from the
sequence's initial state (exact).  Where neither holds (slow decay) the segment's start state comes from the
exact scan and fp64 fix-up, which then run only for the segments before the last such segment of the sequence.

``co`` (the kernels' ``chunk_offsets`` argument, int32 ``[3 Nseg + 1]``): the segments' first global chunks
``[Nseg + 1]``, then each segment's sequence's first segment ``[Nseg]`` and last segment ``[Nseg]``.

The backward's reverse pass runs the same bound the other way (its chunk map is the forward one's transpose, of the
same norm): a segment that is not its sequence's last takes ``w`` warm-up chunks after its end, the fewest of at most
``WARM_CHUNKS`` whose ``L`` sum to at most ``WARM_LOG2``, starting there from a zero state gradient; where none do,
it runs on to the sequence's end, from the caller's end gradient (exact, ``warm_back_host``).
"""

import torch

BT = 64
WARM_CHUNKS = 16          # warm-up chunks of a segment at the most
WARM_LOG2 = -40.0         # log2 of the largest norm factor a warm-up start may drop
MAX_SEGMENTS = 16         # CP segments of a sequence at the most with warm-up starts (``ForwardPlan.cp``)

LOG2E = 1.4426950408889634


def warm_offsets(seg_co: list, seg_of: list) -> list:
    """The ``co`` table (module docstring) of the segments ``seg_co [Nseg + 1]`` (first chunks) of the sequences
    ``seg_of [N + 1]`` (each one's first segment)."""
    first, last = [], []
    for n in range(len(seg_of) - 1):
        for _ in range(seg_of[n], seg_of[n + 1]):
            first.append(seg_of[n])
            last.append(seg_of[n + 1] - 1)
    return list(seg_co) + first + last


def warm_chunks_host(L: torch.Tensor, co: list, j: int) -> torch.Tensor:
    """The warm-up chunks of segment ``j`` for every value head (``L [HV, NC]``: each chunk's ``L_c``): int64
    ``[HV]``, 0 for a sequence's first segment, -1 where the exact start state is needed."""
    Nseg = (len(co) - 1) // 3
    first = co[Nseg + 1 + j]
    w = torch.full((L.shape[0],), 0 if j == first else -1, dtype=torch.long)
    if j == first:
        return w
    a, b = co[j], co[first]
    return _reach_host(L, [a - i - 1 for i in range(min(WARM_CHUNKS, a - b))], a - b, w)


def warm_back_host(L: torch.Tensor, chunk_offsets: list, last: list, j: int) -> torch.Tensor:
    """The reverse pass's warm-up chunks after segment ``j`` for every value head (``L [HV, NC]``: each chunk's
    ``L_c``; ``chunk_offsets [Nseg + 1]``: the segments' first chunks; ``last [Nseg]``: each segment's sequence's
    last segment): int64 ``[HV]``, 0 for a sequence's last segment; where no ``WARM_CHUNKS`` chunks bring the bound
    down, the chunks left to the sequence's end (the exact start)."""
    e, end = chunk_offsets[j + 1], chunk_offsets[last[j] + 1]
    w = torch.full((L.shape[0],), 0 if e == end else -1, dtype=torch.long)
    w = _reach_host(L, [e + i for i in range(min(WARM_CHUNKS, end - e))], end - e, w)
    return torch.where(w < 0, torch.full_like(w, end - e), w)


def _reach_host(L: torch.Tensor, chunks: list, n: int, w: torch.Tensor) -> torch.Tensor:
    """The rule on ``w`` (int64 [HV], -1 where open): ``i + 1`` for the first ``i`` at which the bounds ``L[:,
    chunks[0]], .., L[:, chunks[i]]`` sum to at most ``WARM_LOG2`` or ``i`` is the last of the ``n`` chunks that
    reach the sequence's boundary (the macro ``reach``'s mirror)."""
    acc = torch.zeros(L.shape[0], dtype=torch.float32)
    for i, c in enumerate(chunks):
        open_ = w < 0
        acc = torch.where(open_, acc + L[:, c].to(torch.float32), acc)
        hit = open_ & ((acc <= WARM_LOG2) | (i == n - 1))
        w = torch.where(hit, torch.full_like(w, i + 1), w)
    return w


def warm_or_start_host(L: torch.Tensor, co: list, j: int) -> torch.Tensor:
    """``warm_chunks_host`` where no exact start state is at hand (the backward's recompute): -1 becomes the chunks
    back to the sequence's first one (the start from its initial state, exact).  ``co``: ``warm_offsets``' table."""
    Nseg = (len(co) - 1) // 3
    w = warm_chunks_host(L, co, j)
    return torch.where(w < 0, torch.full_like(w, co[j] - co[co[Nseg + 1 + j]]), w)


def chunk_log2_bounds(G: torch.Tensor, bc: torch.Tensor, rk: torch.Tensor, kk: torch.Tensor) -> torch.Tensor:
    """Row 7 of the gate table (fp32 values as float64): ``G log2 e + cumsum(log2 max(1, |1 - beta rk^2 kk|))``
    over the chunk, ``G, bc, rk, kk`` [HV, NC, 64] (the cumsum of g, beta, the L2 factors, ``||k||^2``; 0 past a
    sequence)."""
    f32 = torch.float32
    e = torch.log2(torch.clamp((1 - bc.to(f32) * rk.to(f32) * rk.to(f32) * kk.to(f32)).abs(), min=1.0))
    return (G.to(f32) * LOG2E + e.cumsum(-1)).to(torch.float64)


def _macros():
    import tilelang.language as T

    @T.macro
    def reach(lv, base, a, b, w, acc):
        """The rule on segment start ``a`` (sequence start ``b``), ``w[0]`` entering -1: ``i + 1`` for the first ``i
        < WARM_CHUNKS`` at which the bounds ``lv[base], .., lv[base + i]`` of chunks ``a - 1, .., a - i - 1`` sum
        to at most ``WARM_LOG2`` or chunk ``a - i - 1`` is ``b``; else left at -1.  ``acc``: local fp32 [1]."""
        acc[0] = T.float32(0)
        for i in T.unroll(WARM_CHUNKS):
            if w[0] < 0 and a - i - 1 >= b:
                acc[0] = acc[0] + lv[base + i]
                if acc[0] <= T.float32(WARM_LOG2) or a - i - 1 == b:
                    w[0] = i + 1

    @T.macro
    def warm_chunks(F, co, first_at, n, hv, w, acc, lv):
        """``w[0]``: the warm-up chunks of segment ``n`` for value head ``hv`` (0: a sequence's first segment;
        -1: the exact start state is needed); ``first_at`` = Nseg + 1 (where ``co`` holds the first segments);
        local scratch ``acc`` fp32 [1], ``lv`` fp32 [WARM_CHUNKS] (the bounds, loaded together first).  Every
        thread, uniform."""
        first = co[first_at + n]
        a = co[n]
        for i in T.unroll(WARM_CHUNKS):
            lv[i] = F[hv, T.max(a - i - 1, 0), 7, BT - 1]
        w[0] = T.if_then_else(n == first, 0, -1)
        reach(lv, 0, a, co[first], w, acc)

    @T.macro
    def exact_after(F, co, first_at, j0, count, hv, res, acc, wl_s, ca_s, base=0):
        """``res[0]``: 1 + the largest ``i < count`` whose segment ``j0 + i`` (all of one sequence, none its first)
        needs its exact start state, 0 if none (``count`` <= MAX_SEGMENTS); local scratch ``acc`` fp32 [1], shared
        ``wl_s`` fp32 [MAX_SEGMENTS WARM_CHUNKS] and ``ca_s`` int32 [MAX_SEGMENTS]: every bound and every segment's
        first chunk loaded first, one a thread, so that the decisions read shared memory alone.  Every thread,
        uniform.  ``base``: where the table starts in ``co`` (its entries and the segment ids in it relative to
        that)."""
        at = (lambda i: i) if isinstance(base, int) and base == 0 else (lambda i: base + i)  # noqa: E731
        for t in T.Parallel(MAX_SEGMENTS * WARM_CHUNKS):
            wl_s[t] = F[hv, T.max(co[at(j0 + T.min(t // WARM_CHUNKS, T.max(count - 1, 0)))] - t % WARM_CHUNKS - 1,
                                  0), 7, BT - 1]
        for t in T.Parallel(MAX_SEGMENTS):
            ca_s[t] = co[at(j0 + T.min(t, T.max(count - 1, 0)))]
        b = co[at(co[at(first_at + j0)])]      # the sequence's first chunk
        res[0] = 0
        for s in T.serial(MAX_SEGMENTS):
            if s < count:
                w = T.alloc_local((1,), "int32")
                w[0] = -1
                reach(wl_s, s * WARM_CHUNKS, ca_s[s], b, w, acc)
                if w[0] < 0:
                    res[0] = s + 1

    @T.macro
    def warm_span(Lb, hv, c0, step, n, w, acc, lv):
        """``w[0]``: the warm-up chunks ``c0, c0 + step, ..`` (``step`` +1 or -1) next to a segment, ``n`` of them
        before the sequence's boundary: the rule of ``reach`` on the bounds ``Lb [HV, NC]`` (each chunk's ``L_c``),
        0 where ``n`` is 0, ``n`` (the exact start at the boundary) where no ``WARM_CHUNKS`` chunks bring the bound
        down; local scratch ``acc`` fp32 [1], shared ``lv`` fp32 [WARM_CHUNKS] (the bounds, loaded together first,
        one a thread: no registers held for them).  Every thread, uniform (it ends with a barrier)."""
        for i in T.Parallel(WARM_CHUNKS):
            lv[i] = Lb[hv, T.max(c0 + step * T.min(i, n - 1), 0)]
        w[0] = T.if_then_else(n == 0, 0, -1)
        # the n chunks to the boundary, as ``reach`` counts the chunks back to a sequence's start
        reach(lv, 0, n, 0, w, acc)
        if w[0] < 0:
            w[0] = n
        T.sync_threads()        # every thread has read ``lv``: its memory may serve another tile now

    @T.macro
    def warm_after(Lb, hv, e, end, w, acc, lv):
        """``w[0]``: the reverse pass's warm-up chunks after a segment ending at chunk ``e`` (exclusive) of a
        sequence ending at chunk ``end`` (``warm_back_host``); ``warm_span``'s arguments."""
        warm_span(Lb, hv, e, 1, end - e, w, acc, lv)

    @T.macro
    def warm_or_start(Lb, hv, a, b, w, acc, lv):
        """``w[0]``: ``warm_or_start_host``'s chunks before a segment starting at chunk ``a`` of a sequence starting
        at chunk ``b``; ``warm_span``'s arguments."""
        warm_span(Lb, hv, a - 1, -1, a - b, w, acc, lv)

    return warm_chunks, exact_after, warm_after, warm_or_start


def macros():
    """The TileLang macros ``warm_chunks`` and ``exact_after`` (imports tilelang)."""
    return _macros()[:2]


def backward_macros():
    """The TileLang macros of the backward's segments, read from a bounds table ``Lb [HV, NC]``: ``warm_after``
    (the reverse pass's rule) and ``warm_or_start`` (the recompute's) (imports tilelang)."""
    return _macros()[2:]
