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
``WARM_CHUNKS`` whose ``L`` sum to at most ``WARM_LOG2``, starting there from a zero state gradient, or (reaching the
sequence's end) from the caller's end gradient (``warm_back_host``).  Where none do, the segment's pass is idle and
the pass of the next segment runs on through it (``back_cover_host``): each chunk runs once, in the pass of the first
segment after it (its own included) whose end takes a warm-up, exact through every segment boundary between.  The
backward's recompute does the same forwards (``warm_or_start_host``, ``fwd_cover_host``): a segment starts from its
warm-up chunks or, reaching its sequence's first chunk, from the initial state; where neither holds, the previous
segment's pass runs on through it.
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
    last segment): int64 ``[HV]``, 0 for a sequence's last segment, the chunks left to its end where the rule
    reaches it, -1 where no ``WARM_CHUNKS`` chunks bring the bound down (the pass of segment ``j`` is idle: a later
    segment's pass covers its chunks, ``back_cover_host``)."""
    e, end = chunk_offsets[j + 1], chunk_offsets[last[j] + 1]
    w = torch.full((L.shape[0],), 0 if e == end else -1, dtype=torch.long)
    return _reach_host(L, [e + i for i in range(min(WARM_CHUNKS, end - e))], end - e, w)


def back_cover_host(L: torch.Tensor, chunk_offsets: list, first: list, last: list, j: int) -> torch.Tensor:
    """The first segment whose chunks the reverse pass of segment ``j`` covers, for every value head: int64
    ``[HV]``, ``j`` and then each segment before it (down to its sequence's first, ``first [Nseg]``) whose pass is
    idle (``warm_back_host`` -1).  Where segment ``j``'s own pass is idle the value is not read."""
    s = torch.full((L.shape[0],), j, dtype=torch.long)
    for m in range(j - 1, first[j] - 1, -1):
        s = torch.where((s == m + 1) & (warm_back_host(L, chunk_offsets, last, m) < 0), torch.full_like(s, m), s)
    return s


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
    """The recompute's chunks before segment ``j`` for every value head (``co``: ``warm_offsets``' table):
    ``warm_chunks_host``'s (0 for a sequence's first segment, the chunks back to its first one where the rule reaches
    it: the start from its initial state), -1 where the exact start state would be needed (the pass of segment ``j``
    is idle: an earlier segment's pass covers its chunks, ``fwd_cover_host``)."""
    return warm_chunks_host(L, co, j)


def fwd_cover_host(L: torch.Tensor, co: list, j: int) -> torch.Tensor:
    """One past the last segment whose chunks the recompute's pass of segment ``j`` covers, for every value head:
    int64 ``[HV]``, ``j + 1`` and then past each segment after it (up to its sequence's last) whose pass is idle
    (``warm_or_start_host`` -1).  ``co``: ``warm_offsets``' table."""
    Nseg = (len(co) - 1) // 3
    e = torch.full((L.shape[0],), j + 1, dtype=torch.long)
    for m in range(j + 1, co[2 * Nseg + 1 + j] + 1):
        e = torch.where((e == m) & (warm_chunks_host(L, co, m) < 0), torch.full_like(e, m + 1), e)
    return e


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
    def warm_after(Lb, hv, e, end, w, acc, lv):
        """``w[0]``: the reverse pass's warm-up chunks after a segment ending at chunk ``e`` (exclusive) of a
        sequence ending at chunk ``end``, -1 where none (``warm_back_host``), from ``Lb [HV, NC]`` (each chunk's
        ``L_c``); local scratch ``acc`` fp32 [1], shared ``lv`` fp32 [WARM_CHUNKS] (the bounds, loaded together
        first, one a thread: no registers held for them).  Every thread, uniform (it ends with a barrier)."""
        for i in T.Parallel(WARM_CHUNKS):
            lv[i] = Lb[hv, T.max(T.min(e + i, end - 1), 0)]
        w[0] = T.if_then_else(e == end, 0, -1)
        # the end - e chunks left to the sequence's end, as ``reach`` counts the chunks back to its start
        reach(lv, 0, end - e, 0, w, acc)
        T.sync_threads()        # every thread has read ``lv``: its memory may serve another tile now

    @T.macro
    def back_cover(Lb, hv, co, n, first, end, s, wm, acc, lv):
        """``s[0]``: ``back_cover_host``'s first segment covered by the reverse pass of segment ``n`` (of a sequence
        whose first segment is ``first`` and whose chunks end at ``end``; ``co`` the segments' first chunks), one
        ``warm_after`` a segment before ``n`` until one takes a warm-up; local scratch ``wm`` int32 [1], ``acc``
        fp32 [1], shared ``lv`` fp32 [WARM_CHUNKS].  Every thread, uniform."""
        s[0] = n
        for i in T.serial(n - first):
            if s[0] == n - i:       # segments n - i .. n covered so far: is the one before idle too?
                warm_after(Lb, hv, co[n - i], end, wm, acc, lv)
                if wm[0] < 0:
                    s[0] = n - i - 1

    @T.macro
    def warm_or_start(Lb, hv, a, b, w, acc, lv):
        """``w[0]``: ``warm_or_start_host``'s chunks before a segment starting at chunk ``a`` of a sequence starting
        at chunk ``b`` (-1 where none), from ``Lb [HV, NC]`` (each chunk's ``L_c``); local scratch ``acc`` fp32 [1],
        shared ``lv`` fp32 [WARM_CHUNKS] (the bounds, loaded together first, one a thread).  Every thread, uniform
        (it ends with a barrier)."""
        for i in T.Parallel(WARM_CHUNKS):
            lv[i] = Lb[hv, T.max(a - i - 1, 0)]
        w[0] = T.if_then_else(a == b, 0, -1)
        reach(lv, 0, a, b, w, acc)
        T.sync_threads()        # every thread has read ``lv``: its memory may serve another tile now

    @T.macro
    def fwd_cover(Lb, hv, co, n, last, b, e, wm, acc, lv):
        """``e[0]``: ``fwd_cover_host``'s segment one past the last covered by the recompute's pass of segment
        ``n`` (of a sequence whose last segment is ``last`` and whose first chunk is ``b``; ``co`` the segments'
        first chunks), one ``warm_or_start`` a segment after ``n`` until one takes a warm-up; local scratch ``wm``
        int32 [1], ``acc`` fp32 [1], shared ``lv`` fp32 [WARM_CHUNKS].  Every thread, uniform."""
        e[0] = n + 1
        for i in T.serial(last - n):
            if e[0] == n + 1 + i:   # segments n .. n + i covered so far: is the next one idle too?
                warm_or_start(Lb, hv, co[n + 1 + i], b, wm, acc, lv)
                if wm[0] < 0:
                    e[0] = n + 2 + i

    return warm_chunks, exact_after, warm_after, back_cover, warm_or_start, fwd_cover


def macros():
    """The TileLang macros ``warm_chunks`` and ``exact_after`` (imports tilelang)."""
    return _macros()[:2]


def backward_macros():
    """The TileLang macros of the backward's segments, read from a bounds table ``Lb [HV, NC]``: ``warm_after``
    and ``back_cover`` (the reverse pass's rule and cover), ``warm_or_start`` and ``fwd_cover`` (the recompute's)
    (imports tilelang)."""
    return _macros()[2:]
