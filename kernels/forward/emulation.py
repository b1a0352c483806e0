"""Pure-torch emulation of exactly the tiling and precisions of the forward kernels.

Runs anywhere torch runs (CPU in CI).  It follows the kernels step by step:
same 64-token chunks per sequence, same zero padding, same padded intermediate
layout (``Ah, Al [HV, NC, 64, 64]``, ``F [HV, NC, 8, 64]``, the chunk-start
states and ``U``), same operations in the same order, and it rounds explicitly
wherever the kernels round:

* ``rd(x)``  - to the input dtype (bf16/fp16): every wgmma operand;
* ``f32(x)`` - to fp32: every accumulator / CUDA-core result;
* ``split(x) = (rd(x), rd(x - rd(x)))`` - the two-term operands (per ``precision.Precision``);
* with fp16 operands (``Precision.half``) every operand after the intra kernel's merges is rounded to fp16
  instead, o still to the input dtype; q and k (bf16 inputs) as the intra kernel's copies, each row scaled by
  ``2^-c`` (``row_exponents``; ``2^c`` in the gate table's rows 0-2), and every value column by ``value_scales``
  (over the whole call, where the fused kernel scales each chunk by the running maximum so far: exact powers of
  two, so either changes a result only where fp16's range would have been left).

A wgmma with fp32 accumulation is emulated as an fp64 product of the (exact)
rounded operands followed by one rounding to fp32; this matches the kernel up
to the order of the fp32 additions.  The 16x16 diagonal-block inverses are
emulated as fp64 solves rounded to fp32 (the kernel's fp32 forward
substitution agrees to a few fp32 ulps); the wgmma block merges are emulated exactly
as the kernel does them, the fp32 ones as exact products rounded once to fp32 (the
kernel's fp32 FMA chains agree to a few fp32 ulps).

``intra_chunk`` / ``chunk_states`` / ``output`` are the three kernels (``intra_chunk.py``,
``state_smem.py`` / ``state_registers.py``, ``output.py``) and return their outputs in their
layouts, so the GPU check can compare the kernels stage by stage;
``chunk_gated_delta_rule_at`` runs them end to end (optionally with the CP state
passing); ``chunk_gated_delta_rule(...)`` has the public API's signature.
"""

from __future__ import annotations

import torch

BT = 64
f64 = torch.float64


def _rd(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return x.to(dt).to(f64)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(f64)


def _split(x: torch.Tensor, dt: torch.dtype):
    hi = _rd(x, dt)
    lo = _rd(_f32(x - hi), dt)
    return hi, lo


def chunk_tables(cu_seqlens: list[int]):
    """Host-side chunk bookkeeping, same as the API.

    Returns (chunk_indices [NC, 2] as list of (seq, chunk), chunk_offsets list [N + 1]).
    """
    idx, offs = [], [0]
    for n in range(len(cu_seqlens) - 1):
        nch = -(-(cu_seqlens[n + 1] - cu_seqlens[n]) // BT)
        idx.extend((n, i) for i in range(nch))
        offs.append(offs[-1] + nch)
    return idx, offs


def _solve(A: torch.Tensor, dt: torch.dtype, merge: str = "fp32") -> torch.Tensor:
    """(I + A)^{-1} for strictly lower ``A [..., 64, 64]`` the way the intra kernels do it:
    fp32 inverses of the 16x16 diagonal blocks (exact forward substitution, emulated by an fp64
    solve rounded to fp32), then ``L <- L - L A_o L`` at widths 16 and 32 with "split" (two-term
    operands, hi*hi + lo*hi + hi*lo), "bf16" (single input-dtype operands) or "fp32" (unrounded operands, the
    CUDA-core merges) products, fp32 results (``gdn_intra`` with ``Precision.merge``)."""
    dev = A.device
    eye16 = torch.eye(16, dtype=f64, device=dev)
    L = torch.zeros_like(A)
    for b in range(4):
        sl = slice(16 * b, 16 * b + 16)
        L[..., sl, sl] = _f32(torch.linalg.solve_triangular(eye16 + A[..., sl, sl], eye16.expand_as(A[..., sl, sl]),
                                                            upper=False, unitriangular=True))
    rows = torch.arange(BT, device=dev)

    def prod(x, y):
        if merge == "split":
            xh, xl = _split(x, dt)
            yh, yl = _split(y, dt)
            return _f32(xh @ yh + xl @ yh + xh @ yl)
        if merge == "bf16":
            return _f32(_rd(x, dt) @ _rd(y, dt))
        if merge == "fp32":
            return _f32(x @ y)
        raise ValueError(merge)

    for w in (16, 32):
        rb, cb = rows[:, None] // w, rows[None, :] // w
        Ao = torch.where((rb % 2 == 1) & (cb == rb - 1), A, torch.zeros_like(A))
        L = _f32(L - prod(L, prod(Ao, L)))
    return L


def _gather_chunks(q, k, g, beta, cu_seqlens: list[int], use_l2: bool):
    """Padded chunks as the intra kernels load them: qc, kc [HV, NC, 64, DK], gc, bc [HV, NC, 64]
    (fp64, zero past the end of each sequence), the valid mask [HV, NC, 64], the chunk-local fp32
    cumsum G and the fp32 L2-norm row factors rq, rk (ones without the in-kernel norm)."""
    Ttot, H, DK = q.shape
    HV = g.shape[1]
    idx, _ = chunk_tables(cu_seqlens)
    NC = len(idx)
    dev = q.device
    t0 = torch.tensor([cu_seqlens[n] + i * BT for n, i in idx], device=dev, dtype=torch.long)
    eos = torch.tensor([cu_seqlens[n + 1] for n, _ in idx], device=dev, dtype=torch.long)
    rows = torch.arange(BT, device=dev)
    tok = t0[:, None] + rows[None, :]                      # [NC, 64]
    valid = tok < eos[:, None]
    tokc = torch.where(valid, tok, torch.zeros_like(tok))
    heads = torch.arange(HV, device=dev) // (HV // H)
    qc = (q.to(f64)[tokc][:, :, heads] * valid[..., None, None]).permute(2, 0, 1, 3)
    kc = (k.to(f64)[tokc][:, :, heads] * valid[..., None, None]).permute(2, 0, 1, 3)
    gc = (g.to(f64)[tokc] * valid[..., None]).permute(2, 0, 1)
    bc = (beta.to(f64)[tokc] * valid[..., None]).permute(2, 0, 1)
    vmask = valid[None].expand(HV, NC, BT)
    G = _f32(gc.to(torch.float32).cumsum(-1))
    if use_l2:
        rq = _f32(1.0 / torch.sqrt(_f32((qc * qc).sum(-1)) + 1e-6))
        rk = _f32(1.0 / torch.sqrt(_f32((kc * kc).sum(-1)) + 1e-6))
    else:
        rq = torch.ones_like(G)
        rk = torch.ones_like(G)
    return qc, kc, gc, bc, vmask, G, rq, rk


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *, plan=None):
    """Same signature and result layout as ``kernels.forward.pipeline.chunk_gated_delta_rule``, computed by the
    emulation (``chunk_gated_delta_rule_at``) with the precision and CP segments of ``plan`` (a
    ``kernels.plan.ForwardPlan``; None: the one ``kernels.plan.forward_plan`` dispatches for these inputs; the
    other fields of a plan change no rounding)."""
    from kernels.interface import TL_DTYPE, max_chunks
    from kernels.plan import forward_plan
    if plan is None:
        B, T, HV = q.shape[0], q.shape[1], v.shape[2]
        cu = None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
        N = B if cu is None else len(cu) - 1
        plan = forward_plan(TL_DTYPE[q.dtype], N, HV, max_chunks(B, T, cu), DK=q.shape[-1])
    return chunk_gated_delta_rule_at(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, prec=plan.precision,
                                     cp_segments_n=plan.cp, warm=plan.warm, split_heads=plan.split_heads)


# ----------------------------------------------------------------------------------------------
# The kernels: intra-chunk kernel (no P), state kernel storing the chunk states and U, output kernel recomputing
# P from q/k; optional segment-parallel (context-parallel) state passing.  Every rounding is a field of
# ``precision.Precision``; the kernels follow the same fields at compile time.
# ----------------------------------------------------------------------------------------------

def _ceil_log2(m: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(m))`` of magnitudes ``m`` (-60 for 0), as the kernels form their power-of-two scales."""
    return torch.ceil(torch.log2(m.clamp_min(2.0 ** -60)))


def row_exponents(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(max |x|))`` over the last dim (-60 for a zero row): the power of two that takes the row into
    [-1, 1], as ``gdn_intra`` computes it for its fp16 copies of q and k."""
    return _ceil_log2(x.abs().amax(-1))


def value_scales(v: torch.Tensor, h0) -> torch.Tensor:
    """``[HV, V]`` fp32: ``2^-c`` with ``c = ceil(log2(m))``, ``m`` the largest magnitude of value column j of v
    ``[Ttot, HV, V]`` and of the initial states ``h0`` (``[N, HV, K, V]``, key-first): the emulation's column scales
    for fp16 operands, over the whole call (the fused kernel's are running maxima per sequence)."""
    m = v.abs().amax(0).to(torch.float32)
    if h0 is not None:
        m = torch.maximum(m, h0.abs().amax(dim=(0, 2)).to(torch.float32))
    return torch.exp2(-_ceil_log2(m))


def _op(prec, dt: torch.dtype) -> torch.dtype:
    """The wgmma operand dtype after the intra kernel's merges (``Precision.operand_dtype``)."""
    from kernels.interface import TL_DTYPE, TORCH_DTYPE
    return TORCH_DTYPE[prec.operand_dtype(TL_DTYPE[dt])]


def p16_rows(P: torch.Tensor) -> torch.Tensor:
    """P (fp64 values ``[..., 64, 64]``) as ``Precision.pu16`` stores it, scaled back: each row whose largest magnitude
    m passes 2^15 times ``d = 2^(15 - ceil(log2 m))``, the others as they are, rounded to fp16 (``gdn_intra``'s fp16
    P table; ``d`` goes into the gate table)."""
    d = torch.exp2(-(_ceil_log2(P.abs().amax(-1, keepdim=True)) - 15).clamp_min(0))
    return (P * d).to(torch.float16).to(f64) / d


def _two(x, dt, split: bool):
    """The wgmma operand(s) of an fp32 value: (hi, lo) with lo = 0 when not split."""
    hi = _rd(x, dt)
    return (hi, _rd(_f32(x - hi), dt)) if split else (hi, torch.zeros_like(hi))


def _tinv(kc, bc, G, rk, dt: torch.dtype, merge: str):
    """Tinv = (I + A)^-1 of every chunk, A = beta_t rk_t rk_j e^(G_t - G_j) (k_t . k_j) (j < t), as
    ``gdn_intra`` and ``gdn_bwd_prep`` compute it (``merge``: the merge precision)."""
    rows = torch.arange(BT, device=kc.device)
    KK = _f32(kc @ kc.transpose(-1, -2))
    D = G[..., :, None] - G[..., None, :]
    lower = rows[:, None] > rows[None, :]
    e_strict = torch.where(lower, torch.exp(torch.where(lower, D, 0.0)), 0.0)
    A = _f32(bc[..., :, None] * rk[..., :, None] * rk[..., None, :] * e_strict * KK)
    return _solve(A, dt, merge)


def _gate_table(G, rk, rq, scale: float, vmask, row7, fk=None, fq=None):
    """The gate table [HV, NC, 8, 64] of the intra / prep kernels: e^G rk, scale e^G rq, e^(GL-G) rk, e^GL,
    G, scale rq, rk (0 past the end of a sequence but e^GL and G), and ``row7``; ``fk`` / ``fq`` replace rk / rq
    in rows 0-2 (the fp16 copies' row scales undone)."""
    GL = G[..., -1:]
    fk = rk if fk is None else fk
    fq = rq if fq is None else fq
    return torch.stack([
        _f32(torch.exp(G) * fk) * vmask,
        _f32(scale * torch.exp(G) * fq) * vmask,
        _f32(torch.exp(GL - G) * fk) * vmask,
        _f32(torch.exp(GL)).expand_as(G),
        G,
        _f32(scale * rq) * vmask,
        rk * vmask,
        row7,
    ], dim=2)


def intra_chunk(q, k, g, beta, cu_seqlens: list[int], scale: float, use_l2: bool, dt: torch.dtype, prec):
    """Emulates ``gdn_intra``: returns Ah, Al [HV, NC, 64, 64] (Al = 0 unless prec.ag == "split")
    and F [HV, NC, 8, 64] (rows: e^G rk, scale e^G rq, e^(GL-G) rk, e^GL, G, scale rq, rk, and the log2 norm
    bounds' cumsum of ``cp_warm``)."""
    from .cp_warm import chunk_log2_bounds
    qc, kc, gc, bc, vmask, G, rq, rk = _gather_chunks(q, k, g, beta, cu_seqlens, use_l2)
    vmask = vmask.to(f64)
    row7 = chunk_log2_bounds(G, bc, rk, _f32((kc * kc).sum(-1)))
    Tinv = _tinv(kc, bc, G, rk, dt, prec.merge)
    Ag = _f32(Tinv * bc[..., None, :])
    Ah, Al = _two(Ag, _op(prec, dt), prec.ag == "split")
    fk = fq = None
    if _op(prec, dt) != dt:                 # the fp16 copies of q and k: their row scales undone in rows 0-2
        fk, fq = rk * torch.exp2(row_exponents(kc)), rq * torch.exp2(row_exponents(qc))
    return Ah, Al, _gate_table(G, rk, rq, scale, vmask, row7, fk, fq)


def _chunk_gather(x, tokc, inb, heads=None):
    y = x[tokc]
    if heads is not None:
        y = y[:, :, heads]
    return (y * inb[..., None, None]).permute(0, 2, 1, 3)


def chunk_states(k, v, Ah, Al, F, cu_seqlens: list[int], chunk_offsets: list[int], h0, dt, prec, *,
             store_chunks: bool = True, aug: bool = False):
    """Emulates ``gdn_state_smem`` over the "sequences" ``cu_seqlens`` whose first chunk ids are
    ``chunk_offsets`` (segments of a sequence for the CP path).  Per chunk::

        Sc = split(S) (hi, + lo when prec.s == "split")  -> Sch, Scl    (chunk-start state, for o)
        X  = V - F0 (K (Sh + Sl?))                          (K@S lo only when prec.ks == "split")
        U  = Ah Xh + Al Xh + Ah Xl                          (terms present per prec.ag / prec.x)
        Uh, Ul = split(U)  (Ul = 0 unless prec.u == "split"; U unrounded with prec.pu16: ``output`` rounds it)
        S  = F3 S + K^T (rd(F2 U) + lo?)                    (lo when prec.upd == "split")

    ``aug``: the phase-1 scan of the CP path: value columns [DV, 2 DV) carry the chunk-transition
    product M (v = 0 there, start = I) and the first DV columns start from 0.
    Returns (Sch, Scl, Uh, Ul, S_end): chunk tables [HV, NC, DK, DV'] / [HV, NC, 64, DV'] (None
    unless store_chunks) and the fp32 end state of every sequence [N, HV, DK, DV'].
    """
    Ttot, H, DK = k.shape
    HV, DV = v.shape[1], v.shape[2]
    r = HV // H
    dev = k.device
    N = len(cu_seqlens) - 1
    NC = Ah.shape[1]
    heads = torch.arange(HV, device=dev) // r
    W = 2 * DV if aug else DV
    if aug:
        S = torch.zeros(N, HV, DK, W, dtype=f64, device=dev)
        S[..., DV:] = torch.eye(DK, dtype=f64, device=dev)
    else:
        S = torch.zeros(N, HV, DK, W, dtype=f64, device=dev) if h0 is None else _f32(h0.to(f64))
    nch = [-(-(cu_seqlens[n + 1] - cu_seqlens[n]) // BT) for n in range(N)]
    rows = torch.arange(BT, device=dev)
    od = _op(prec, dt)
    kf, vf = _rd(k.to(f64), od), v.to(f64)
    if store_chunks:
        Sch = torch.zeros(HV, NC, DK, W, dtype=f64, device=dev)
        Scl = torch.zeros_like(Sch)
        Uh = torch.zeros(HV, NC, BT, W, dtype=f64, device=dev)
        Ul = torch.zeros_like(Uh)
    for ic in range(max(nch + [0])):
        act = [n for n in range(N) if nch[n] > ic]
        a = torch.tensor(act, device=dev, dtype=torch.long)
        t0 = torch.tensor([cu_seqlens[n] + ic * BT for n in act], device=dev, dtype=torch.long)
        c = torch.tensor([chunk_offsets[n] + ic for n in act], device=dev, dtype=torch.long)
        tok = t0[:, None] + rows[None, :]
        inb = tok < Ttot
        tokc = torch.where(inb, tok, torch.zeros_like(tok))
        Kc = _chunk_gather(kf, tokc, inb, heads)                 # [A, HV, 64, DK]
        Vc = _chunk_gather(vf, tokc, inb)                        # [A, HV, 64, DV]
        if aug:
            Vc = torch.cat([Vc, torch.zeros_like(Vc)], dim=-1)
        ah, al = Ah[:, c].transpose(0, 1), Al[:, c].transpose(0, 1)
        f = F[:, c].transpose(0, 1)
        S_a = S[a]
        Sh, Sl = _two(S_a, od, prec.s == "split" or prec.ks == "split")
        if store_chunks:
            Sch[:, c] = Sh.transpose(0, 1)
            if prec.s == "split":
                Scl[:, c] = Sl.transpose(0, 1)
        KS = _f32(Kc @ (Sh + (Sl if prec.ks == "split" else 0)))
        X = _f32(Vc - _f32(f[:, :, 0, :, None] * KS))
        Xh, Xl = _two(X, od, prec.x == "split")
        U = _f32(ah @ Xh + al @ Xh + ah @ Xl)
        Uh_, Ul_ = (U, torch.zeros_like(U)) if prec.pu16 else _two(U, od, prec.u == "split")
        if store_chunks:
            Uh[:, c] = Uh_.transpose(0, 1)
            Ul[:, c] = Ul_.transpose(0, 1)
        Up = _f32(f[:, :, 2, :, None] * U)
        Uph, Upl = _two(Up, od, prec.upd == "split")
        S_a = _f32(_f32(S_a * f[:, :, 3, 0, None, None]) + Kc.transpose(-1, -2) @ Uph + Kc.transpose(-1, -2) @ Upl)
        S[a] = S_a
    if not store_chunks:
        return None, None, None, None, S
    return Sch, Scl, Uh, Ul, S


def gated_scores(q, k, F, cu_seqlens: list[int], dt, prec):
    """Emulates the P of ``gdn_output`` and of ``gdn_state_output_ws`` (its P warpgroup, or the intra kernel's P
    tables with ``pt``): ``P = scale rq_t rk_j e^(G_t - G_j) (q_t . k_j)`` (j <= t, t valid; fp32) -> (Ph, Pl)
    [HV, NC, 64, 64] (Pl = 0 unless prec.p == "split")."""
    Ttot, H, DK = q.shape
    HV = F.shape[0]
    dev = q.device
    tok, eos, inb, tokc = _chunk_tokens(cu_seqlens, Ttot, dev)
    rows = torch.arange(BT, device=dev)
    heads = torch.arange(HV, device=dev) // (HV // H)
    Qc = _chunk_gather(q.to(f64), tokc, inb, heads).transpose(0, 1)     # [HV, NC, 64, DK]
    Kc = _chunk_gather(k.to(f64), tokc, inb, heads).transpose(0, 1)
    G = F[:, :, 4]
    D = G[..., :, None] - G[..., None, :]
    valid = (tok < eos[:, None])[None]                                   # [1, NC, 64]
    causal = (rows[:, None] >= rows[None, :]) & valid[..., :, None]
    e = torch.where(causal, torch.exp(torch.where(causal, D, 0.0)), 0.0)
    QK = _f32(Qc @ Kc.transpose(-1, -2))
    P = _f32(F[:, :, 5, :, None] * F[:, :, 6, None, :] * e * QK)
    if prec.pu16:
        return p16_rows(P), torch.zeros_like(P)
    return _two(P, _op(prec, dt), prec.p == "split")


def output(q, k, F, Sch, Scl, Uh, Ul, cu_seqlens: list[int], dt, prec, P=None, col_scale=None, u_scale=None):
    """Emulates ``gdn_output`` (fully parallel over chunks)::

        P  = gated_scores(...) -> Ph (+ Pl)     (or ``P`` = (Ph, Pl) as given: the intra kernel's P tables)
        O  = F1 (Q (Sch + Scl)) + Ph Uh + Pl Uh + Ph Ul      (/ col_scale [HV, V] per value column, if given)

    With ``prec.pu16`` P is one fp16 term, its rows scaled into fp16's range (``p16_rows``), and U one fp16 term under
    ``u_scale [HV, V]`` (``value_scales``), their product in fp32.
    """
    Ttot, H, DK = q.shape
    HV = F.shape[0]
    dev = q.device
    tok, eos, inb, tokc = _chunk_tokens(cu_seqlens, Ttot, dev)
    heads = torch.arange(HV, device=dev) // (HV // H)
    Qc = _rd(_chunk_gather(q.to(f64), tokc, inb, heads).transpose(0, 1), _op(prec, dt))   # [HV, NC, 64, DK]
    valid = (tok < eos[:, None])[None]                                   # [1, NC, 64]
    Ph, Pl = P if P is not None else gated_scores(q, k, F, cu_seqlens, dt, prec)
    if prec.pu16:                            # U as the state pass hands it over (fp32), one fp16 term
        sc = u_scale.to(f64)[:, None, None, :]
        Uh, Ul = (Uh * sc).to(torch.float16).to(f64) / sc, torch.zeros_like(Uh)
    QS = _f32(Qc @ (Sch + Scl))
    O = _f32(_f32(QS * F[:, :, 1, :, None]) + Ph @ Uh + Pl @ Uh + Ph @ Ul)   # [HV, NC, 64, DV]
    if col_scale is not None:
        O = O / col_scale.to(f64)[:, None, None, :]
    o = torch.zeros(Ttot, HV, O.shape[-1], dtype=f64, device=dev)
    store = valid[0]
    o[tok[store]] = O.permute(1, 2, 0, 3)[store]
    return o.to(dt)


def _chunk_tokens(cu_seqlens: list[int], Ttot: int, dev):
    """Per chunk of ``chunk_tables(cu_seqlens)``: its 64 token rows ``tok [NC, 64]``, its sequence's end
    ``eos [NC]``, which rows exist (``inb``: below ``Ttot``) and the rows clamped to 0 where not (``tokc``)."""
    idx, _ = chunk_tables(cu_seqlens)
    t0 = torch.tensor([cu_seqlens[n] + i * BT for n, i in idx], device=dev, dtype=torch.long)
    eos = torch.tensor([cu_seqlens[n + 1] for n, _ in idx], device=dev, dtype=torch.long)
    tok = t0[:, None] + torch.arange(BT, device=dev)[None, :]
    inb = tok < Ttot
    return tok, eos, inb, torch.where(inb, tok, torch.zeros_like(tok))


def cp_segments(cu_seqlens: list[int], n_seg: int):
    """Split every sequence into at most ``n_seg`` chunk-aligned segments of about equal length.

    Returns (seg_cu [Nseg + 1] token boundaries, seg_chunk_offsets [Nseg + 1] first chunk ids, seg_of
    [N + 1] the first segment of each sequence)."""
    seg_cu, seg_co, seg_of = [0], [0], [0]
    c = 0
    for n in range(len(cu_seqlens) - 1):
        bos, eos = cu_seqlens[n], cu_seqlens[n + 1]
        nch = -(-(eos - bos) // BT)
        p = max(1, min(n_seg, nch))
        bounds = [round(i * nch / p) for i in range(p + 1)]
        for i in range(p):
            seg_cu.append(min(eos, bos + bounds[i + 1] * BT))
            seg_co.append(c + bounds[i + 1])
        c += nch
        seg_of.append(len(seg_cu) - 1)
    return seg_cu, seg_co, seg_of


def cp_fixup(ZM, h0, seg_of, DV):
    """Phase 2 of the CP path (fp32): S_start(first) = h0 (or 0), S_start(p + 1) = M_p S_start(p) + Z_p
    within each sequence.  ZM [Nseg, HV, DK, 2 DV] = [Z | M].  Returns S_start [Nseg, HV, DK, DV] (fp32 values)."""
    Nseg, HV, DK = ZM.shape[:3]
    out = torch.zeros(Nseg, HV, DK, DV, dtype=f64, device=ZM.device)
    for n in range(len(seg_of) - 1):
        S = torch.zeros(HV, DK, DV, dtype=f64, device=ZM.device) if h0 is None else _f32(h0[n].to(f64))
        for p in range(seg_of[n], seg_of[n + 1]):
            out[p] = S
            S = _f32(ZM[p, :, :, DV:] @ S + ZM[p, :, :, :DV])
    return out


def warm_segment_states(k, v, Ah, Al, F, seg_cu, seg_co, seg_of, h0s, dt, prec):
    """``chunk_states`` per CP segment and value head as the "ws" kernel runs it with warm-up starts
    (``cp_warm``): from ``h0s`` (its exact start state) where the segment needs it, from the sequence's initial
    state where the warm-up reaches the sequence's first chunk, else from zero ``w`` chunks early; the chunk
    tables of the segment's own chunks, and every segment's end state [Nseg, HV, DK, DV]."""
    from .cp_warm import warm_chunks_host, warm_offsets
    co = warm_offsets(seg_co, seg_of)
    Nseg = len(seg_cu) - 1
    w = [warm_chunks_host(F[:, :, 7, -1], co, j) for j in range(Nseg)]

    def start(j, h, skip):
        first = co[Nseg + 1 + j]
        if w[j][h] <= 0:
            return h0s[j, h:h + 1][None]
        if seg_co[j] - skip == seg_co[first]:
            return h0s[first, h:h + 1][None]
        return torch.zeros_like(h0s[j, h:h + 1])[None]
    return segments_from(k, v, Ah, Al, F, seg_cu, seg_co, [x.clamp(min=0) for x in w], start, dt, prec)


def segments_from(k, v, Ah, Al, F, seg_cu, seg_co, skips, start, dt, prec):
    """``chunk_states`` of each CP segment ``j`` (tokens ``seg_cu``, first chunks ``seg_co``) and value head ``h``
    from ``skips[j][h]`` chunks before the segment and the start state ``start(j, h, skip)`` ([1, 1, DK, DV]
    key-first, or None: zero): the chunk tables of the segment's own chunks (Sch, Scl, Uh, Ul as ``chunk_states``)
    and every segment's end state [Nseg, HV, DK, DV]."""
    Nseg = len(seg_cu) - 1
    HV, H = v.shape[1], k.shape[1]
    r = HV // H
    NC, DK, DV = Ah.shape[1], k.shape[2], v.shape[2]
    Sch = torch.zeros(HV, NC, DK, DV, dtype=f64, device=k.device)
    Scl = torch.zeros_like(Sch)
    Uh = torch.zeros(HV, NC, BT, DV, dtype=f64, device=k.device)
    Ul = torch.zeros_like(Uh)
    Send = torch.zeros(Nseg, HV, DK, DV, dtype=f64, device=k.device)
    for j in range(Nseg):
        for h in range(HV):
            skip = int(skips[j][h])
            cu = [seg_cu[j] - skip * BT, seg_cu[j + 1]]
            sl = slice(h, h + 1)
            a, b_, c, d, end = chunk_states(k[:, h // r:h // r + 1], v[:, sl], Ah[sl], Al[sl], F[sl], cu,
                                            [seg_co[j] - skip, 0], start(j, h, skip), dt, prec)
            own = slice(seg_co[j], seg_co[j + 1])
            Sch[sl, own], Scl[sl, own], Uh[sl, own], Ul[sl, own] = a[:, own], b_[:, own], c[:, own], d[:, own]
            Send[j, h] = end[0, 0]
    return Sch, Scl, Uh, Ul, Send


def split_sequences(F: torch.Tensor, cu_seqlens: list[int], n_seg: int) -> torch.Tensor:
    """bool [N, HV]: the (sequence, value head) pairs that ``ForwardPlan.split_heads`` runs as warm-up CP segments
    (``n_seg`` a sequence, ``cp_segments``): every segment start of the sequence but its first takes a warm-up
    (``cp_warm.warm_chunks_host`` on row 7 of the gate table ``F`` [HV, NC, 8, 64])."""
    from .cp_warm import warm_chunks_host, warm_offsets
    seg_cu, seg_co, seg_of = cp_segments(cu_seqlens, n_seg)
    co = warm_offsets(seg_co, seg_of)
    L = F[:, :, 7, -1]
    out = torch.ones(len(cu_seqlens) - 1, F.shape[0], dtype=torch.bool)
    for n in range(len(cu_seqlens) - 1):
        for j in range(seg_of[n] + 1, seg_of[n + 1]):
            out[n] &= warm_chunks_host(L, co, j) >= 0
    return out


def chunk_gated_delta_rule_at(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                              prec=None, cp_segments_n: int = 1, warm: bool = False, split_heads: bool = False):
    """The forward end to end at precision ``prec`` (a ``precision.Precision``; None: "default");
    ``cp_segments_n`` > 1: segment-parallel state passing with that many segments per sequence, ``warm``: with the
    warm-up starts of ``cp_warm``; ``split_heads`` (with ``warm``): each (sequence, value head) from the warm-up CP
    segments where every segment start of the sequence takes a warm-up (``split_sequences``), else from the
    sequence without CP.  Same signature and results as the kernels' pipeline."""
    from kernels.interface import pad_rows

    from .precision import PRESETS
    prec = PRESETS["default"] if prec is None else prec
    B, T, H, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    dt = q.dtype
    scale = DK ** -0.5 if scale is None else float(scale)
    cu = [b * T for b in range(B + 1)] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    n = cu[-1]                                           # tokens past it are padding: never read, o = 0 there
    q2, k2 = q.reshape(B * T, H, DK)[:n], k.reshape(B * T, H, DK)[:n]
    v2 = v.reshape(B * T, HV, DV)[:n]
    g2 = g.reshape(B * T, HV)[:n].to(torch.float32)
    b2 = beta.reshape(B * T, HV)[:n].to(torch.float32)
    Ah, Al, F = intra_chunk(q2, k2, g2, b2, cu, scale, use_qk_l2norm_in_kernel, dt, prec)
    if split_heads:
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, state_v_first,
                cu_seqlens)
        o1, S1 = chunk_gated_delta_rule_at(*args, prec=prec)
        o2, S2 = chunk_gated_delta_rule_at(*args, prec=prec, cp_segments_n=cp_segments_n, warm=True)
        warm_n = split_sequences(F, cu, cp_segments_n).to(q.device)      # [N, HV]
        lens = torch.tensor(cu[1:], device=q.device) - torch.tensor(cu[:-1], device=q.device)
        sel = torch.zeros(B * T, HV, dtype=torch.bool, device=q.device)
        sel[:n] = warm_n[torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), lens)]
        o = torch.where(sel.reshape(B, T, HV, 1), o2, o1)
        return o, None if S1 is None else torch.where(warm_n[:, :, None, None], S2, S1)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(torch.float32)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    P, sig = None, None
    if prec.half:               # the fused kernel's inputs: P from the intra kernel, q and k as its copies, v scaled
        P = gated_scores(q2, k2, F, cu, dt, prec)
        if _op(prec, dt) != dt:
            q2, k2 = (_rd(x * torch.exp2(-row_exponents(x))[..., None], torch.float16)
                      for x in (q2.to(f64), k2.to(f64)))
        sig = value_scales(v2, h0)
        v2 = (v2.to(f64) * sig.to(f64)).to(torch.float32)
        h0 = None if h0 is None else h0 * sig[:, None, :]
    _, offs = chunk_tables(cu)
    if cp_segments_n > 1:
        seg_cu, seg_co, seg_of = cp_segments(cu, cp_segments_n)
        _, _, _, _, ZM = chunk_states(k2, v2, Ah, Al, F, seg_cu, seg_co, None, dt, prec, store_chunks=False, aug=True)
        h0s = cp_fixup(ZM, h0, seg_of, DV)
        if warm:
            Sch, Scl, Uh, Ul, Send = warm_segment_states(k2, v2, Ah, Al, F, seg_cu, seg_co, seg_of, h0s, dt, prec)
        else:
            Sch, Scl, Uh, Ul, Send = chunk_states(k2, v2, Ah, Al, F, seg_cu, seg_co, h0s, dt, prec)
        S = Send[[seg_of[n + 1] - 1 for n in range(len(cu) - 1)]]   # (an empty sequence: one empty segment)
    else:
        Sch, Scl, Uh, Ul, S = chunk_states(k2, v2, Ah, Al, F, cu, offs, h0, dt, prec)
    u_scale = value_scales(v2, h0) if prec.pu16 else None
    o = pad_rows(output(q2, k2, F, Sch, Scl, Uh, Ul, cu, dt, prec, P, sig, u_scale), B * T).reshape(B, T, HV, DV)
    if not output_final_state:
        return o, None
    S = (S if sig is None else S / sig.to(f64)[:, None, :]).to(torch.float32)
    if state_v_first:
        S = S.transpose(-1, -2).contiguous()
    return o, S
