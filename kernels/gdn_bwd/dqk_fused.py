"""Backward kernel 3+4 in one: ``gdn_bwd_dqk`` - the inter-chunk (state) and intra-chunk (64x64) gradients of
q, k, g, beta of one chunk and value head, grid (chunk, value head), 256 threads (two warpgroups; each product's
output columns split between them).

The same products and row dots as ``dqk.build_bwd_dqk_inter`` (both key blocks) followed by
``dqk.build_bwd_dqk_intra`` (module docstring of ``dqk.py``), on the same split operands, with three differences
in where values go, none in what is computed:

* dq~ and dk~ stay in two [64, DK] fp32 fragments: the inter terms are folded in after their row dots, then the
  intra products accumulate onto them by wgmma, and each element is stored once.  The separate kernels stored the
  inter terms (1 GB at B1 T32768 H16 HV32) and added the intra terms by atomics; the tiles both read (do, U, dY,
  q, k) are loaded once instead of three times (the inter kernel's two key-block CTAs and the intra kernel).
* the products are ordered so that shared memory peaks at 192 KiB (one CTA of eight warps per SM): the S o dS'
  row dots (S, dS' hi + lo: 128 KiB), R = U dS'^T (then dS' dies), Z = dO S^T, W = dY S^T (then S dies), the
  dY . v dots, then the 64x64 terms (q, k, dO, U, dY and the eight 64x64 operand tiles).
* the S o dS' dots: thread ``tx`` sums value column ``tx % DV`` over key rows ``(tx // DV) * DK/2 ..`` (the
  two halves go to ``sd[0]`` and ``sd[1]``, as the two key blocks of the separate kernels did).

dk~'s inter part is the sum of the same two fp32 terms as before (``e^(GL-G) R`` and ``-beta e^G W``; fp32
addition of two terms commutes exactly); the intra part is added by the wgmma accumulator instead of an fp32
atomic add (another rounding order of the same fp32 sum).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from kernels.common.prologue import chunk_span, dynamic_dims, lo_shape
from kernels.gdn_fwd.cumsum import LOG2E

from .build import CLUSTER_GROUPS
from .dqk import (BT, ROW_DOT_BATCH, half_row_dots, intra_terms, masked_row_dot, rect_sums, split_dot_rows,
                  v_dy_half_row_dots, v_dy_row_dots)


@T.macro
def row_dots(x_f, rows_s, tmp, rs, t2, r2, nv, out, hv, c, batch, whole):
    """The row dots of ``x_f`` with ``rows_s`` into ``out [2, HV, NC, 64]``: by halves (``half_row_dots``; the
    default), or, with ``whole`` (ablations "dots_whole", "dots_b1": session 10's form), whole rows across the two
    warpgroups into half 0 (``masked_row_dot``, all-reduces batched by ``batch``) and zeros into half 1."""
    if whole:
        masked_row_dot(x_f, rows_s, tmp, rs, nv, out, 0, hv, c, batch)
        zero_half(out, hv, c)
    else:
        half_row_dots(x_f, rows_s, t2, r2, nv, out, hv, c)


@T.macro
def zero_half(out, hv, c):
    """``out[1, hv, c, :] = 0`` (the whole-row forms of ``row_dots``)."""
    for t in T.Parallel(BT):
        out[1, hv, c, t] = T.float32(0)


class _HeadTiles:
    """The shared tiles of one value head's pass (a Python object, so that ``value_head`` can name them)."""

    def __init__(self, DK, DV, dtype, m_pad=0, m_lo=True):
        f32 = "float32"
        self.f_s = T.alloc_shared((8, BT), f32)
        self.sh = T.alloc_shared((DK, DV), dtype)
        self.sl = T.alloc_shared((DK, DV), dtype)
        self.dsh = T.alloc_shared((DV, DK), dtype)
        self.dsl = T.alloc_shared((DV, DK), dtype)
        self.do = T.alloc_shared((BT, DV), dtype)
        self.v = T.alloc_shared((BT, DV), dtype)
        self.uh = T.alloc_shared((BT, DV), dtype)
        self.ul = T.alloc_shared((BT, DV), dtype)
        self.dyh = T.alloc_shared((DV, BT), dtype)
        self.dyl = T.alloc_shared((DV, BT), dtype)
        # the 64x64 operands hi, lo, hi, lo, ...; without their lo terms (``m_lo`` False: ``intra_single``) the lo
        # tiles are 8x8 placeholders, neither written nor read
        self.m = [T.alloc_shared(lo_shape((BT, BT), m_lo or i % 2 == 0), dtype) for i in range(8)]
        self.m_lo = m_lo
        # m_pad: columns past the 64 (neither stored nor summed: the row prefix sums scan m_s[:, 0:64]), so that
        # the fragment's stores do not hit one bank from 8 rows at once (``build_bwd_dqk_fused``'s conflict_free)
        self.m_s = T.alloc_shared((BT, BT + m_pad), f32)
        self.part = T.alloc_shared((4, BT), f32)      # the dg rectangle sums' column walk by 4 x 64 threads


@T.macro
def value_head(ts, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, q_s, k_s, dq_f, dk_f, x_f, rs, qk, kk, dpu,
               dyu, y_f, rs2, t2, r2, t2b, r2b, acc, xh, xl, tx, qz, kw, kr, sd, yv, rect, db2, hv, c, t0, nv, scale,
               ab=frozenset()):
    """Value head ``hv``'s inter and intra terms of chunk ``c`` (tiles ``ts``, a ``_HeadTiles``): its row dots,
    dg / dbeta terms to global memory, and its dq~, dk~ added to the fragments ``dq_f, dk_f [64, DK]`` fp32.
    The q.Z, k.W, k.R and dY . v row dots go out as two halves (``half_row_dots``, fragments ``t2, r2``) into
    ``qz, kw, kr, yv [2, HV, NC, 64]``, the dbeta row sums likewise into ``db2`` (``intra_terms``, fragments
    ``t2b, r2b``).  ``ab``: timing ablations (``ABLATIONS``; wrong results unless marked otherwise)."""
    DK = dq_f.shape[1]
    DV = ts.sh.shape[1]
    # 1. the S o dS' row dots (S, dS' hi + lo)
    T.copy(Fb[hv, c, 0:8, 0:BT], ts.f_s)
    T.copy(Sch[hv, c, 0:DK, 0:DV], ts.sh)
    T.copy(Scl[hv, c, 0:DK, 0:DV], ts.sl)
    T.copy(dSh[hv, c, 0:DV, 0:DK], ts.dsh)
    T.copy(dSl[hv, c, 0:DV, 0:DK], ts.dsl)
    if "no_sd" not in ab:
        acc[0] = T.float32(0)
        split_dot_rows(ts.sh, ts.sl, ts.dsh, ts.dsl, acc, tx % DV, xh, xl, (tx // DV) * (DK // 2), DK // 2)
        sd[tx // DV, hv, c, tx % DV] = acc[0]
    lo = "no_lo" not in ab
    gm = "no_inter_gemm" not in ab
    dots = "no_dots" not in ab
    rb = 1 if "dots_b1" in ab else ROW_DOT_BATCH
    whole = "dots_whole" in ab or "dots_b1" in ab
    # 2. R = U dS'^T (U, dS' hi + lo) -> dk~ += e^(GL-G) R, the k.R dots
    T.copy(Uh[hv, c, 0:BT, 0:DV], ts.uh)
    T.copy(Ul[hv, c, 0:BT, 0:DV], ts.ul)
    if gm:
        T.gemm(ts.uh, ts.dsh, x_f, clear_accum=True)
        if lo:
            T.gemm(ts.ul, ts.dsh, x_f)
            T.gemm(ts.uh, ts.dsl, x_f)
    for t, d in T.Parallel(BT, DK):
        dk_f[t, d] = dk_f[t, d] + T.exp2((ts.f_s[4, BT - 1] - ts.f_s[4, t]) * LOG2E) * x_f[t, d]
    if dots:
        row_dots(x_f, k_s, x_f, rs, t2, r2, nv, kr, hv, c, rb, whole)
    # 3. Z = dO S^T (S hi + lo) -> dq~ += scale e^G Z, the q.Z dots
    T.copy(do[t0:t0 + BT, hv, 0:DV], ts.do)
    if gm:
        T.gemm(ts.do, ts.sh, x_f, transpose_B=True, clear_accum=True)
        if lo:
            T.gemm(ts.do, ts.sl, x_f, transpose_B=True)
    for t, d in T.Parallel(BT, DK):
        dq_f[t, d] = dq_f[t, d] + scale * T.exp2(ts.f_s[4, t] * LOG2E) * x_f[t, d]
    if dots:
        row_dots(x_f, q_s, x_f, rs, t2, r2, nv, qz, hv, c, rb, whole)
    # 4. W = dY S^T (dY, S hi + lo) -> dk~ -= beta e^G W, the k.W dots; then the dY . v dots
    T.copy(dYh[hv, c, 0:DV, 0:BT], ts.dyh)
    T.copy(dYl[hv, c, 0:DV, 0:BT], ts.dyl)
    if gm:
        T.gemm(ts.dyh, ts.sh, x_f, transpose_A=True, transpose_B=True, clear_accum=True)
        if lo:
            T.gemm(ts.dyl, ts.sh, x_f, transpose_A=True, transpose_B=True)
            T.gemm(ts.dyh, ts.sl, x_f, transpose_A=True, transpose_B=True)
    for t, d in T.Parallel(BT, DK):
        dk_f[t, d] = dk_f[t, d] - ts.f_s[7, t] * T.exp2(ts.f_s[4, t] * LOG2E) * x_f[t, d]
    if dots:
        row_dots(x_f, k_s, x_f, rs, t2, r2, nv, kw, hv, c, rb, whole)
        T.copy(v[t0:t0 + BT, hv, 0:DV], ts.v)
        if whole:
            v_dy_row_dots(ts.v, ts.dyh, ts.dyl, x_f, rs, nv, yv, hv, c, rb, 0)
            zero_half(yv, hv, c)
        else:
            v_dy_half_row_dots(ts.v, ts.dyh, ts.dyl, t2, r2, nv, yv, hv, c)
    # 5. the 64x64 terms, accumulated onto dq~ / dk~
    m = ts.m
    if "no_intra" not in ab:
        intra_terms(q_s, k_s, ts.do, ts.uh, ts.ul, ts.dyh, ts.dyl, ts.f_s, m[0], m[1], m[2], m[3], m[4], m[5], m[6],
                    m[7], ts.m_s, qk, kk, dpu, dyu, y_f, rs2, dq_f, dk_f, db2, nv, hv, c, scale, mlo=lo and ts.m_lo,
                    clear=False,
                    batch=rb, t2=t2b, r2=r2b, m_copy=ts.m_s.shape[1] > BT)
        if "no_rect" not in ab:
            rect_sums(ts.m_s, acc, rect, hv, c, None if "rect_64" in ab else ts.part)


# timing-study switches (``benchmarks/ablate_bwd.py --kernel dqk``; wrong results): without the S o dS' dots / the
# q.Z, k.W, k.R and dY . v row dots / the lo-term products (inter and intra) / the eight inter products / the 64x64
# terms / their dg rectangle sums / the dq~, dk~ stores; "grid_hc" (the same results): the grid's first dimension
# the value head, so that a group's CTAs of one chunk run together (its q, k tiles read once from HBM, then L2);
# "dots_whole" (the same sums in another order): the q.Z, k.W, k.R, dY . v row dots over whole rows, across the two
# warpgroups (all-reduces batched by ROW_DOT_BATCH), instead of by halves; "dots_b1": the same one row at a time
# (session 10's form of those four; the intra dbeta row sums stay by halves in every form); "rect_64" (the same sums
# in another order): the dg rectangle sums' column walk by 64 threads over 64 rows (session 10's form)
ABLATIONS = ("no_sd", "no_dots", "no_lo", "no_inter_gemm", "no_intra", "no_rect", "no_store", "grid_hc", "dots_b1",
             "dots_whole", "rect_64")


@T.macro
def store_rows(xq, xk, dq32, dk32, dqo, dko, t0, r0, col, nv, out32, dtype):
    """Rows ``r0 + t`` of the chunk (``t`` over the R rows of ``xq, xk [R, DK]``, fp32 fragments; those below ``nv``)
    to token rows ``t0 + r0 + t``, head column ``col``: fp32 (``dq32, dk32``) when ``out32``, else rounded to the
    input dtype (``dqo, dko``).  Every dq~ / dk~ store of the kernel (per value head: ``r0 = 0``; a cluster's group
    sums: its rank's rows)."""
    R = xq.shape[0]
    DK = xq.shape[1]
    if out32 == 0:
        for t, d in T.Parallel(R, DK):
            if r0 + t < nv:
                dqo[t0 + r0 + t, col, d] = T.cast(xq[t, d], dtype)
                dko[t0 + r0 + t, col, d] = T.cast(xk[t, d], dtype)
    else:
        for t, d in T.Parallel(R, DK):
            if r0 + t < nv:
                dq32[t0 + r0 + t, col, d] = xq[t, d]
                dk32[t0 + r0 + t, col, d] = xk[t, d]


@T.macro
def cluster_group_sum(dq_f, dk_f, stage, inbox, bar, dq32, dk32, dqo, dko, h, t0, nv, out32, dtype):
    """The GVA group's dq~ and dk~ summed across the cluster (one CTA per value head of the group, rank r = value
    head r of the group), a reduce-scatter through distributed shared memory: each CTA stages its two fragments
    (``stage [64, 2, DK]`` fp32), every CTA's rows ``[s R, (s + 1) R)`` go to CTA s's ``inbox [G, R, 2, DK]`` slot r
    by an SM-to-SM bulk copy (``R = 64 / G``; ``stage`` and ``inbox`` may have padding columns past DK, copied
    along), and CTA s sums its slots in the order r = 0 .. G - 1 (the order of
    ``gdn_bwd_group_sum``, so the sums are bitwise the same) and stores rows ``[s R, (s + 1) R)`` of the group's
    q/k head ``h``: fp32 (``dq32, dk32 [Ttot, H, DK]``) when ``out32``, else the input dtype (``dqo, dko``).
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
    store_rows(aq_f, ak_f, dq32, dk32, dqo, dko, t0, r * R, h, nv, out32, dtype)
    T.cluster_sync()


def build_bwd_dqk_fused(DK: int, DV: int, dtype: str, _ablate: frozenset = frozenset(), group: int = 1,
                        conflict_free: bool = False, intra_single: bool = False):
    """Grid (chunk, value head).  With ``group == 1`` dq~ and dk~ leave the kernel in one of two ways, by ``out32``:

    * fp32 per value head (``dq32, dk32``), summed per group by ``gdn_bwd_group_sum`` (groups of two or more, or the
      L2 norm's chain rule on the host);
    * rounded to the input dtype (``dqo, dko``): the final dq, dk (groups of one value head, no L2 norm).

    With ``group`` in ``CLUSTER_GROUPS`` (= HV / H) the grid runs in clusters of ``group`` CTAs along the value
    heads (one GVA group of one chunk per cluster) and the kernel stores the group sums itself
    (``cluster_group_sum``): ``dq32, dk32, dqo, dko`` are then [Ttot, H, DK], fp32 when ``out32`` (the L2 norm's
    chain rule follows on the host), else the final dq, dk in the input dtype; no per-value-head rows, no
    ``gdn_bwd_group_sum`` pass.

    Loading U and dO together with S and dS' (one wait for 208 KiB of tiles, 210 KiB of shared memory) instead of
    each just before its first product was slower on the H200: dqk 4.11 against 3.92 ms at B1 T32768 H16 HV32
    (session 9, call 5, commit 579f773, reverted).  TMA loads of U, dO, dY and v issued ahead of their first use
    (on mbarriers, 210 KiB) made no difference: 3.60 against 3.62 ms for the kernel alone (session 10, call 1,
    ``ablate_bwd.py``; commit 1c2539b, not kept).

    GVA group forms measured on an H200 and dropped: two value heads per CTA unrolled, each with its own tiles
    (more than 255 registers, spills: dqk 6.56 against 3.8 ms; session 9, call 2); groups of two added onto one row
    by fp32 atomics (bwd 9.68 against 9.50 ms; session 9, call 3); a loop over the group's value heads in one CTA
    (``T.serial``, dq~ / dk~ summed in the fragments, the tiles' reuse planned by TileLang's aggressive
    shared-memory merge: 194 KiB, 232 registers), which made the kernel about 1.4x slower even with one value head
    per CTA (bwd 9.84 against 8.05 ms at B1 T32768 H16 HV32; session 10, call 2, commit 004ef1f).

    Storing dv = rd(beta (dYh + dYl)) here from the dY tiles instead of in gdn_bwd_dh (off dh's sequential chain)
    was slower at the large shapes: this kernel 3.94 -> 4.27 ms (the dY tiles read by value column), dh 2.1 -> 1.98,
    bwd 8.24 against 8.12 ms at B1 T32768 H16 HV32, 3.74 against 3.61 at B1 T65536 H2 HV4 (session 10, call 3,
    commit 9b056de; reverted).

    ``intra_single`` (the build's ``_INTRA_SINGLE``, the API's form since session 14): the four 64x64 operands of the
    intra terms single (``intra_terms(mlo=False)``): 4 fewer wgmma and their conversions; the same shared memory
    peak (198656 B: the 64x64 tiles reuse the memory of the inter phase's tiles), 245 registers, no spills; accuracy
    on the CPU (emulation, with dh's single form, seven GPU cases' inputs): worst 0.82x the FLA-like baseline, as
    without it.  Not yet timed.

    ``conflict_free`` (session 12; the API's form since session 13, the build's ``_CONFLICT_FREE``: backward 7.27 ->
    6.98 ms at B1 T32768 H16 HV32 with the recompute's ``sl_swizzle``, one H200): the shared
    tiles whose per-thread accesses are bank conflicts in the generated CUDA (``kernels.common.bank_conflicts``)
    laid out without them, the same values in the same order: the v tile of the dY . v dots swizzled (read in the
    accumulator layout from 256-byte rows: 8-way, 32 two-byte loads a thread; none swizzled); the dg summands' fp32
    tile ``m_s`` with 8 padding columns and written by one fragment copy (its element stores 8-way, 16 a thread;
    float2 stores into the padded rows: none); the cluster's fp32 ``stage`` and ``inbox`` rows with 4 padding
    columns (float2 stores 4-way, 32 a thread; none padded).  Nsight Compute counted 31 M shared-load and 43 M
    shared-store conflicts in this kernel at B1 T32768 H16 HV32 (session 11, call 6).

    Arguments (``qz, kw, kr, yv`` with the two halves of the column dim apart, ``half_row_dots``; ``sd`` with two
    halves of the key dim):
      q, k            [Ttot, H, DK]     dtype
      v, do           [Ttot, HV, DV]    dtype
      Sch, Scl        [HV, NC, DK, DV]  dtype  (forward recompute, key-first)
      Uh, Ul          [HV, NC, 64, DV]  dtype
      dSh, dSl        [HV, NC, DV, DK]  dtype  (gdn_bwd_dh, value-first)
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
    """
    assert DK == DV == 128, "the fused kernel's thread map assumes K = V = 128 (64 is zero-padded by the API)"
    assert set(_ablate) <= set(ABLATIONS), _ablate
    assert group == 1 or group in CLUSTER_GROUPS, group
    ab = frozenset(_ablate)
    st = "no_store" not in ab
    f32 = "float32"
    Ttot, H, HV, N, NC = dynamic_dims("Ttot H HV N NC")
    HO = H if group > 1 else HV
    launch = {"cluster_dims": (1, group, 1)} if group > 1 else {}

    @T.prim_func
    def gdn_bwd_dqk(
        q: T.Tensor((Ttot, H, DK), dtype),
        k: T.Tensor((Ttot, H, DK), dtype),
        v: T.Tensor((Ttot, HV, DV), dtype),
        do: T.Tensor((Ttot, HV, DV), dtype),
        Sch: T.Tensor((HV, NC, DK, DV), dtype),
        Scl: T.Tensor((HV, NC, DK, DV), dtype),
        Uh: T.Tensor((HV, NC, BT, DV), dtype),
        Ul: T.Tensor((HV, NC, BT, DV), dtype),
        dSh: T.Tensor((HV, NC, DV, DK), dtype),
        dSl: T.Tensor((HV, NC, DV, DK), dtype),
        dYh: T.Tensor((HV, NC, DV, BT), dtype),
        dYl: T.Tensor((HV, NC, DV, BT), dtype),
        Fb: T.Tensor((HV, NC, 8, BT), f32),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        dq32: T.Tensor((Ttot, HO, DK), f32),
        dk32: T.Tensor((Ttot, HO, DK), f32),
        dqo: T.Tensor((Ttot, HO, DK), dtype),
        dko: T.Tensor((Ttot, HO, DK), dtype),
        qz: T.Tensor((2, HV, NC, BT), f32),
        kw: T.Tensor((2, HV, NC, BT), f32),
        kr: T.Tensor((2, HV, NC, BT), f32),
        sd: T.Tensor((2, HV, NC, DV), f32),
        yv: T.Tensor((2, HV, NC, BT), f32),
        rect: T.Tensor((HV, NC, BT), f32),
        db2: T.Tensor((2, HV, NC, BT), f32),
        scale: T.float32,
        out32: T.int32,
    ):
        with (T.Kernel(HV, NC, threads=2 * DV) if "grid_hc" in ab else T.Kernel(NC, HV, threads=2 * DV, **launch)) as g:
            c, hv = (g[1], g[0]) if "grid_hc" in ab else (g[0], g[1])
            h = hv // group if group > 1 else hv // (HV // H)    # a cluster's group size is known
            eos, t0 = chunk_span(chunk_indices, cu_seqlens, c, False)
            nv = T.min(eos - t0, BT)

            q_s = T.alloc_shared((BT, DK), dtype)
            k_s = T.alloc_shared((BT, DK), dtype)
            ts = _HeadTiles(DK, DV, dtype, m_pad=8 if conflict_free else 0, m_lo=not intra_single)
            if conflict_free:
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
            rs2 = T.alloc_fragment((BT,), f32)
            t2 = T.alloc_fragment((2, BT, DK // 2), f32)
            r2 = T.alloc_fragment((2, BT), f32)
            t2b = T.alloc_fragment((2, BT, BT // 2), f32)
            r2b = T.alloc_fragment((2, BT), f32)
            acc = T.alloc_local((1,), f32)
            xh = T.alloc_local((8,), dtype)
            xl = T.alloc_local((8,), dtype)
            tx = T.get_thread_binding()

            T.copy(q[t0:t0 + BT, h, 0:DK], q_s)
            T.copy(k[t0:t0 + BT, h, 0:DK], k_s)
            T.clear(dq_f)
            T.clear(dk_f)
            value_head(ts, v, do, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, q_s, k_s, dq_f, dk_f, x_f, rs, qk, kk,
                       dpu, dyu, y_f, rs2, t2, r2, t2b, r2b, acc, xh, xl, tx, qz, kw, kr, sd, yv, rect, db2, hv, c, t0,
                       nv, scale, ab)
            # each row stored once
            if st and group > 1:
                pad = 4 if conflict_free else 0
                stage = T.alloc_shared((BT, 2, DK + pad), f32)
                inbox = T.alloc_shared((group, BT // group, 2, DK + pad), f32)
                bar = T.alloc_cluster_barrier(group)
                cluster_group_sum(dq_f, dk_f, stage, inbox, bar, dq32, dk32, dqo, dko, h, t0, nv, out32, dtype)
            elif st:
                store_rows(dq_f, dk_f, dq32, dk32, dqo, dko, t0, 0, hv, nv, out32, dtype)

    return gdn_bwd_dqk
