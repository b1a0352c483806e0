"""Pure-torch emulation of exactly the tiling and precisions of our TileLang kernels.

Runs anywhere torch runs (CPU in CI).  It follows the two kernels step by step:
same 64-token chunks per sequence, same zero padding, same padded intermediate
layout (``Ah, Al, Ph, Pl [HV, NC, 64, 64]``, ``F [HV, NC, 4, 64]``), same
operations in the same order, and it rounds explicitly wherever the kernels
round:

* ``rd(x)``  - to the input dtype (bf16/fp16): every wgmma operand;
* ``f32(x)`` - to fp32: every accumulator / CUDA-core result;
* ``split(x) = (rd(x), rd(x - rd(x)))`` - the two-term operands.

A wgmma with fp32 accumulation is emulated as an fp64 product of the (exact)
rounded operands followed by one rounding to fp32; this matches the kernel up
to the order of the fp32 additions.  The 16x16 diagonal-block inverses are
emulated as fp64 solves rounded to fp32 (the kernel's fp32 forward
substitution agrees to a few fp32 ulps); the block merges are emulated exactly
as the kernel does them (split operands, fp32 results).

``intra(...)`` is the intra-chunk kernel (`kkt_solve.py`) and returns its
outputs in its layout, so the GPU check can compare the kernel stage by stage;
``recurrent(...)`` is the fused recurrence + output kernel (`chunk_h.py` +
`chunk_o.py`); ``chunk_gated_delta_rule(...)`` has the public API's signature.
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


def _solve(A: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """(I + A)^{-1} for strictly lower ``A [..., 64, 64]`` the way the intra kernel does it:
    fp32 inverses of the 16x16 diagonal blocks (exact forward substitution, emulated by an fp64
    solve rounded to fp32), then ``L <- L - L A_o L`` at widths 16 and 32 with two-term split
    operands (hi*hi + lo*hi + hi*lo, fp32 results)."""
    dev = A.device
    eye16 = torch.eye(16, dtype=f64, device=dev)
    L = torch.zeros_like(A)
    for b in range(4):
        sl = slice(16 * b, 16 * b + 16)
        L[..., sl, sl] = _f32(torch.linalg.solve_triangular(eye16 + A[..., sl, sl], eye16.expand_as(A[..., sl, sl]),
                                                            upper=False, unitriangular=True))
    rows = torch.arange(BT, device=dev)
    for w in (16, 32):
        rb, cb = rows[:, None] // w, rows[None, :] // w
        Ao = torch.where((rb % 2 == 1) & (cb == rb - 1), A, torch.zeros_like(A))
        Lh, Ll = _split(L, dt)
        Oh, Ol = _split(Ao, dt)
        X = _f32(Oh @ Lh + Ol @ Lh + Oh @ Ll)
        Xh, Xl = _split(X, dt)
        Y = _f32(Lh @ Xh + Ll @ Xh + Lh @ Xl)
        L = _f32(L - Y)
    return L


def intra(q, k, g, beta, cu_seqlens: list[int], scale: float, use_l2: bool, dt: torch.dtype):
    """Emulates ``gdn_intra_chunk``.

    q, k [Ttot, H, DK] (dt); g, beta [Ttot, HV] (fp32).  Returns
    Ah, Al, Ph, Pl [HV, NC, 64, 64] (fp64 holding dt values) and F [HV, NC, 4, 64]
    (fp64 holding fp32 values).
    """
    Ttot, H, DK = q.shape
    HV = g.shape[1]
    r = HV // H
    idx, _ = chunk_tables(cu_seqlens)
    NC = len(idx)
    dev = q.device
    # gather padded chunks: token index per (chunk, row), valid mask
    t0 = torch.tensor([cu_seqlens[n] + i * BT for n, i in idx], device=dev, dtype=torch.long)
    eos = torch.tensor([cu_seqlens[n + 1] for n, _ in idx], device=dev, dtype=torch.long)
    rows = torch.arange(BT, device=dev)
    tok = t0[:, None] + rows[None, :]                      # [NC, 64]
    valid = tok < eos[:, None]
    tokc = torch.where(valid, tok, torch.zeros_like(tok))
    heads = torch.arange(HV, device=dev) // r

    qc = q.to(f64)[tokc][:, :, heads] * valid[..., None, None]      # [NC, 64, HV, DK]
    kc = k.to(f64)[tokc][:, :, heads] * valid[..., None, None]
    gc = g.to(f64)[tokc] * valid[..., None]                          # [NC, 64, HV]
    bc = beta.to(f64)[tokc] * valid[..., None]
    qc, kc = qc.permute(2, 0, 1, 3), kc.permute(2, 0, 1, 3)          # [HV, NC, 64, DK]
    gc, bc = gc.permute(2, 0, 1), bc.permute(2, 0, 1)                # [HV, NC, 64]
    vmask = valid[None].expand(HV, NC, BT)

    G = _f32(gc.to(torch.float32).cumsum(-1))
    if use_l2:
        rq = _f32(1.0 / torch.sqrt(_f32((qc * qc).sum(-1)) + 1e-6))
        rk = _f32(1.0 / torch.sqrt(_f32((kc * kc).sum(-1)) + 1e-6))
    else:
        rq = torch.ones_like(G)
        rk = torch.ones_like(G)
    KK = _f32(kc @ kc.transpose(-1, -2))
    QK = _f32(qc @ kc.transpose(-1, -2))
    D = G[..., :, None] - G[..., None, :]
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    e_strict = torch.where(lower, torch.exp(torch.where(lower, D, 0.0)), 0.0)
    e_causal = torch.where(causal, torch.exp(torch.where(causal, D, 0.0)), 0.0)
    A = _f32(bc[..., :, None] * rk[..., :, None] * rk[..., None, :] * e_strict * KK)
    P = _f32(scale * rq[..., :, None] * rk[..., None, :] * e_causal * QK) * vmask[..., :, None]
    Tinv = _solve(A, dt)
    Ag = _f32(Tinv * bc[..., None, :])
    Ah, Al = _split(Ag, dt)
    Ph, Pl = _split(P, dt)
    GL = G[..., -1:]
    F = torch.stack([
        _f32(torch.exp(G) * rk) * vmask,
        _f32(scale * torch.exp(G) * rq) * vmask,
        _f32(torch.exp(GL - G) * rk) * vmask,
        _f32(torch.exp(GL)).expand_as(G),
    ], dim=2)                                                       # [HV, NC, 4, 64]
    return Ah, Al, Ph, Pl, F


def recurrent(q, k, v, Ah, Al, Ph, Pl, F, cu_seqlens: list[int], h0, dt: torch.dtype, path: str = "split",
              precision: str = "high"):
    """Emulates ``gdn_recurrent_fwd`` (+ fused ``chunk_output``) when ``path == "fused"``, else the split
    path: ``gdn_state_fwd`` (``precision`` "high" | "fast") followed by ``gdn_output_fwd``.

    q, k [Ttot, H, DK]; v [Ttot, HV, DV]; h0 [N, HV, DK, DV] fp32 or None (K-first here;
    the API transposes V-first states).  Returns o [Ttot, HV, DV] (dt) and S [N, HV, DK, DV] (fp32).
    All sequences advance together, one chunk step at a time.
    """
    Ttot, H, DK = q.shape
    HV, DV = v.shape[1], v.shape[2]
    r = HV // H
    dev = q.device
    N = len(cu_seqlens) - 1
    _, offs = chunk_tables(cu_seqlens)
    heads = torch.arange(HV, device=dev) // r
    S = torch.zeros(N, HV, DK, DV, dtype=f64, device=dev) if h0 is None else _f32(h0.to(f64))
    o = torch.zeros(Ttot, HV, DV, dtype=f64, device=dev)
    nch = [offs[n + 1] - offs[n] for n in range(N)]
    rows = torch.arange(BT, device=dev)
    qf, kf, vf = q.to(f64), k.to(f64), v.to(f64)
    for ic in range(max(nch + [0])):
        act = [n for n in range(N) if nch[n] > ic]
        a = torch.tensor(act, device=dev, dtype=torch.long)
        t0 = torch.tensor([cu_seqlens[n] + ic * BT for n in act], device=dev, dtype=torch.long)
        eos = torch.tensor([cu_seqlens[n + 1] for n in act], device=dev, dtype=torch.long)
        c = torch.tensor([offs[n] + ic for n in act], device=dev, dtype=torch.long)
        tok = t0[:, None] + rows[None, :]
        inb = tok < Ttot                       # the kernel reads the next sequence's tokens, zeros past Ttot
        tokc = torch.where(inb, tok, torch.zeros_like(tok))
        Qc = (qf[tokc][:, :, heads] * inb[..., None, None]).permute(0, 2, 1, 3)   # [A, HV, 64, DK]
        Kc = (kf[tokc][:, :, heads] * inb[..., None, None]).permute(0, 2, 1, 3)
        Vc = (vf[tokc] * inb[..., None, None]).permute(0, 2, 1, 3)               # [A, HV, 64, DV]
        ah, al, ph, pl = (x[:, c].transpose(0, 1) for x in (Ah, Al, Ph, Pl))      # [A, HV, 64, 64]
        f = F[:, c].transpose(0, 1)                                               # [A, HV, 4, 64]
        S_a = S[a]
        Sh, Sl = _split(S_a, dt)
        fused = path == "fused"
        hi = fused or precision == "high"
        if not hi:
            Sl = torch.zeros_like(Sl)          # "fast": K @ rd(S), and the output kernel reads Sc = rd(S) only
        KS = _f32(Kc @ (Sh + Sl))
        X = _f32(Vc - _f32(f[:, :, 0, :, None] * KS))
        Xh, Xl = _split(X, dt)
        U = _f32(ah @ Xh + al @ Xh + ah @ Xl) if hi else _f32(ah @ Xh)
        Uh, Ul = _split(U, dt)
        QS = _f32(Qc @ (Sh + Sl))
        O = _f32(_f32(QS * f[:, :, 1, :, None]) + ph @ Uh + pl @ Uh + ph @ Ul)
        store = (tok < eos[:, None])
        for j, n in enumerate(act):
            m = store[j]
            o[tok[j][m]] = O[j][:, m].transpose(0, 1)
        Up = _f32(f[:, :, 2, :, None] * U)
        Uph, Upl = _split(Up, dt)
        S_a = _f32(_f32(S_a * f[:, :, 3, 0, None, None]) + Kc.transpose(-1, -2) @ Uph + Kc.transpose(-1, -2) @ Upl)
        S[a] = S_a
    return o.to(dt), S.to(torch.float32)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                           _path: str = "split", _precision: str = "high"):
    """Same signature and result layout as ``kernels.chunk_gated_delta_rule`` (incl. its private
    ``_path`` / ``_precision`` knobs), computed by the emulation."""
    B, T, H, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    dt = q.dtype
    scale = DK ** -0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        cu = [b * T for b in range(B + 1)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
    q2, k2 = q.reshape(B * T, H, DK), k.reshape(B * T, H, DK)
    v2 = v.reshape(B * T, HV, DV)
    g2 = g.reshape(B * T, HV).to(torch.float32)
    b2 = beta.reshape(B * T, HV).to(torch.float32)
    Ah, Al, Ph, Pl, F = intra(q2, k2, g2, b2, cu, scale, use_qk_l2norm_in_kernel, dt)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(torch.float32)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    o, S = recurrent(q2, k2, v2, Ah, Al, Ph, Pl, F, cu, h0, dt, _path, _precision)
    o = o.reshape(B, T, HV, DV)
    if not output_final_state:
        return o, None
    if state_v_first:
        S = S.transpose(-1, -2).contiguous()
    return o, S
