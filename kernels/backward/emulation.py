"""Pure-torch replay of the backward kernels (same chunking, padding, layouts up to a transpose, same roundings),
the oracle of the kernels' CPU and GPU tests:

* ``_rd``: to the input dtype (every wgmma operand), ``_f32``: to fp32 (accumulators, CUDA cores),
  ``_two``: the two-term split ``rd(x) + rd(x - rd(x))``;
* a wgmma is an fp64 product of exact rounded operands rounded once to fp32.

Stages (kernel in brackets):
  0. forward recompute of the chunk-start states S and U (hi + lo; the forward's intra and state kernels,
     precision ``fwd_precision()``);
  1. ``prep`` [gdn_bwd_prep]: (I + A)^-1 split, gate table Fb, dUloc = P^T dO (P split);
  2. ``dh`` [gdn_bwd_dh], reverse over chunks: dS' tables (split), dU = dUloc + F2 (K dS'),
     dY = Tinv^T dU, dv = beta dY, dS = e^GL dS' + Q^T (F1 dO) - K^T (F0 beta dY);
  3. ``dqk_inter`` and 4. ``dqk_intra`` [both in gdn_bwd_dqk]: the state products Z = dO S^T, W = dY S^T,
     R = U dS'^T and the 64x64 terms (P and A) -> dq~, dk~, row dots, dG, dbeta terms;
  5. ``finish.finish`` (shared with the kernel path).

``operands`` (``OPERANDS``) sets the wgmma operands of stages 1-4 and the tables between them: "split" the
kernels' forms; "bf16" every one one input-dtype term; "fp16" every one one fp16 term under a power of two per
matrix (``half_term``).  The last two are precision studies of a one-term backward: no kernel computes them.
"""

from __future__ import annotations

import torch

from kernels.forward.emulation import (_f32, _gate_table, _gather_chunks, _tinv, _two, chunk_tables, intra_chunk,
                                       chunk_states, segments_from)

from kernels.forward.cumsum import LOG2E
from kernels.interface import LO8_DTYPE, as_kernel_dtype, lo8_shift, pad_rows

from .finish import BT, finish, group_sum, token_index
from .scales import EXP_MAX, factors, group_exponents, pow2, scale_states, unscale

f64 = torch.float64
# the wgmma operands of the backward stages: the kernels' forms, one input-dtype term, one scaled fp16 term
OPERANDS = ("split", "bf16", "fp16")
# the largest magnitude of a matrix scaled by ``half_term`` lands in [2^HALF_TOP, 2^(HALF_TOP + 1))
HALF_TOP = 14
# the arguments of ``chunk_gated_delta_rule_bwd`` that emulate a one-term plan on the fp16 kernels (``ours-one16``)
ONE_TERM_FP16 = dict(dh_single=True, s_single=True, lo8_tables=False, one_term=True, kernel_dtype=torch.float16,
                     group_scales=True, chunk_exp=True)


def half_term(x: torch.Tensor) -> torch.Tensor:
    """One fp16 term of ``x [..., R, C]`` (fp64 values): each matrix scaled by the power of two that puts its
    largest magnitude in [2^14, 2^15), rounded to fp16 and scaled back (an all-zero matrix stays zero)."""
    m = x.abs().amax(dim=(-1, -2), keepdim=True)
    e = torch.floor(torch.log2(torch.where(m > 0, m, torch.ones_like(m))))
    up = torch.exp2(HALF_TOP - e)
    return (x * up).to(torch.float16).to(f64) / up


def _op(x, dt: torch.dtype, split: bool, operands: str):
    """The wgmma operand(s) (hi, lo) of an fp32 value ``x``: the kernel's form ``_two(x, dt, split)`` at
    ``operands`` "split", one ``dt`` term at "bf16", one ``half_term`` at "fp16" (lo = 0 at both)."""
    if operands == "split":
        return _two(x, dt, split)
    if operands == "bf16":
        return _two(x, dt, False)
    return half_term(x), torch.zeros_like(x)


def _in(x, operands: str):
    """An input tile (q, k, dO: values of the input dtype) as a wgmma operand: itself, or its ``half_term``."""
    return half_term(x) if operands == "fp16" else x


def _one(hi, lo, dt: torch.dtype, operands: str):
    """A stored hi + lo table as the one term of ``operands`` "bf16" / "fp16" (hi, lo = 0); as it is at "split"."""
    if operands == "split":
        return hi, lo
    return _op(hi + lo, dt, False, operands)


# the recompute's operand fields a precision study may take to one term (``recompute_one``)
RECOMPUTE_OPERANDS = ("ag", "ks", "x", "upd")
# those that ``BackwardPlan.recompute_one`` takes to one term (K S's S, X, F2 U)
RECOMPUTE_ONE = ("ks", "x", "upd")
# the dispatched fused plan's (``BackwardPlan.fused`` with ``fused_dq16`` and ``recompute_one``): dUloc from one fp16
# term of P, dq~ and dk~ stored in fp16 before their GVA group sums, the recompute's K S, X, F2 U one term
FUSED_FP16 = dict(ONE_TERM_FP16, p_single=True, dqk_store=torch.float16, recompute_one=RECOMPUTE_ONE)


def fwd_precision(s_single: bool = False, merge: str = "fp32", one: tuple = ()):
    """Precision of the forward recompute: "recompute" (chunk state S and U stored as hi + lo), so the backward
    reads S and U to ~16 bits; ``s_single``: S one term (``BackwardPlan.s_single``); ``merge``: Tinv's block
    merges (``BackwardPlan.merge``); ``one``: fields of ``RECOMPUTE_OPERANDS`` one term."""
    from dataclasses import replace

    from kernels.plan import recompute_precision
    bad = [f for f in one if f not in RECOMPUTE_OPERANDS]
    if bad:
        raise ValueError(f"recompute_one: fields of {RECOMPUTE_OPERANDS}, got {bad}")
    return replace(recompute_precision(s_single, merge), **dict.fromkeys(one, "bf16"))


def _lo8_scale(hi, dt: torch.dtype):
    """(2^(shift - E) fp64, where the lo term is kept) from the fp32 exponent bits of ``hi``."""
    eb = (hi.to(torch.float32).view(torch.int32) >> 23) & 255
    shift = lo8_shift(dt)
    return torch.exp2((127 + shift - eb).to(f64)), eb > shift


def lo8_encode(hi, lo, dt: torch.dtype) -> torch.Tensor:
    """The fp8 e4m3 codes (``LO8_DTYPE``) of the lo terms ``lo`` under their hi terms ``hi`` (``dt`` the
    hi terms' dtype): ``e4m3(lo 2^(shift - E))`` with ``E`` the fp32 exponent of ``hi`` (``lo8_shift(dt)``: half an
    ulp of hi maps to at most 1); zero where ``E <= shift - 127`` (hi below 2^-118 for bf16)."""
    up, ok = _lo8_scale(hi, dt)
    return torch.where(ok, lo.to(f64) * up, torch.zeros((), dtype=f64)).clamp(-448.0, 448.0).to(LO8_DTYPE)


def lo8_decode(hi, code, dt: torch.dtype) -> torch.Tensor:
    """The lo terms (fp64) that the fp8 ``code`` holds under their hi terms ``hi`` (``lo8_encode``)."""
    up, ok = _lo8_scale(hi, dt)
    return torch.where(ok, code.to(f64) / up, torch.zeros((), dtype=f64))


def lo8(hi, lo, dt: torch.dtype):
    """A stored lo term as the fp8 table holds it (``lo8_encode`` then ``lo8_decode``): element by element, no
    scale table; the values a kernel reads back (fp64)."""
    return lo8_decode(hi, lo8_encode(hi, lo, dt), dt)


def chunk_pow2(g0) -> torch.Tensor:
    """``2^x`` (fp64 values), ``x = floor(-g0 log2 e)`` (fp32 product) clamped to [-EXP_MAX, EXP_MAX]: the power of
    two of a chunk whose first gate cumsum is ``g0`` (``dh_ws.chunk_pow2``)."""
    return torch.exp2(torch.floor(-g0.float() * LOG2E).clamp(-EXP_MAX, EXP_MAX)).to(f64)


def _chunks(x, cu, heads=None):
    """[Ttot, Hx, D] -> [HV, NC, 64, D] fp64, zero past each sequence's end."""
    tok, valid = token_index(cu, x.device)
    y = x.to(f64)[tok]
    if heads is not None:
        y = y[:, :, heads]
    return (y * valid[..., None, None]).permute(2, 0, 1, 3)


def prep(q2, k2, do2, g2, b2, cu, scale, use_l2, dt, merge: str = "bf16", operands: str = "split",
         p_single: bool = False):
    """Emulates ``gdn_bwd_prep``: Th, Tl [HV, NC, 64, 64], Fb [HV, NC, 8, 64], dUloc [HV, NC, 64, DV]; ``merge``:
    the block merges, "fp32", "bf16" or "split" (its ``merge`` forms); ``operands``: ``OPERANDS``; ``p_single``:
    ``local_du``'s."""
    qc, kc, gc, bc, vmask, G, rq, rk = _gather_chunks(q2, k2, g2, b2, cu, use_l2)
    vm = vmask.to(f64)
    Tinv = _tinv(kc, bc, G, rk, dt, merge)
    Th, Tl = _op(Tinv, dt, True, operands)
    Fb = _gate_table(G, rk, rq, scale, vm, bc)
    return Th, Tl, Fb, local_du(qc, kc, _chunks(do2, cu), Fb, dt, operands, p_single)


def local_du(qc, kc, doc, Fb, dt, operands: str = "split", p_single: bool = False):
    """dUloc = P^T dO [HV, NC, 64, DV] (fp32 values), the local part of dU, as ``gdn_bwd_prep`` computes it:
    ``P = Fb5_t Fb6_j e^(G_t - G_j) (q_t . k_j)`` (j <= t, G = Fb row 4) split in two input-dtype terms.
    ``qc, kc, doc [HV, NC, 64, D]`` fp64 chunks (q, k per value head), zero past each sequence;
    ``Fb [HV, NC, 8, 64]``; ``p_single`` (at "split"): P one input-dtype term (a precision study of a fused backward
    that forms P in shared memory: no kernel computes it)."""
    rows = torch.arange(BT, device=qc.device)
    qc, kc, doc = _in(qc, operands), _in(kc, operands), _in(doc, operands)
    G = Fb[:, :, 4].to(f64)
    causal = rows[:, None] >= rows[None, :]
    D = G[..., :, None] - G[..., None, :]
    e_causal = torch.where(causal, torch.exp(torch.where(causal, D, 0.0)), 0.0)
    QK = _f32(qc @ kc.transpose(-1, -2))
    P = _f32(Fb[:, :, 5, :, None].to(f64) * Fb[:, :, 6, None, :].to(f64) * e_causal * QK)
    Ph, Pl = _op(P, dt, not p_single, operands)
    return _f32(Ph.transpose(-1, -2) @ doc + Pl.transpose(-1, -2) @ doc)


def dh(q2, k2, do2, Th, Tl, Fb, dUloc, cu, dht, dt, single: bool = False, operands: str = "split",
       one: bool = False, dv_dtype: torch.dtype | None = None, chunk_exp: bool = False):
    """Emulates ``gdn_bwd_dh`` (reverse sequential).  dht [N, HV, DK, DV] fp32 or None (key-first).
    Returns dSnh, dSnl [HV, NC, DK, DV] (the gradient of each chunk's end state, split),
    dYh, dYl [HV, NC, 64, DV], dv [Ttot, HV, DV] (dt) and dh0 [N, HV, DK, DV] fp32.  ``single``: the kernel's
    single form (``build_bwd_dh(single=True)``): Tinv (Tl not read), dU and F0 dX as one input-dtype term;
    ``operands``: ``OPERANDS`` (other than "split": ``single`` has no effect); ``one`` (with ``single``): dS' and
    F1 dO one input-dtype term too and the dS', dY tables their hi terms alone (``build_bwd_dh_ws(one=True)``);
    ``dv_dtype``: dv's dtype where it is not ``dt`` (``io``); ``chunk_exp`` (with ``one``, as the kernel's ``one``
    form): F1 dO and F0 dX rounded under the chunk's power of two (``chunk_pow2``), their products with Q^T and K^T
    scaled back."""
    Ttot, H, DK = q2.shape
    HV, DV = do2.shape[1], do2.shape[2]
    dev = q2.device
    N = len(cu) - 1
    _, offs = chunk_tables(cu)
    NC = Th.shape[1]
    heads = torch.arange(HV, device=dev) // (HV // H)
    dS = torch.zeros(N, HV, DK, DV, dtype=f64, device=dev) if dht is None else _f32(dht.to(f64))
    nch = [offs[n + 1] - offs[n] for n in range(N)]
    rows = torch.arange(BT, device=dev)
    dSnh = torch.zeros(HV, NC, DK, DV, dtype=f64, device=dev)
    dSnl = torch.zeros_like(dSnh)
    dYh = torch.zeros(HV, NC, BT, DV, dtype=f64, device=dev)
    dYl = torch.zeros_like(dYh)
    dv = torch.zeros(Ttot, HV, DV, dtype=f64, device=dev)
    qf, kf, dof = q2.to(f64), k2.to(f64), do2.to(f64)
    for ic in reversed(range(max(nch + [0]))):
        act = [n for n in range(N) if nch[n] > ic]
        a = torch.tensor(act, device=dev, dtype=torch.long)
        t0 = torch.tensor([cu[n] + ic * BT for n in act], device=dev, dtype=torch.long)
        eos = torch.tensor([cu[n + 1] for n in act], device=dev, dtype=torch.long)
        c = torch.tensor([offs[n] + ic for n in act], device=dev, dtype=torch.long)
        tok = t0[:, None] + rows[None, :]
        inb = tok < Ttot
        tokc = torch.where(inb, tok, torch.zeros_like(tok))

        def gat(x, hd=None):
            y = x[tokc]
            if hd is not None:
                y = y[:, :, hd]
            return (y * inb[..., None, None]).permute(0, 2, 1, 3)

        Qc, Kc, dOc = gat(qf, heads), gat(kf, heads), gat(dof)
        Qo, Ko = _in(Qc, operands), _in(Kc, operands)
        th, tl = Th[:, c].transpose(0, 1), Tl[:, c].transpose(0, 1)
        f = Fb[:, c].transpose(0, 1)
        dul = dUloc[:, c].transpose(0, 1)
        dS_a = dS[a]
        sh, sl = _op(dS_a, dt, not one, operands)
        dSnh[:, c], dSnl[:, c] = sh.transpose(0, 1), sl.transpose(0, 1)
        KdS = _f32(Ko @ (sh + sl))
        dU = _f32(dul + _f32(f[:, :, 2, :, None] * KdS))
        uh, ul = _op(dU, dt, not single, operands)
        thT = th.transpose(-1, -2)
        tlT = torch.zeros_like(thT) if single else tl.transpose(-1, -2)
        dY = _f32(thT @ uh + tlT @ uh + thT @ ul)
        yh, yl = _op(dY, dt, not one, operands)
        dYh[:, c], dYl[:, c] = yh.transpose(0, 1), yl.transpose(0, 1)
        dX = _f32(f[:, :, 7, :, None] * dY)
        st = tok < eos[:, None]
        for j in range(len(act)):
            m = st[j]
            dv[tok[j][m]] = dX[j][:, m].transpose(0, 1)
        up = chunk_pow2(f[:, :, 4, 0])[..., None, None] if chunk_exp else 1.0
        a1h, a1l = _op(_f32(f[:, :, 1, :, None] * dOc) * up, dt, not one, operands)
        a2h, a2l = _op(_f32(f[:, :, 0, :, None] * dX) * up, dt, not single, operands)
        QT, KT = Qo.transpose(-1, -2), Ko.transpose(-1, -2)
        # each product scaled back alone (exact), so that without chunk_exp the sum is the split form's, term by term
        dS[a] = _f32(_f32(dS_a * f[:, :, 3, 0, None, None]) + QT @ a1h / up + QT @ a1l / up - KT @ a2h / up
                     - KT @ a2l / up)
    return dSnh, dSnl, dYh, dYl, dv.to(dv_dtype or dt), dS.to(torch.float32)


def chunk_bounds(q2, k2, g2, b2, cu, use_l2) -> torch.Tensor:
    """Emulates ``gdn_bwd_prep``'s ``Lb [HV, NC]`` (fp32): each chunk's log2 norm bound of ``forward.cp_warm``."""
    from kernels.forward.cp_warm import chunk_log2_bounds
    _, kc, _, bc, _, G, _, rk = _gather_chunks(q2, k2, g2, b2, cu, use_l2)
    return chunk_log2_bounds(G, bc, rk, _f32((kc * kc).sum(-1)))[..., -1].to(torch.float32)


def dh_warm(q2, k2, do2, Th, Tl, Fb, dUloc, cu, co, Lb, dht, dt):
    """Emulates ``gdn_bwd_dh_warm``: the segments ``cu`` [NS + 1] (token bounds) with its table ``co`` [4 NS + 1]
    (``dh_segmented.warm_table``); each (segment, value head) runs ``dh`` over the segment and its warm-up chunks
    (``cp_warm.warm_back_host`` on ``Lb`` [HV, NC]) from a zero state gradient, or from its sequence's ``dht``
    [N, HV, DK, DV] (key-first, or None) where that reaches the sequence's end, keeping the segment's own chunks.
    Returns as ``dh``, dh0 [N, HV, DK, DV] per sequence (from each sequence's first segment)."""
    from kernels.forward.cp_warm import warm_back_host
    NS = len(cu) - 1
    offs, last, seq = co[:NS + 1], co[2 * NS + 1:3 * NS + 1], co[3 * NS + 1:]
    H, HV, DK, DV = q2.shape[1], do2.shape[1], q2.shape[2], do2.shape[2]
    dev = q2.device
    NC = Th.shape[1]
    dSnh = torch.zeros(HV, NC, DK, DV, dtype=f64, device=dev)
    dSnl, dYh = torch.zeros_like(dSnh), torch.zeros(HV, NC, BT, DV, dtype=f64, device=dev)
    dYl = torch.zeros_like(dYh)
    dv = torch.zeros(q2.shape[0], HV, DV, dtype=dt, device=dev)
    dh0 = torch.zeros(max(seq, default=-1) + 1, HV, DK, DV, dtype=torch.float32, device=dev)
    for j in range(NS):
        w = warm_back_host(Lb, offs, last, j)
        c0, nch, end = offs[j], offs[j + 1] - offs[j], offs[last[j] + 1]
        for hv in range(HV):
            wj = int(w[hv])
            a, b = cu[j], min(cu[j + 1] + wj * BT, cu[last[j] + 1])
            hd, cs = slice(hv, hv + 1), slice(c0, c0 + nch + wj)
            d = dht[seq[j]:seq[j] + 1, hd] if dht is not None and offs[j + 1] + wj == end else None
            h = hv // (HV // H)
            out = dh(q2[a:b, h:h + 1], k2[a:b, h:h + 1], do2[a:b, hd], Th[hd, cs], Tl[hd, cs], Fb[hd, cs],
                     dUloc[hd, cs], [0, b - a], d, dt)
            for dst, src in zip((dSnh, dSnl, dYh, dYl), out[:4]):
                dst[hv, c0:c0 + nch] = src[0, :nch]
            dv[cu[j]:cu[j + 1], hv] = out[4][:cu[j + 1] - a, 0]
            if j == 0 or seq[j - 1] != seq[j]:
                dh0[seq[j], hv] = out[5][0, 0]
    return dSnh, dSnl, dYh, dYl, dv, dh0


def recompute_warm_states(k2, v2, Ah, Al, F, cu, co, Lb, h0, dt, prec):
    """Emulates ``gdn_state_tables_ws_warm`` (the recompute per dh segment): the segments ``cu`` [NS + 1] with the
    table ``co`` [4 NS + 1] (``dh_segmented.warm_table``); each (segment, value head) runs ``chunk_states`` from
    ``cp_warm.warm_or_start_host``'s chunks before its start (on ``Lb`` [HV, NC]), from zero or, reaching its
    sequence's first chunk, from the sequence's ``h0`` [N, HV, DK, DV] (key-first, or None); the tables of the
    segment's own chunks (Sch, Scl, Uh, Ul as ``chunk_states``)."""
    from kernels.forward.cp_warm import warm_or_start_host
    NS = len(cu) - 1
    seq = co[3 * NS + 1:]

    def start(j, h, skip):
        at_first = co[j] - skip == co[co[NS + 1 + j]]
        return h0[seq[j]:seq[j] + 1, h:h + 1] if h0 is not None and at_first else None
    skips = [warm_or_start_host(Lb, co[:3 * NS + 1], j) for j in range(NS)]
    return segments_from(k2, v2, Ah, Al, F, cu, co[:NS + 1], skips, start, dt, prec)[:4]


def dqk_inter(q2, k2, v2, do2, Sch, Scl, Uh, Ul, dSnh, dSnl, dYh, dYl, Fb, cu, scale, operands: str = "split"):
    """Emulates ``gdn_bwd_dqk_inter``: dqt1, dkt1 [HV, NC, 64, DK] (fp32 values) and the row dots
    qz, kw, kr [1, HV, NC, 64], sd [1, HV, NC, DV], yv [HV, NC, 64]; ``operands``: ``OPERANDS`` (the tables
    passed in that form: ``_one``)."""
    H = q2.shape[1]
    HV = v2.shape[1]
    heads = torch.arange(HV, device=q2.device) // (HV // H)
    qc, kc = _chunks(q2, cu, heads), _chunks(k2, cu, heads)
    vc, doc = _chunks(v2, cu), _in(_chunks(do2, cu), operands)
    St = lambda x: x.transpose(-1, -2)   # noqa: E731  [DK, DV] -> [DV, DK]
    Z = _f32(doc @ St(Sch) + doc @ St(Scl))
    W = _f32(dYh @ St(Sch) + dYl @ St(Sch) + dYh @ St(Scl))
    R = _f32(Uh @ St(dSnh) + Ul @ St(dSnh) + Uh @ St(dSnl))
    G = Fb[:, :, 4]
    EG = torch.exp(G)[..., None]
    EGLG = torch.exp(G[..., -1:] - G)[..., None]
    beta = Fb[:, :, 7, :, None]
    _, valid = token_index(cu, q2.device)
    vm = valid.to(f64)[None, :, :, None]
    dqt = _f32(scale * EG * Z) * vm
    dkt = _f32(-beta * EG * W + EGLG * R) * vm
    qz = _f32((qc * Z).sum(-1))[None]
    kw = _f32((kc * W).sum(-1))[None]
    kr = _f32((kc * R).sum(-1))[None]
    sd = _f32(((Sch + Scl) * (dSnh + dSnl)).sum(-2))[None]     # S o dS' summed over the key dim
    yv = _f32(((dYh + dYl) * vc).sum(-1))
    return dqt, dkt, qz, kw, kr, sd, yv


def dqk_intra(q2, k2, do2, Uh, Ul, dYh, dYl, Fb, cu, scale, dt, operands: str = "split"):
    """Emulates ``gdn_bwd_dqk_intra``: dqt2, dkt2 [HV, NC, 64, DK], rect, db2 [HV, NC, 64] (rect: the dg terms
    of P and A summed over t >= s > j, see ``finish.finish``); the four 64x64 operands single, as the kernel;
    ``operands``: ``OPERANDS``."""
    H = q2.shape[1]
    HV = do2.shape[1]
    dev = q2.device
    heads = torch.arange(HV, device=dev) // (HV // H)
    qc, kc = _in(_chunks(q2, cu, heads), operands), _in(_chunks(k2, cu, heads), operands)
    doc = _in(_chunks(do2, cu), operands)
    QK = _f32(qc @ kc.transpose(-1, -2))
    KK = _f32(kc @ kc.transpose(-1, -2))
    dPU = _f32(doc @ Uh.transpose(-1, -2) + doc @ Ul.transpose(-1, -2))
    dYU = _f32(dYh @ Uh.transpose(-1, -2) + dYl @ Uh.transpose(-1, -2) + dYh @ Ul.transpose(-1, -2))
    G = Fb[:, :, 4]
    F5, F6, beta = Fb[:, :, 5], Fb[:, :, 6], Fb[:, :, 7]
    rows = torch.arange(BT, device=dev)
    D = G[..., :, None] - G[..., None, :]
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    e_c = torch.where(causal, torch.exp(torch.where(causal, D, 0.0)), 0.0)
    e_s = torch.where(lower, e_c, 0.0)
    # dQK = d/d(q~ k~^T) (scale folded in through F5 = scale rq; rq folded back below)
    vrow = (F6 != 0).to(f64)[..., :, None]                      # valid rows (rk > 0 exactly there)
    dqk0 = _f32(scale * e_c * dPU) * vrow                       # dQK = d/d(q~ k~^T)_tj (before the col mask)
    dqk = _f32(F5[..., :, None] * e_c * dPU)                   # scale rq_t e dPU  (= dQK rq_t)
    m1 = _f32(dqk * F6[..., None, :] * QK)                     # dQK o (q~ k~^T)
    braw = _f32(e_s * F6[..., :, None] * F6[..., None, :] * KK)
    dA = torch.where(lower, -dYU, 0.0)
    db2 = _f32((dA * braw).sum(-1))
    dB = _f32(beta[..., :, None] * dA)
    m2 = _f32(dB * braw)
    dBk = _f32(dB * e_s)                                         # d/d(k~ k~^T)_tj = beta_t e_tj dA_tj
    m = _f32(torch.where(lower, m1 + m2, 0.0))                  # only j < t carries a gate difference
    # rect_s = sum_{t >= s} sum_{j < s} m_tj: exclusive prefix over j, then the column sum over t >= s
    mex = _f32(torch.nn.functional.pad(torch.cumsum(m, -1)[..., :-1], (1, 0)))
    rect = _f32(torch.where(rows[:, None] >= rows[None, :], mex, 0.0).sum(-2))
    si = False                                                  # the 64x64 operands: one input-dtype term
    Mq = _op(_f32(dqk0 * F6[..., None, :]), dt, si, operands)   # dq~ = (dQK diag(rk)) k
    Mk1 = _op(dqk, dt, si, operands)                            # dk~ += (dQK diag(rq))^T q
    Mk2 = _op(_f32(dBk * F6[..., None, :]), dt, si, operands)   # dk~ += (dBk diag(rk)) k
    Mk3 = _op(_f32(dBk * F6[..., :, None]), dt, si, operands)   # dk~ += (diag(rk) dBk)^T k
    T_ = lambda x: x.transpose(-1, -2)   # noqa: E731
    dqt = _f32(Mq[0] @ kc + Mq[1] @ kc)
    dkt = _f32(T_(Mk1[0]) @ qc + T_(Mk1[1]) @ qc + Mk2[0] @ kc + Mk2[1] @ kc + T_(Mk3[0]) @ kc + T_(Mk3[1]) @ kc)
    return dqt, dkt, rect, db2


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                               use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                               dh_single: bool = False, tinv_hi_only: bool = False, s_single: bool = False,
                               merge: str = "fp32", lo8_tables: bool = True, operands: str = "split",
                               one_term: bool = False, kernel_dtype: torch.dtype | None = None,
                               group_scales: bool = False, chunk_exp: bool = False, dh_operands: str = "split",
                               dqk_operands: str = "split", p_single: bool = False,
                               dqk_store: torch.dtype | None = None, recompute_one: tuple = (),
                               stages: dict | None = None):
    """Emulated backward with the kernels' shapes: returns dq, dk, dv, dg, dbeta (input dtypes / the gate
    dtypes) and dh0 (fp32, the initial state's layout; None without an initial state).  ``dh_single``: the reverse
    pass's single operands (``BackwardPlan.dh_single``); ``tinv_hi_only``: dh reads Tinv hi alone (a zero lo term),
    as the split dh does on the forward's saved tables; ``s_single``: the recompute's S one term (a zero lo term,
    ``BackwardPlan.s_single``); ``merge``: Tinv and Ag from block merges of that precision (``BackwardPlan.merge``,
    the tables of a forward at that ``Precision.merge``); ``lo8_tables``: the lo terms of the stored S (recompute)
    and dS' (dh) tables that dqk reads, as fp8 under their hi terms' exponents (``lo8``; dh's own recurrence unchanged;
    ``BackwardPlan.lo8``, dispatched; False: in the input dtype); ``operands``: ``OPERANDS`` (other than "split":
    the recompute's S and U tables one term, and ``dh_single``, ``tinv_hi_only``, ``lo8_tables`` have no effect);
    ``one_term``: ``BackwardPlan.one_term`` (with ``dh_single``, ``s_single``, ``lo8_tables`` False: dh's ``one``
    form, dqk reading U's hi term alone); ``kernel_dtype``: the kernels' input dtype where it is not q's (the
    pipeline's plan of another ``io_dtype``: the inputs converted by ``as_kernel_dtype``, dq, dk, dv rounded once to
    q's dtype); ``group_scales``: dO, dht and v, h0 times the powers of two of ``scales.group_exponents`` (each GVA
    group's largest magnitude in [1, 2)), every gradient scaled back exactly (``scales.unscale``); ``chunk_exp``
    (with ``one_term``): dh's F1 dO and F0 dX under a power of two per chunk (``dh(chunk_exp=True)``).  The
    pipeline's one-term plans compute ``one_term`` with both.  ``dh_operands``, ``dqk_operands`` (with
    ``operands`` "split", a precision study: no kernel computes them): ``OPERANDS`` of one kernel alone, dh's
    operands and the dS', dY tables it stores, or dqk's operands and every table it reads (S, U, dS', dY, one
    term each), the other kernels split.  ``p_single``: dUloc from one input-dtype term of P (``local_du``).
    ``dqk_store``: dq~ and dk~ per value head rounded to that dtype before their GVA group sums (under
    ``group_scales``, the scaled values; fp16: the fused kernel's ``fused_dq16`` stores, ``FUSED_FP16``).
    ``recompute_one``: the recompute's products with these fields of ``RECOMPUTE_OPERANDS`` one term
    (``fwd_precision``; ``RECOMPUTE_ONE``: ``BackwardPlan.recompute_one``'s).  ``stages``: a dict that receives the
    intermediates in the layouts of ``pipeline.STAGE_LAYOUT`` (for stage-by-stage checks)."""
    if group_scales:
        H = q.shape[2]
        ea, eb = group_exponents(do, dht, H), group_exponents(v, initial_state, H)
        sa, sb = pow2(-ea), pow2(-eb)
        got = chunk_gated_delta_rule_bwd(
            q, k, (v.float() * sb[:, None]).to(v.dtype), g, beta, (do.float() * sa[:, None]).to(do.dtype),
            scale_states(dht, sa), scale, scale_states(initial_state, sb), use_qk_l2norm_in_kernel, state_v_first,
            cu_seqlens,
            dh_single=dh_single, tinv_hi_only=tinv_hi_only, s_single=s_single, merge=merge, lo8_tables=lo8_tables,
            operands=operands, one_term=one_term, kernel_dtype=kernel_dtype, chunk_exp=chunk_exp,
            dh_operands=dh_operands, dqk_operands=dqk_operands, p_single=p_single, dqk_store=dqk_store,
            recompute_one=recompute_one, stages=stages)
        return unscale(got, factors(ea, eb), H)
    out_dt, g_dt, beta_dt = q.dtype, g.dtype, beta.dtype
    if kernel_dtype is not None and kernel_dtype != q.dtype:
        q, k, v, g, beta, do = as_kernel_dtype(kernel_dtype, q, k, v, g, beta, do)
    B, T, H, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    dt = q.dtype
    scale = DK ** -0.5 if scale is None else float(scale)
    cu = [b * T for b in range(B + 1)] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    Ttot = cu[-1]                                        # tokens past it are padding: never read, zero gradients
    q2, k2 = q.reshape(B * T, H, DK)[:Ttot], k.reshape(B * T, H, DK)[:Ttot]
    v2, do2 = v.reshape(B * T, HV, DV)[:Ttot], do.reshape(B * T, HV, DV)[:Ttot].to(dt)
    g2 = g.reshape(B * T, HV)[:Ttot].to(torch.float32)
    b2 = beta.reshape(B * T, HV)[:Ttot].to(torch.float32)
    use_l2 = bool(use_qk_l2norm_in_kernel)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(torch.float32)
        h0 = h0.transpose(-1, -2) if state_v_first else h0
    dS0 = None
    if dht is not None:
        dS0 = dht.to(torch.float32)
        dS0 = dS0.transpose(-1, -2) if state_v_first else dS0
    if operands not in OPERANDS:
        raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")
    if one_term and not (dh_single and s_single and not lo8_tables and operands == "split"):
        raise ValueError("one_term goes with dh_single, s_single, lo8_tables False and operands 'split'")
    for name, val in (("dh_operands", dh_operands), ("dqk_operands", dqk_operands)):
        if val not in OPERANDS:
            raise ValueError(f"{name} must be one of {OPERANDS}, got {val!r}")
        if val != "split" and (operands != "split" or one_term):
            raise ValueError(f"{name} other than 'split' goes with operands 'split' and one_term False")
    prec = fwd_precision(s_single, merge, recompute_one)
    _, offs = chunk_tables(cu)
    Ah, Al, F = intra_chunk(q2, k2, g2, b2, cu, scale, use_l2, dt, prec)
    Sch, Scl, Uh, Ul, _ = chunk_states(k2, v2, Ah, Al, F, cu, offs, h0, dt, prec)
    Th, Tl, Fb, dUloc = prep(q2, k2, do2, g2, b2, cu, scale, use_l2, dt, prec.merge, operands, p_single)
    dSnh, dSnl, dYh, dYl, dv, dh0 = dh(q2, k2, do2, Th, torch.zeros_like(Tl) if tinv_hi_only else Tl, Fb, dUloc, cu,
                                       dS0, dt, dh_single, dh_operands if dh_operands != "split" else operands,
                                       one_term, out_dt, chunk_exp)
    if operands != "split":
        (Sch, Scl), (Uh, Ul) = _one(Sch, Scl, dt, operands), _one(Uh, Ul, dt, operands)
    elif lo8_tables:
        Scl, dSnl = lo8(Sch, Scl, dt), lo8(dSnh, dSnl, dt)
    Uld = torch.zeros_like(Ul) if one_term else Ul     # U's lo term as dqk reads it (none with one_term)
    qop = operands
    if dqk_operands != "split":
        (Sch, Scl), (Uh, Uld) = _one(Sch, Scl, dt, dqk_operands), _one(Uh, Ul, dt, dqk_operands)
        (dSnh, dSnl), (dYh, dYl) = _one(dSnh, dSnl, dt, dqk_operands), _one(dYh, dYl, dt, dqk_operands)
        qop = dqk_operands
    dqt1, dkt1, qz, kw, kr, sd, yv = dqk_inter(q2, k2, v2, do2, Sch, Scl, Uh, Uld, dSnh, dSnl, dYh, dYl, Fb, cu,
                                               scale, qop)
    dqt2, dkt2, rect, db2 = dqk_intra(q2, k2, do2, Uh, Uld, dYh, dYl, Fb, cu, scale, dt, qop)
    if stages is not None:
        stages.update(Tinv=Th + Tl, Fb=Fb, dUloc=dUloc, dSn=dSnh + dSnl, dY=dYh + dYl, qz=qz.sum(0), kw=kw.sum(0),
                       kr=kr.sum(0), sd=sd.sum(0), yv=yv, rect=rect, db2=db2, S=Sch + Scl, U=Uh + Ul)
    tok, valid = token_index(cu, q.device)
    dqv = torch.zeros(Ttot, HV, DK, dtype=torch.float32, device=q.device)
    dkv = torch.zeros_like(dqv)
    m = valid
    dqv[tok[m]] = _f32(dqt1 + dqt2).permute(1, 2, 0, 3)[m].float()
    dkv[tok[m]] = _f32(dkt1 + dkt2).permute(1, 2, 0, 3)[m].float()
    if dqk_store is not None:
        dqv, dkv = dqv.to(dqk_store).float(), dkv.to(dqk_store).float()
    if stages is not None:
        stages.update(dqv=group_sum(dqv, H), dkv=group_sum(dkv, H))
    dq, dk, dg, db = finish(Fb=Fb, qz=qz, kw=kw, kr=kr, sd=sd, yv=yv, rect=rect, db2=db2, dqv=dqv, dkv=dkv, q=q2,
                            k=k2, H=H, use_l2=use_l2, tok=tok, valid=valid)
    dq = pad_rows(dq, B * T).reshape(B, T, H, DK).to(out_dt)
    dk = pad_rows(dk, B * T).reshape(B, T, H, DK).to(out_dt)
    dv = pad_rows(dv, B * T).reshape(B, T, HV, DV).to(out_dt)
    dg = pad_rows(dg, B * T).reshape(B, T, HV).to(g_dt)
    db = pad_rows(db, B * T).reshape(B, T, HV).to(beta_dt)
    if initial_state is None:
        dh0 = None
    elif state_v_first:
        dh0 = dh0.transpose(-1, -2).contiguous()
    return dq, dk, dv, dg, db, dh0
