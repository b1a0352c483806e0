"""``gdn_bwd_dqk``: the inter-chunk (state) and intra-chunk (64x64) gradients of q, k, g, beta of one chunk and
value head; grid (chunk, value head), 256 threads (two warpgroups; each product's output columns split between
them), at K = V = 128 or 64.

* dq~ and dk~ stay in two [64, DK] fp32 fragments: the inter terms are folded in after their row dots, the intra
  products accumulate onto them by wgmma, and each element is stored once (per value head, or as the sums of a GVA
  group of 2, 4 or 8 value heads exchanged across a thread-block cluster).
* the products are ordered so that the tiles die early (one CTA of eight warps per SM): the S o dS' row dots
  (S, dS' hi + lo: 128 KiB), R = U dS'^T (then dS' dies), Z = dO S^T, W = dY S^T (then S dies), the dY . v dots,
  then the 64x64 terms (q, k, dO, U, dY and the 64x64 operand tiles).
* every tile arrives by TMA, issued by the first warp: q, k, S, dS', U, dO and the gates at the start, all in
  flight together (about 210 KiB at DK = DV = 128 with fp8 lo tables); dY and v once dS' is dead, into its memory.
* the S o dS' dots: thread ``tx < 2 DV`` sums value column ``tx % DV`` over key rows ``(tx // DV) * DK/2 ..``
  (the two halves go to ``sd[0]`` and ``sd[1]``).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.lo8 import LO8, widen_lo8
from kernels.common.prologue import chunk_span, dynamic_dims, lo_shape
from kernels.forward.cumsum import LOG2E

from .dqk_terms import BT, half_row_dots, intra_terms, rect_sums, split_dot_rows, v_dy_half_row_dots
from .scales import times

# two warpgroups at either head dim: at DK 64 one warpgroup would hold every 64x64 fp32 fragment alone (twice the
# registers a thread: spills)
THREADS = 256


class _HeadTiles:
    """The shared tiles of one value head's pass (a Python object, so that ``value_head`` can name them)."""

    def __init__(self, DK, DV, dtype, s_lo, lo8, one=False):
        f32 = "float32"
        if lo8:
            self.c8 = T.alloc_local((8,), LO8)         # 8 fp8 codes on their way to a widened lo tile
        self.f_s = T.alloc_shared((8, BT), f32)
        self.sh = T.alloc_shared((DK, DV), dtype)
        self.sl = T.alloc_shared(lo_shape((DK, DV), s_lo), dtype)     # an unread placeholder without S lo
        self.dsh = T.alloc_shared((DV, DK), dtype)
        self.dsl = T.alloc_shared(lo_shape((DV, DK), not one), dtype)     # placeholders with ``one``
        self.do = T.alloc_shared((BT, DV), dtype)
        self.v = T.alloc_shared((BT, DV), dtype)
        self.uh = T.alloc_shared((BT, DV), dtype)
        self.ul = T.alloc_shared(lo_shape((BT, DV), not one), dtype)
        self.dyh = T.alloc_shared((DV, BT), dtype)
        self.dyl = T.alloc_shared(lo_shape((DV, BT), not one), dtype)
        # the 64x64 operands, single: hi tiles at even indices, the odd ones 8x8 placeholders, neither written nor
        # read (``intra_terms(mlo=False)``)
        self.m = [T.alloc_shared(lo_shape((BT, BT), i % 2 == 0), dtype) for i in range(8)]
        # 8 padding columns (neither stored nor summed: the row prefix sums scan m_s[:, 0:64]), so that the
        # fragment's stores do not hit one bank from 8 rows at once
        self.m_s = T.alloc_shared((BT, BT + 8), f32)
        self.part = T.alloc_shared((THREADS // BT, BT), f32)    # the dg rectangle sums' column walk by 4 x 64 threads


@T.macro
def value_head(ts, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, q_s, k_s, dq_f, dk_f, x_f, rs, qk, kk, dpu,
               dyu, y_f, rs2, t2, r2, t2b, r2b, acc, xh, xl, tx, ld, qz, kw, kr, sd, yv, rect, db2, hv, c, t0, nv,
               scale, s_lo, lo8, e_f=None, masked=False, one=False):
    """Value head ``hv``'s inter and intra terms of chunk ``c`` (tiles ``ts``, a ``_HeadTiles``): its row dots,
    dg / dbeta terms to global memory, and its dq~, dk~ added to the fragments ``dq_f, dk_f [64, DK]`` fp32.
    The q.Z, k.W, k.R and dY . v row dots go out as two halves (``half_row_dots``, fragments ``t2, r2``) into
    ``qz, kw, kr, yv [2, HV, NC, 64]``, the dbeta row sums likewise into ``db2`` (``intra_terms``, fragments
    ``t2b, r2b``).  ``s_lo`` (a Python bool): S is hi + lo, else its hi term alone (Scl not read); ``lo8``: the lo
    terms ``Scl``, ``dSl`` are fp8 codes, widened to the input dtype in shared memory (``kernels.common.lo8``).

    The tiles arrive by TMA copies, issued by the first warp: S, dS' and the gates (barrier ``ld[0]``), U
    (``ld[1]``) and dO (``ld[2]``) at the start, all in flight together; dY and v (``ld[3]``) once dS' is dead
    (their tiles may take its memory).  ``ld[4]``: q and k (the kernel's).  ``e_f``: ``intra_terms``' gate
    fragment (None: none); ``masked``: ``widen_lo8``'s; ``one``: U, dY and dS' their hi terms alone (``Ul, dYl,
    dSl`` not read; with ``s_lo`` False and ``lo8`` False)."""
    dtype = ts.sh.dtype
    DK = dq_f.shape[1]
    DV = ts.sh.shape[1]
    if tx < 32:
        T.tma_copy(Fb[hv, c, 0:8, 0:BT], ts.f_s, barrier=ld[0])
        T.tma_copy(Sch[hv, c, 0:DK, 0:DV], ts.sh, barrier=ld[0])
        T.tma_copy(dSh[hv, c, 0:DV, 0:DK], ts.dsh, barrier=ld[0])
        if not lo8:
            if s_lo:
                T.tma_copy(Scl[hv, c, 0:DK, 0:DV], ts.sl, barrier=ld[0])
            if not one:
                T.tma_copy(dSl[hv, c, 0:DV, 0:DK], ts.dsl, barrier=ld[0])
        T.barrier_arrive(ld[0])
        T.tma_copy(Uh[hv, c, 0:BT, 0:DV], ts.uh, barrier=ld[1])
        if not one:
            T.tma_copy(Ul[hv, c, 0:BT, 0:DV], ts.ul, barrier=ld[1])
        T.barrier_arrive(ld[1])
        T.tma_copy(do[t0:t0 + BT, hv, 0:DV], ts.do, barrier=ld[2])
        T.barrier_arrive(ld[2])
    # 1. the S o dS' row dots (S hi (+ lo), dS' hi + lo)
    T.barrier_wait(ld[0], 0)
    if lo8:
        if s_lo:
            widen_lo8(Scl, hv, c, ts.sh, ts.sl, tx, ts.c8, xl, THREADS, masked)
        widen_lo8(dSl, hv, c, ts.dsh, ts.dsl, tx, ts.c8, xl, THREADS, masked)
    acc[0] = T.float32(0)
    if tx < 2 * DV:
        split_dot_rows(ts.sh, ts.sl if s_lo else None, ts.dsh, None if one else ts.dsl, acc, tx % DV, xh, xl,
                       (tx // DV) * (DK // 2), DK // 2)
        sd[tx // DV, hv, c, tx % DV] = acc[0]
    # 2. R = U dS'^T (U, dS' hi + lo) -> dk~ += e^(GL-G) R, the k.R dots
    T.barrier_wait(ld[1], 0)
    T.barrier_wait(ld[4], 0)
    T.gemm(ts.uh, ts.dsh, x_f, clear_accum=True)
    if not one:
        T.gemm(ts.ul, ts.dsh, x_f)
        T.gemm(ts.uh, ts.dsl, x_f)
    # dS' is dead: dY and v may land in its memory once both warpgroups have read it
    T.sync_threads()
    if tx < 32:
        T.fence_proxy_async()
        T.tma_copy(dYh[hv, c, 0:DV, 0:BT], ts.dyh, barrier=ld[3])
        if not one:
            T.tma_copy(dYl[hv, c, 0:DV, 0:BT], ts.dyl, barrier=ld[3])
        T.tma_copy(v[t0:t0 + BT, hv, 0:DV], ts.v, barrier=ld[3])
        T.barrier_arrive(ld[3])
    for t, d in T.Parallel(BT, DK):
        dk_f[t, d] = dk_f[t, d] + T.exp2((ts.f_s[4, BT - 1] - ts.f_s[4, t]) * LOG2E) * x_f[t, d]
    half_row_dots(x_f, k_s, t2, r2, nv, kr, hv, c)
    # 3. Z = dO S^T (S hi (+ lo)) -> dq~ += scale e^G Z, the q.Z dots
    T.barrier_wait(ld[2], 0)
    T.gemm(ts.do, ts.sh, x_f, transpose_B=True, clear_accum=True)
    if s_lo:
        T.gemm(ts.do, ts.sl, x_f, transpose_B=True)
    for t, d in T.Parallel(BT, DK):
        dq_f[t, d] = dq_f[t, d] + scale * T.exp2(ts.f_s[4, t] * LOG2E) * x_f[t, d]
    half_row_dots(x_f, q_s, t2, r2, nv, qz, hv, c)
    # 4. W = dY S^T (dY hi + lo, S hi (+ lo)) -> dk~ -= beta e^G W, the k.W dots; then the dY . v dots
    T.barrier_wait(ld[3], 0)
    T.gemm(ts.dyh, ts.sh, x_f, transpose_A=True, transpose_B=True, clear_accum=True)
    if not one:
        T.gemm(ts.dyl, ts.sh, x_f, transpose_A=True, transpose_B=True)
    if s_lo:
        T.gemm(ts.dyh, ts.sl, x_f, transpose_A=True, transpose_B=True)
    for t, d in T.Parallel(BT, DK):
        dk_f[t, d] = dk_f[t, d] - ts.f_s[7, t] * T.exp2(ts.f_s[4, t] * LOG2E) * x_f[t, d]
    half_row_dots(x_f, k_s, t2, r2, nv, kw, hv, c)
    v_dy_half_row_dots(ts.v, ts.dyh, None if one else ts.dyl, t2, r2, nv, yv, hv, c)
    # 5. the 64x64 terms, accumulated onto dq~ / dk~
    m = ts.m
    intra_terms(q_s, k_s, ts.do, ts.uh, None if one else ts.ul, ts.dyh, None if one else ts.dyl, ts.f_s, m[0], m[2],
                m[4], m[6], ts.m_s, qk, kk, dpu, dyu, y_f, dq_f, dk_f, db2, t2b, r2b, nv, hv, c, scale, e_f)
    rect_sums(ts.m_s, acc, rect, ts.part, hv, c)


@T.macro
def store_rows(xq, xk, dq32, dk32, dqo, dko, t0, r0, col, nv, out32, dtype, factor=None):
    """Rows ``r0 + t`` of the chunk (``t`` over the R rows of ``xq, xk [R, DK]``, fp32 fragments; those below ``nv``)
    to token rows ``t0 + r0 + t``, head column ``col``: fp32 (``dq32, dk32``) when ``out32``, else rounded to the
    input dtype (``dqo, dko``); times ``factor`` (a power of two, fp32) where given.  Every dq~ / dk~ store of the
    kernel (per value head: ``r0 = 0``; a cluster's group sums: its rank's rows)."""
    R = xq.shape[0]
    DK = xq.shape[1]
    if out32 == 0:
        for t, d in T.Parallel(R, DK):
            if r0 + t < nv:
                dqo[t0 + r0 + t, col, d] = T.cast(times(xq[t, d], factor), dtype)
                dko[t0 + r0 + t, col, d] = T.cast(times(xk[t, d], factor), dtype)
    else:
        for t, d in T.Parallel(R, DK):
            if r0 + t < nv:
                dq32[t0 + r0 + t, col, d] = times(xq[t, d], factor)
                dk32[t0 + r0 + t, col, d] = times(xk[t, d], factor)


@T.macro
def cluster_group_sum(dq_f, dk_f, stage, inbox, bar, dq32, dk32, dqo, dko, h, t0, nv, out32, dtype, factor=None):
    """The GVA group's dq~ and dk~ summed across the cluster (one CTA per value head of the group, rank r = value
    head r of the group), a reduce-scatter through distributed shared memory: each CTA stages its two fragments
    (``stage [64, 2, DK]`` fp32), every CTA's rows ``[s R, (s + 1) R)`` go to CTA s's ``inbox [G, R, 2, DK]`` slot r
    by an SM-to-SM bulk copy (``R = 64 / G``; ``stage`` and ``inbox`` may have padding columns past DK, copied
    along), and CTA s sums its slots in the order r = 0 .. G - 1 (the order of
    ``gdn_bwd_group_sum``, so the sums are bitwise the same) and stores rows ``[s R, (s + 1) R)`` of the group's
    q/k head ``h``: fp32 (``dq32, dk32 [Ttot, H, DK]``) when ``out32``, else the input dtype (``dqo, dko``), times
    ``factor`` where given (``store_rows``).
    The first cluster barrier keeps a CTA's inbox (placed over its dead tiles) unwritten until it has finished
    computing; the last keeps each CTA's stage alive until every copy has landed."""
    G = inbox.shape[0]
    R = inbox.shape[1]
    DK = dq_f.shape[1]
    r = T.block_rank_in_cluster()
    T.copy(dq_f, stage[:, 0, 0:DK])
    T.copy(dk_f, stage[:, 1, 0:DK])
    T.fence_proxy_async()
    T.cluster_sync()
    for s in range(G):
        T.copy_cluster(stage[s * R:(s + 1) * R, :, :], inbox[r, :, :, :], dst_block=s, remote_barrier=bar[0])
    T.mbarrier_wait_parity(bar[0], 0)
    aq_f = T.alloc_fragment((R, DK), "float32")
    ak_f = T.alloc_fragment((R, DK), "float32")
    T.copy(inbox[0, :, 0, 0:DK], aq_f)
    T.copy(inbox[0, :, 1, 0:DK], ak_f)
    for j in T.serial(G - 1):
        for t, d in T.Parallel(R, DK):
            aq_f[t, d] = aq_f[t, d] + inbox[j + 1, t, 0, d]
            ak_f[t, d] = ak_f[t, d] + inbox[j + 1, t, 1, d]
    store_rows(aq_f, ak_f, dq32, dk32, dqo, dko, t0, r * R, h, nv, out32, dtype, factor)
    T.cluster_sync()


def build_bwd_dqk(DK: int, DV: int, dtype: str, group: int = 1, s_lo: bool = True, lo8: bool = False,
                  e_once: bool = False, exp_mask: bool = False, one: bool = False, io: str = ""):
    """Grid (chunk, value head).  With ``group == 1`` dq~ and dk~ leave the kernel in one of two ways, by ``out32``:

    * fp32 per value head (``dq32, dk32``), summed per group by ``gdn_bwd_group_sum`` (groups of two or more, or the
      L2 norm's chain rule on the host);
    * rounded to the input dtype (``dqo, dko``): the final dq, dk (groups of one value head, no L2 norm).

    With ``group`` in ``CLUSTER_GROUPS`` (= HV / H) the grid runs in clusters of ``group`` CTAs along the value
    heads (one GVA group of one chunk per cluster) and the kernel stores the group sums itself
    (``cluster_group_sum``): ``dq32, dk32, dqo, dko`` are then [Ttot, H, DK], fp32 when ``out32`` (the L2 norm's
    chain rule follows on the host), else the final dq, dk in the input dtype; no per-value-head rows, no
    ``gdn_bwd_group_sum`` pass.

    ``s_lo``: the recomputed chunk-start state S is hi + lo (``Scl`` read), else its hi term alone (``Scl`` an unread
    placeholder; 32 KiB less shared memory at DK = DV = 128, two products and one load fewer).  ``lo8``: ``Scl`` and
    ``dSl`` are fp8 e4m3 codes under their hi terms' exponents (``kernels.common.lo8``), widened in shared memory.
    ``e_once``: the intra terms' ``e^(G_t - G_j)`` formed once a chunk in a fragment, not at each of its four uses
    (the same values: ``BwdConfig.e_once``).  ``exp_mask``: the fp8 lo tiles widened with ``lo8_value``'s masked
    power of two (the same values: ``BwdConfig.exp_mask``).  ``one``: every table one term (S, U, dS', dY hi alone;
    ``Scl, Ul, dSl, dYl`` not read; needs ``s_lo`` and ``lo8`` False): 3 state products and 8 64x64 ones a chunk
    instead of 8 and 11, dq~, dk~ stored times ``factors[1, hv]`` (the one-term backward's powers of two undone,
    ``backward.scales``).  ``io``: the dtype of ``dqo, dko`` where it is not ``dtype`` (the caller's, its inputs
    converted to ``dtype`` for the kernels).

    The four 64x64 operands of the intra terms are single (``intra_terms(mlo=False)``).  The shared tiles whose
    per-thread accesses would be bank conflicts are laid out without them (``kernels.common.bank_conflicts``), the
    same values in the same order: the v tile of the dY . v dots swizzled, the dg summands' fp32 tile ``m_s`` with 8
    padding columns written by one fragment copy, the cluster's ``stage`` and ``inbox`` rows with 4 padding columns.

    Arguments (``qz, kw, kr, yv`` with the two halves of the column dim apart, ``half_row_dots``; ``sd`` with two
    halves of the key dim):
      q, k            [Ttot, H, DK]     dtype
      v, do           [Ttot, HV, DV]    dtype
      Sch, Scl        [HV, NC, DK, DV]  dtype  (forward recompute, key-first; Scl read only when s_lo, fp8 with lo8)
      Uh, Ul          [HV, NC, 64, DV]  dtype
      dSh, dSl        [HV, NC, DV, DK]  dtype  (gdn_bwd_dh, value-first; dSl fp8 with lo8)
      dYh, dYl        [HV, NC, DV, 64]  dtype
      Fb              [HV, NC, 8, 64]   fp32
      cu_seqlens [N + 1], chunk_indices [NC, 2] int32
      dq32, dk32      [Ttot, HV, DK]    fp32   (out when out32: every valid row)
      dqo, dko        [Ttot, HV, DK]    dtype  (out unless out32)
      qz, kw, kr, yv  [2, HV, NC, 64]   fp32   (out)
      db2             [2, HV, NC, 64]   fp32   (out; the intra dbeta row sums by halves, ``intra_terms``)
      sd              [2, HV, NC, DV]   fp32   (out)
      rect            [HV, NC, 64]      fp32   (out)
      scale fp32, out32 int32
      factors         [2, HV]           fp32   (read by the one form alone)
    """
    assert DK == DV and DV in (64, 128), "the S o dS' dots (2 DV threads, halves of the key rows) need K = V"
    assert group in (1, 2, 4, 8), group
    assert not (one and (s_lo or lo8)), "one (every table one term) reads no S lo table and no fp8 lo tiles"
    f32 = "float32"
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")
    HO = H if group > 1 else HV
    odt = io or dtype
    launch = {"cluster_dims": (1, group, 1)} if group > 1 else {}

    @T.macro
    def body(q, k, v, do, Sch, Scl, Uh,
             Ul, dSh, dSl, dYh, dYl, Fb, cu_seqlens, chunk_indices,
             dq32, dk32, dqo, dko, qz, kw, kr, sd,
             yv, rect, db2, scale, out32, factors):
        with T.Kernel(NC, HV, threads=THREADS, **launch) as g:
            c, hv = g[0], g[1]
            h = hv // group if group > 1 else hv // (HV // H)    # a cluster's group size is known
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            ts = _HeadTiles(DK, DV, dtype, s_lo, lo8, one)
            T.annotate_layout({ts.v: make_swizzled_layout(ts.v)})
            dq_f = T.alloc_fragment((BT, DK), f32)
            dk_f = T.alloc_fragment((BT, DK), f32)
            x_f = T.alloc_fragment((BT, DK), f32)
            rs = T.alloc_fragment((BT,), f32)
            qk = T.alloc_fragment((BT, BT), f32)
            kk = T.alloc_fragment((BT, BT), f32)
            dpu = T.alloc_fragment((BT, BT), f32)
            dyu = T.alloc_fragment((BT, BT), f32)
            y_f = T.alloc_fragment((BT, BT), f32)
            e_f = T.alloc_fragment((BT, BT), f32) if e_once else None
            rs2 = T.alloc_fragment((BT,), f32)
            t2 = T.alloc_fragment((2, BT, DK // 2), f32)
            r2 = T.alloc_fragment((2, BT), f32)
            t2b = T.alloc_fragment((2, BT, BT // 2), f32)
            r2b = T.alloc_fragment((2, BT), f32)
            acc = T.alloc_local((1,), f32)
            xh = T.alloc_local((8,), dtype)
            xl = T.alloc_local((8,), dtype)
            tx = T.get_thread_binding()
            ld = T.alloc_barrier(arrive_count=[32] * 5)        # the TMA loads' barriers (``value_head``)

            if tx < 32:
                T.tma_copy(q[t0:t0 + BT, h, 0:DK], q_s, barrier=ld[4])
                T.tma_copy(k[t0:t0 + BT, h, 0:DK], k_s, barrier=ld[4])
                T.barrier_arrive(ld[4])
            T.clear(dq_f)
            T.clear(dk_f)
            if factors is not None:
                fac = T.alloc_local((1,), f32)        # the stores' factor, read once
                fac[0] = factors[1, hv]
            value_head(ts, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, q_s, k_s, dq_f, dk_f, x_f, rs, qk, kk,
                       dpu, dyu, y_f, rs2, t2, r2, t2b, r2b, acc, xh, xl, tx, ld, qz, kw, kr, sd, yv, rect, db2, hv, c,
                       t0, nv, scale, s_lo, lo8, e_f, exp_mask, one)
            # each row stored once
            if group > 1:
                pad = 4
                stage = T.alloc_shared((BT, 2, DK + pad), f32)
                inbox = T.alloc_shared((group, BT // group, 2, DK + pad), f32)
                bar = T.alloc_cluster_barrier(group)
                cluster_group_sum(dq_f, dk_f, stage, inbox, bar, dq32, dk32, dqo, dko, h, t0, nv, out32, odt,
                                  None if factors is None else fac[0])
            else:
                store_rows(dq_f, dk_f, dq32, dk32, dqo, dko, t0, 0, hv, nv, out32, odt,
                           None if factors is None else fac[0])

    @T.prim_func
    def gdn_bwd_dqk(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), LO8 if lo8 else dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        dSh: T.Tensor((HV, NC, DV, DK), dtype),
        dSl: T.Tensor((HV, NC, DV, DK), LO8 if lo8 else dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        dYl: T.Tensor((HV, NC, DV, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dq32: T.Tensor((Ttot, HO, DK), f32),
        dk32: T.Tensor((Ttot, HO, DK), f32),
        dqo: T.Tensor((Ttot, HO, DK), odt),
        dko: T.Tensor((Ttot, HO, DK), odt),
        qz: T.Tensor((2, HV, NC, BT), f32),
        kw: T.Tensor((2, HV, NC, BT), f32),
        kr: T.Tensor((2, HV, NC, BT), f32),
        sd: T.Tensor((2, HV, NC, DV), f32),
        yv: T.Tensor((2, HV, NC, BT), f32),
        rect: T.Tensor((HV, NC, BT), f32),
        db2: T.Tensor((2, HV, NC, BT), f32),
        scale: T.float32,
        out32: T.int32,
        factors: T.Tensor((2, HV), f32),
    ):
        body(q, k, v, do, Sch, Scl, Uh,
             Ul, dSh, dSl, dYh, dYl, Fb, cu_seqlens, chunk_indices,
             dq32, dk32, dqo, dko, qz, kw, kr, sd,
             yv, rect, db2, scale, out32, factors if one else None)

    return gdn_bwd_dqk
