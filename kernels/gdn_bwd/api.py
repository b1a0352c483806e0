"""Python entry of the TileLang GDN backward (Hopper, sm_90a).

``chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None)
-> (dq, dk, dv, dg, dbeta, dh0)``

Shapes / dtypes as the forward (``kernels.gdn_fwd.api``); ``do`` like the forward's o, ``dht`` like the
final state (fp32, the caller's layout; None = 0).  Returns dq, dk, dv in the input dtype, dg and dbeta
in the dtypes of g and beta, dh0 fp32 in the initial state's layout (None without an initial state).

Launches (on the current stream, except step 0 on a side stream that the current one waits for before step 3;
no host sync except building the varlen tables):
  1. ``gdn_bwd_prep``       (chunk, head)              Tinv split, Ag = Tinv diag(beta) split, gate table, dUloc^T
     (given the forward's tables, ``_saved_tables``, and the sequential reverse pass: the gate table and dUloc^T
     alone, the ``saved`` prep kernel)
  0. forward recompute: ``gdn_state_v2`` alone (the smem form; precision "default_h0": chunk-start states S and
     U as hi + lo, key-first) on prep's Ag and gate table (``_RECOMPUTE_FROM_PREP``; off: ``gdn_intra_v2`` first,
     which computes the same; session 10: 9.09 -> 8.05 ms at B1 T32768 H16 HV32, the recompute now hidden by dh), BV
     by ``build.recompute_state_shape``, no output kernel; after prep, beside step 2,
     which does not read S or U (``_OVERLAP_RECOMPUTE``, from ``_OVERLAP_MIN_CHUNK_HEADS`` chunk x value head
     pairs; the stage times then show the part of it that dh did not hide);
  2. ``gdn_bwd_dh``         (64 value cols, head, seq)  reverse sequential: dS' tables, dY, dv, dh0 (with few
     CTAs three launches over segments of the sequences and a scan: ``dh_cp``)
  3. ``gdn_bwd_dqk``        (chunk, head)              state products and 64x64 terms -> dq~, dk~, row dots,
     dg / dbeta terms (``dqk_fused.py``); groups of 2, 4 or 8 value heads summed in the kernel (thread-block
     clusters, ``_CLUSTER_GROUP_SUM``), other groups by ``gdn_bwd_group_sum`` (token rows, head) after it.
     With ``_FUSED_DQK`` off its two-kernel form: ``gdn_bwd_dqk_inter`` (chunk, 64 key cols, head), then
     ``gdn_bwd_dqk_intra`` (chunk, head) adding to its dq~, dk~
  5. ``gdn_bwd_dg_dbeta`` (chunk, head): dg / dbeta row terms and within-chunk sums (``dg_dbeta.py``; the torch
     form in ``common.finish`` with the two-kernel form or ``_DG_DBETA_KERNEL`` off); ``common.finish`` (torch):
     the L2-norm chain rule (and the GVA sums where step 3 left them: the two-kernel form, ``_GROUP_SUM_KERNEL``
     off, ``_stages``).
"""

from __future__ import annotations

import contextlib

import torch

from kernels.gdn_fwd.api import _TL_DTYPE, _call_tables, _check, _require_sm90

from .common import BT, finish, group_sum, token_index, valid_rows

# layouts of the ``_stages`` intermediates, the same in both implementations (the kernel path at the padded
# head dim 128); every value as fp32 / fp64
STAGE_LAYOUT = {
    "Tinv": "[HV, NC, 64, 64]  (I + A)^-1 (hi + lo)", "Fb": "[HV, NC, 8, 64]  gate table",
    "dUloc": "[HV, NC, 64, DV]  P^T dO", "dY": "[HV, NC, 64, DV]  Tinv^T dU (hi + lo)",
    "U": "[HV, NC, 64, DV]  forward U (hi + lo)", "S": "[HV, NC, DK, DV]  chunk-start state (hi + lo)",
    "dSn": "[HV, NC, DK, DV]  chunk-end state gradient (hi + lo)",
    "qz": "[HV, NC, 64]", "kw": "[HV, NC, 64]", "kr": "[HV, NC, 64]", "yv": "[HV, NC, 64]", "sd": "[HV, NC, DV]",
    "rect": "[HV, NC, 64]", "db2": "[HV, NC, 64]",
    "dqv": "[Ttot, H, DK]  dq~ summed over each group's value heads", "dkv": "[Ttot, H, DK]  dk~ likewise",
}


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                               use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                               _stages: dict | None = None, _events: list | None = None, _tables: str | None = None,
                               _saved_tables: dict | None = None):
    """See the module docstring.  ``_stages`` (debugging): a dict that receives the intermediates, in the
    emulation's layouts (``STAGE_LAYOUT``), for a stage-by-stage comparison with ``emulation.py``.
    ``_events`` (profiling): a list that receives ``(stage name, torch.cuda.Event)`` recorded after each stage
    (the first entry, "start", before the first launch); ``stage_times`` turns it into ms per stage.
    ``_tables`` (opt-in; measured on an H200 in session 5, see README.md): "split" (default) or "lean_sd", the inter kernel reading the hi
    terms of the chunk tables alone, pipelined over chunks, with the S o dS' and dY . V row dots from hi + lo in
    a kernel of their own (``dqk_lean.py``; accuracy: ``accuracy.py``), and the intra kernel reading the hi terms of
    U and dY alone (``build.parse_tables``).
    ``_saved_tables`` (the autograd Function's): the forward's intra tables ``{"Th", "Ah", "Al"}`` (each
    [HV, NC, 64, 64] in the input dtype; ``kernels.gdn_fwd.api``'s ``_keep_tables``), bitwise what prep computes:
    prep then skips K K^T and the solve (``build.prep_config(saved=True)``).  Used where the reverse pass is the
    sequential one with dh's single operands (they hold Tinv hi alone); otherwise prep computes them."""
    from .build import stage_kinds
    kinds = stage_kinds(_tables, _FUSED_DQK)          # an unknown value fails here, before any CUDA check
    B, T, H, HV, K, V, N = _check(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    if tuple(do.shape) != (B, T, HV, V):
        raise ValueError(f"do must be [B, T, HV, V] = {(B, T, HV, V)}, got {tuple(do.shape)}")
    if dht is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(dht.shape) != want:
            raise ValueError(f"dht must be {want}, got {tuple(dht.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    _require_sm90(dev, "the TileLang GDN backward")
    from kernels.gdn_fwd.build import KERNEL_HEAD_DIM
    from kernels.gdn_fwd.build import get_kernel as fwd_kernel

    from .build import (CLUSTER_GROUPS, BwdConfig, dh_config, dqk_config, forward_recompute_configs, get_kernel,
                        intra_config, prep_config)

    dt = q.dtype
    D = KERNEL_HEAD_DIM
    pad = D - K
    Ttot = B * T
    f32 = torch.float32
    # the one host sync of a varlen call, none when the previous call had the same cu_seqlens
    cu_host, (cu, chunk_indices, chunk_offsets, NC) = _call_tables(B, T, cu_seqlens, dev)

    def _out(dq, dk, dv, dg, db, dh0):
        dq = dq[..., :K].reshape(B, T, H, K).to(dt)
        dk = dk[..., :K].reshape(B, T, H, K).to(dt)
        dv = dv[..., :V].reshape(B, T, HV, V).to(dt)
        dg = dg.reshape(B, T, HV).to(g.dtype)
        db = db.reshape(B, T, HV).to(beta.dtype)
        if initial_state is None:
            dh0 = None
        else:
            dh0 = dh0[..., :K, :V].contiguous() if pad else dh0
        return dq, dk, dv, dg, db, dh0

    if Ttot == 0 or NC == 0:
        z = torch.zeros(Ttot, HV, device=dev, dtype=f32)
        dh0 = (dht.to(f32).clone() if dht is not None
               else torch.zeros((N, HV, V, K) if state_v_first else (N, HV, K, V), device=dev, dtype=f32))
        return _out(torch.zeros(Ttot, H, K, device=dev), torch.zeros(Ttot, H, K, device=dev),
                    torch.zeros(Ttot, HV, V, device=dev), z, z.clone(), dh0)

    def _pad_last(x):
        return torch.nn.functional.pad(x, (0, pad)) if pad else x

    def _ready(x):
        x = x.contiguous()
        return x if x.data_ptr() % 16 == 0 else x.clone()

    q2 = _ready(_pad_last(q.reshape(Ttot, H, K)))
    k2 = _ready(_pad_last(k.reshape(Ttot, H, K)))
    v2 = _ready(_pad_last(v.reshape(Ttot, HV, V)))
    do2 = _ready(_pad_last(do.reshape(Ttot, HV, V).to(dt)))
    g2 = g.reshape(Ttot, HV).to(f32).contiguous()
    b2 = beta.reshape(Ttot, HV).to(f32).contiguous()
    vf = int(bool(state_v_first))
    use_l2 = int(bool(use_qk_l2norm_in_kernel))

    def _state(x):
        x = x.to(f32)
        return (torch.nn.functional.pad(x, (0, pad, 0, pad)) if pad else x).contiguous()

    use_h0 = initial_state is not None
    h0 = _state(initial_state) if use_h0 else torch.empty(1, HV, D, D, device=dev, dtype=f32)
    dh = _state(dht) if dht is not None else torch.empty(1, HV, D, D, device=dev, dtype=f32)

    def mark(name):
        if _events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            _events.append((name, ev))

    mark("start")
    tl_dt = _TL_DTYPE[dt]
    cp = _dh_plan(B, T, cu_host, HV, D // 64, dev) if _DH_SEGMENTS else None
    saved = _saved_tables if _reads_saved_tables(cp, tl_dt) else None
    # 1. prep
    if saved is not None:       # the forward's Tinv (hi: the single dh reads no Tl) and Ag (prep: not accessed)
        _check_saved(saved, (HV, NC, BT, BT), dt, dev)
        Th, Agh, Agl = saved["Th"], saved["Ah"], saved["Al"]
        Tl = Th                 # not accessed by the saved prep nor by the single dh
    else:
        Th = torch.empty(HV, NC, BT, BT, device=dev, dtype=dt)
        Tl = torch.empty_like(Th)
        Agh, Agl = torch.empty_like(Th), torch.empty_like(Th)
    Fb = torch.empty(HV, NC, 8, BT, device=dev, dtype=f32)
    prep_cfg = prep_config(tl_dt, saved=saved is not None)
    dUl = torch.empty(HV, NC, D, BT, device=dev, dtype=dt if prep_cfg.dul16 else f32)
    get_kernel(prep_cfg)(q2, k2, do2, g2, b2, cu, chunk_indices, Th, Tl, Agh, Agl, Fb, dUl, scale, use_l2)
    mark("prep")
    # 0. forward recompute of S (chunk start) and U, both hi + lo, key-first (the smem state kernel).  dh does not
    # read S or U and (sequential, one CTA per 64 value columns and head) leaves most SMs idle, so on a GPU the
    # recompute runs on a side stream beside it: after prep (beside prep, which fills the GPU, it slowed prep down:
    # session 8, call 2, B1 T8192 H4 HV8 backward 2.40 ms against 2.15 serial) and launched after dh, so that dh's
    # CTAs are placed first (launched before it, its wide first kernel held dh back: call 3, 2.68 against 2.39 ms
    # serial); the main stream waits for it before the inter kernel.
    def recompute(side):
        ci, cs = forward_recompute_configs(tl_dt, N, HV)
        Sch = torch.empty(HV, NC, D, D, device=dev, dtype=dt)
        Scl = torch.empty_like(Sch)
        Uh = torch.empty(HV, NC, BT, D, device=dev, dtype=dt)
        Ul = torch.empty_like(Uh)
        ht = torch.empty(1, HV, D, D, device=dev, dtype=f32)
        tmp = [ht]
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if _RECOMPUTE_FROM_PREP:        # prep stored Ag = Tinv diag(beta) and the gate rows
                Ah, Al, F = Agh, Agl, Fb
            else:
                Ah = torch.empty(HV, NC, BT, BT, device=dev, dtype=dt)
                Al = torch.empty_like(Ah)
                F = torch.empty(HV, NC, 8, BT, device=dev, dtype=f32)
                tmp += [Ah, Al, F]
                fwd_kernel(ci)(q2, k2, g2, b2, cu, chunk_indices, Ah, Al, F, Ah, scale, use_l2)  # Th: not accessed
            fwd_kernel(cs)(k2, v2, Ah, Al, F, cu, chunk_offsets, h0, Sch, Scl, Uh, Ul, ht, int(use_h0), 0, vf)
        if side is not None:
            for x in tmp + [Agh, Agl]:       # freed while the side stream may still use them
                x.record_stream(side)
        return Sch, Scl, Uh, Ul

    side = _side_stream(dev) if _overlaps_recompute(NC, HV) else None
    if side is None:
        Sch, Scl, Uh, Ul = recompute(None)
        mark("recompute")
    else:
        side.wait_stream(torch.cuda.current_stream(dev))        # prep is launched: the recompute may start after it
    # 2. reverse sequential
    dSh = torch.empty(HV, NC, D, D, device=dev, dtype=dt)
    dSl = torch.empty_like(dSh)
    dYh = torch.empty(HV, NC, D, BT, device=dev, dtype=dt)
    dYl = torch.empty_like(dYh)
    dv2 = torch.empty(Ttot, HV, D, device=dev, dtype=dt)     # dh stores every token row (no zero fill)
    dh0 = torch.empty((N if use_h0 else 1), HV, D, D, device=dev, dtype=f32)
    if cp is None:
        get_kernel(dh_config(tl_dt))(q2, k2, do2, Th, Tl, Fb, dUl, cu, chunk_offsets, dh, dSh, dSl, dYh, dYl,
                                     dv2, dh0, int(dht is not None), int(use_h0), vf)
    else:       # few heads: the same kernel over segments, three passes and a scan (dh_cp.py), with every operand
        # split whatever _DH_SINGLE says: pass B's transfer matrices (from dht = I) are sums of single roundings in
        # the single form, and the composed passes then left the sequential pass's gradients by up to 1.7e-3
        # (dk, relative; session 13, the CPU plumbing test) where split they agree to the scan's fp32 inputs
        dh0k = _dh_segmented(get_kernel(dh_config(tl_dt, single=False)), cp, q2, k2, do2, Th, Tl, Fb, dUl,
                             (dh.transpose(-1, -2) if vf else dh) if dht is not None else None,
                             dSh, dSl, dYh, dYl, dv2)
        if use_h0:
            dh0 = (dh0k.transpose(-1, -2) if vf else dh0k).contiguous()
    if side is not None:
        Sch, Scl, Uh, Ul = recompute(side)
    mark("dh")
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
        mark("recompute (not hidden by dh)")
    # 3. inter-chunk (state) products
    NK = D // 64
    # no zero fill: the inter kernel stores every token row of every chunk (both key blocks) before the intra
    # kernel adds to it (session 7, after its last GPU call: two fills of 115 us each at B1 T32768 H16 HV32)
    dqv = torch.empty(Ttot, HV, D, device=dev, dtype=f32)
    dkv = torch.empty_like(dqv)
    qz = torch.empty(NK, HV, NC, BT, device=dev, dtype=f32)
    kw, kr = torch.empty_like(qz), torch.empty_like(qz)
    sd = torch.empty(NK, HV, NC, D, device=dev, dtype=f32)
    yv = torch.empty(HV, NC, BT, device=dev, dtype=f32)
    rect = torch.empty(HV, NC, BT, device=dev, dtype=f32)
    db2 = torch.empty_like(rect)
    dgdb = yv2 = db22 = None
    if "dqk" in kinds:
        # inter + intra in one kernel (the row dots and sd by two column halves); dq~, dk~ out (``dqk_fused``):
        # groups of one value head as the final dq, dk in the input dtype (no L2 norm; fp32 when ``_stages`` wants
        # the sums), larger ones as fp32 per value head, summed by ``gdn_bwd_group_sum`` (or, switched off, by
        # finish); the dtype outputs use the first half of the fp32 buffers' memory (only one of the two is written)
        # With a group of 2, 4 or 8 value heads (``_CLUSTER_GROUP_SUM``) the kernel runs in thread-block clusters
        # of one group and stores the group sums itself (``dqk_fused.cluster_group_sum``): [Ttot, H, D] rows.
        r = HV // H
        cluster = _CLUSTER_GROUP_SUM and r in CLUSTER_GROUPS
        out32 = (r > 1 and not cluster) or bool(use_l2) or _stages is not None
        # the q.Z, k.W, k.R, dY . v and dbeta row dots come out as two halves of the column dim
        # (``dqk.half_row_dots``: no exchange between the kernel's warpgroups), added by gdn_bwd_dg_dbeta (or, for
        # the torch form of finish and the stage comparison, by finish (qz .. kr) and here (yv, db2))
        yv2 = torch.empty(2, HV, NC, BT, device=dev, dtype=f32)
        db22 = torch.empty(2, HV, NC, BT, device=dev, dtype=f32)        # the intra dbeta row sums, by halves too
        HO = H if cluster else HV
        dq32 = torch.empty(Ttot, HO, D, device=dev, dtype=f32)      # the kernel stores every token row
        dk32 = torch.empty_like(dq32)
        dqo, dko = (x.view(-1).view(dt)[:x.numel()].view(Ttot, HO, D) for x in (dq32, dk32))
        get_kernel(dqk_config(f"dqk_g{r}" if cluster else "dqk", tl_dt))(
            q2, k2, v2, do2, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, cu, chunk_indices, dq32, dk32, dqo, dko, qz,
            kw, kr, sd, yv2, rect, db22, scale, int(out32))
        if _stages is not None or not _DG_DBETA_KERNEL:     # the torch form of finish, or the stage comparison
            yv, db2 = yv2[0] + yv2[1], db22[0] + db22[1]
        dqv, dkv = (dq32, dk32) if out32 else (dqo, dko)
        if r > 1 and not cluster and _GROUP_SUM_KERNEL:
            # the group sums in one pass (``group_sum.py``): to the input dtype (the final dq, dk) unless the L2
            # norm's chain rule follows on the host (or ``_stages`` wants the fp32 sums)
            g32 = bool(use_l2) or _stages is not None
            gs = get_kernel(BwdConfig("gsum32" if g32 else "gsum", tl_dt))
            dqv, dkv = (torch.empty(Ttot, H, D, device=dev, dtype=f32 if g32 else dt) for _ in range(2))
            gs(dq32, dqv)
            gs(dk32, dkv)
    elif "inter" in kinds:
        get_kernel(BwdConfig("inter", tl_dt))(q2, k2, v2, do2, Sch, Scl, Uh, Ul, dSh, dSl, dYh, dYl, Fb, cu,
                                              chunk_indices, dqv, dkv, qz, kw, kr, sd, yv, scale)
    else:
        sd = sd[:1]
        get_kernel(BwdConfig("inter_lean", tl_dt))(q2, k2, do2, Sch, Uh, dSh, dYh, Fb, cu, chunk_indices, dqv, dkv,
                                                   qz, kw, kr, scale)
        get_kernel(BwdConfig("dots", tl_dt))(v2, Sch, Scl, dSh, dSl, dYh, dYl, cu, chunk_indices, sd, yv)
    if "dqk" not in kinds:
        mark("dqk_inter")
        # 4. intra-chunk terms
        intra = next(kd for kd in kinds if kd.startswith("intra"))    # lean: Ul, dYl are not read
        get_kernel(intra_config(intra, tl_dt))(q2, k2, do2, Uh, Ul, dYh, dYl, Fb, cu, chunk_indices, dqv, dkv, rect,
                                            db2, scale)
        mark("dqk_intra")
    else:
        mark("dqk")
    if _stages is not None:
        f = lambda x: x.float()   # noqa: E731
        tr = lambda x: x.float().transpose(-1, -2)   # noqa: E731
        _stages.update(Tinv=f(Th) + (f(Tl) if saved is None else 0), Fb=Fb, dUloc=dUl.transpose(-1, -2),
                       dSn=tr(dSh) + tr(dSl), dY=tr(dYh) + tr(dYl), qz=qz.sum(0), kw=kw.sum(0), kr=kr.sum(0),
                       sd=sd.sum(0), yv=yv, rect=rect, db2=db2, S=f(Sch) + f(Scl), U=f(Uh) + f(Ul),
                       dqv=group_sum(dqv, H), dkv=group_sum(dkv, H))
    # 5. dg, dbeta of every token in one kernel after the fused kernel (``dg_dbeta.py``: the terms of ``finish``'s
    # torch form), and the host's part
    if "dqk" in kinds and _DG_DBETA_KERNEL:
        dgdb = (torch.empty(Ttot, HV, device=dev, dtype=f32), torch.empty(Ttot, HV, device=dev, dtype=f32))
        get_kernel(BwdConfig("dgdb", "float32"))(Fb, qz, kw, kr, yv2, db22, sd, rect, cu, chunk_indices, *dgdb)
    # the token rows of the torch form (cached per layout, built on the host for a new varlen layout)
    tok, valid, rows = _token_index(B, T, cu_host, dev) if dgdb is None else (None, None, None)
    dq, dk, dg, db = finish(Fb=Fb, qz=qz, kw=kw, kr=kr, sd=sd, yv=yv, rect=rect, db2=db2, dqv=dqv, dkv=dkv,
                            q=q2, k=k2, H=H, use_l2=bool(use_l2), tok=tok, valid=valid, rows=rows, dgdb=dgdb)
    out = _out(dq, dk, dv2, dg, db, dh0)
    mark("finish")
    return out


_DH_SEGMENTS = True            # private switch: the segment-parallel reverse pass when few CTAs would run (dh_cp.py)
_PLANS: dict = {}


def _sm_count(dev) -> int:
    """Streaming multiprocessors of ``dev`` (132 off a GPU, the H100 / H200 count, for CPU tests of the plumbing)."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


# the forward's intra tables the backward reads (``_saved_tables``' keys; ``kernels.gdn_fwd.api``'s ``_keep_tables``)
SAVED_TABLES = ("Th", "Ah", "Al")


def saved_tables_used(q, v, cu_seqlens=None) -> bool:
    """Whether the backward of these inputs (q [B, T, H, K], v [B, T, HV, V], the forward's ``cu_seqlens``) reads the
    forward's intra tables (``_saved_tables``): where its reverse pass is the sequential one with dh's single
    operands (the segmented pass of few heads over long sequences reads Tinv's lo term, which the forward does not
    keep).  The autograd Function asks before its forward, so that it keeps no tables the backward would not read."""
    from kernels.gdn_fwd.build import KERNEL_HEAD_DIM
    if q.dtype not in _TL_DTYPE:
        return False
    cp = None
    if _DH_SEGMENTS:
        B, T = q.shape[:2]
        cu_host, _ = _call_tables(B, T, cu_seqlens, q.device)
        cp = _dh_plan(B, T, cu_host, v.shape[2], KERNEL_HEAD_DIM // 64, q.device)
    return _reads_saved_tables(cp, _TL_DTYPE[q.dtype])


def _reads_saved_tables(cp, tl_dt: str) -> bool:
    """The backward reads the forward's tables where its reverse pass is sequential (no segment plan ``cp``) and
    dh's operands are single (it reads Tinv hi alone)."""
    from .build import dh_config
    return cp is None and dh_config(tl_dt).single


def _check_saved(saved, shape, dt, dev):
    """The forward's tables (``_saved_tables``) must be this call's: keys Th, Ah, Al, each ``shape`` in ``dt`` on
    ``dev`` (a ValueError names the first that is not)."""
    for name in SAVED_TABLES:
        x = saved.get(name)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"_saved_tables needs a tensor {name!r}, got {type(x).__name__}")
        if tuple(x.shape) != shape or x.dtype != dt or x.device != dev or not x.is_contiguous():
            raise ValueError(f"_saved_tables[{name!r}] must be a contiguous {shape} {dt} tensor on {dev}, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")


def _dh_plan(B, T, cu_host, HV, n_value_blocks, dev):
    """``dh_cp.plan_tensors`` of the call's segment plan, or None (sequential), cached per layout and device."""
    from . import dh_cp
    sms = _sm_count(dev)
    key = ((B, T) if cu_host is None else tuple(cu_host), HV, n_value_blocks, str(dev), sms, dh_cp.MIN_CHUNKS, dh_cp.MIN_SEQ_CHUNKS)
    if key not in _PLANS:
        if len(_PLANS) > 64:
            _PLANS.clear()
        p = dh_cp.plan([b * T for b in range(B + 1)] if cu_host is None else list(cu_host), HV, n_value_blocks, sms)
        _PLANS[key] = None if p is None else dh_cp.plan_tensors(p, dev)
    return _PLANS[key]


def _dh_segmented(kern, cp, q2, k2, do2, Th, Tl, Fb, dUl, dhk, dSh, dSl, dYh, dYl, dv2):
    """``gdn_bwd_dh`` over the segments of plan ``cp`` (``dh_cp``): pass A (zero end gradients, the caller's dht
    ``dhk`` [N, HV, D, D] key-first at each sequence's end), pass B (identity, dO = dUloc = 0: the transfer
    matrices), the scan, pass C (true end gradients; writes every per-chunk output).  Returns the start gradient of
    every sequence [N, HV, D, D] (key-first)."""
    from . import dh_cp
    NS = cp.cu.numel() - 1
    HV, D = Th.shape[0], q2.shape[-1]
    dev, f32 = q2.device, torch.float32
    dht_a = torch.zeros(NS, HV, D, D, device=dev, dtype=f32)
    if dhk is not None:
        dht_a[cp.last] = dhk
    a = torch.empty_like(dht_a)
    kern(q2, k2, do2, Th, Tl, Fb, dUl, cp.cu, cp.chunk_offsets, dht_a, dSh, dSl, dYh, dYl, dv2, a, 1, 1, 0)
    eye = torch.eye(D, device=dev, dtype=f32).expand(NS, HV, D, D).contiguous()
    P = torch.empty_like(dht_a)
    kern(q2, k2, torch.zeros_like(do2), Th, Tl, Fb, torch.zeros_like(dUl), cp.cu, cp.chunk_offsets, eye, dSh, dSl,
         dYh, dYl, dv2, P, 1, 1, 0)
    E = dh_cp.end_gradients(cp, a, P, dhk)
    start = torch.empty_like(dht_a)
    kern(q2, k2, do2, Th, Tl, Fb, dUl, cp.cu, cp.chunk_offsets, E, dSh, dSl, dYh, dYl, dv2, start, 1, 1, 0)
    return start[cp.first]


# private switch (A/B timing): the recompute's state kernel reads prep's Ag and gate table (no intra2 kernel)
_RECOMPUTE_FROM_PREP = True
_FUSED_DQK = True              # private switch (A/B timing): the inter + intra terms in one kernel (dqk_fused.py)
_GROUP_SUM_KERNEL = True       # private switch (A/B timing): the GVA group sums by gdn_bwd_group_sum, not torch
# private switch (A/B timing): groups of 2, 4 or 8 value heads summed inside the fused dqk kernel by thread-block
# clusters (dqk_fused.cluster_group_sum) instead of fp32 rows per value head + gdn_bwd_group_sum
_CLUSTER_GROUP_SUM = True
# private switch (A/B timing): dg and dbeta by the kernel gdn_bwd_dg_dbeta after the fused dqk kernel instead of the
# torch form in common.finish
_DG_DBETA_KERNEL = True
_OVERLAP_RECOMPUTE = True      # private switch (A/B timing): the recompute on a side stream beside dh
# ... when the call has at least this many (chunk, value head) pairs.  Session 8 on an H200 (bench_kernels_bwd.py --ab
# ours-serial, calls 2-5): the side stream saved 0.8 ms at B1 T32768 H16 HV32 (16384 pairs) and at B1 T65536 H2 HV4
# (4096), nothing at B8 T4096 H16 HV32, and cost 0.1-0.4 ms at B1 T8192 H4 HV8 (1024) in every call.  Chosen from
# those points (not re-measured with this gate); both paths are the ones measured there.
_OVERLAP_MIN_CHUNK_HEADS = 4096


def _overlaps_recompute(n_chunks: int, HV: int) -> bool:
    """Whether a call with ``n_chunks`` chunks (all sequences) and ``HV`` value heads runs the recompute on the side
    stream (on a GPU)."""
    return _OVERLAP_RECOMPUTE and n_chunks * HV >= _OVERLAP_MIN_CHUNK_HEADS
_SIDE: dict = {}


def _side_stream(dev):
    """The side stream of ``dev`` for the forward recompute (one per device, created once); None off a GPU."""
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx)
    return _SIDE[idx]


def stage_times(events) -> dict:
    """{stage: ms} from the ``_events`` list of one call (synchronises)."""
    torch.cuda.synchronize()
    return {name: prev[1].elapsed_time(ev) for prev, (name, ev) in zip(events, events[1:])}


_TOK: dict = {}


def _token_index(B, T, cu_host, dev):
    """``common.token_index`` of the dense layout or of ``cu_host`` (varlen) and its ``common.valid_rows`` (tok,
    valid, rows), cached per layout and device: computed on the host, so a call never waits for the GPU here."""
    key = (B, T, str(dev)) if cu_host is None else (tuple(cu_host), str(dev))
    if key not in _TOK:
        if len(_TOK) > 64:
            _TOK.clear()
        tok, valid = token_index([b * T for b in range(B + 1)] if cu_host is None else cu_host, "cpu")
        tv, sel = valid_rows(tok, valid)
        _TOK[key] = (tok.to(dev), valid.to(dev), (tv.to(dev), sel.to(dev)))
    return _TOK[key]
