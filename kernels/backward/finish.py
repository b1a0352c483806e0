"""Host-side pieces shared by the kernel path and the emulation (torch only, no tilelang).

``finish`` turns the backward kernels' per-chunk partial results into the final gradients: the
gate / beta row terms (a few fp32 elementwise ops per (chunk, row)), the within-chunk reverse
cumsum of dG (fp32), the GVA group sums of dq / dk and the chain rule through the in-kernel L2
norm (fp32).  The kernels and the emulation call the same function on the same quantities.

Gate table ``Fb [HV, NC, 8, 64]`` (fp32, written by ``prep``; rows past the end of a sequence are 0
except rows 3 and 4):
  0 e^G rk,  1 scale e^G rq,  2 e^(GL - G) rk,  3 e^GL,  4 G,  5 scale rq,  6 rk,  7 beta
(G = chunk-local cumsum of g, GL = G of the chunk's last row; every exponent is of a value <= 0).
"""

from __future__ import annotations

import torch

BT = 64


def token_index(cu_host: list[int], dev):
    """(tok [NC, 64] long, valid [NC, 64] bool) of the chunks in the API's order."""
    t0, eos = [], []
    for n in range(len(cu_host) - 1):
        L = cu_host[n + 1] - cu_host[n]
        for i in range(-(-L // BT)):
            t0.append(cu_host[n] + i * BT)
            eos.append(cu_host[n + 1])
    rows = torch.arange(BT)
    tok = torch.tensor(t0, dtype=torch.long).reshape(-1, 1) + rows
    valid = tok < torch.tensor(eos, dtype=torch.long).reshape(-1, 1)
    return torch.where(valid, tok, torch.zeros_like(tok)).to(dev), valid.to(dev)


def valid_rows(tok, valid):
    """(tokens, rows): the token of every valid chunk row and that row's flat index into [NC * 64] (int64, on the
    device of ``tok``), so that ``finish`` scatters by integer index; a boolean mask index (``x[valid]``) makes
    torch wait for the GPU to learn the result's size.  Computed once per layout by the API (cached)."""
    rows = valid.reshape(-1).nonzero().squeeze(1)
    return tok.reshape(-1)[rows], rows


def finish(*, Fb, qz, kw, kr, sd, yv, rect, db2, dqv, dkv, q, k, H, use_l2, tok, valid, rows=None, dgdb=None):
    """Final gradients (fp32) from the per-chunk partials.

    Fb [HV, NC, 8, 64]; qz, kw, kr [P, HV, NC, 64] (row dots q.Z, k.W, k.R of the P key blocks of the
    inter-chunk kernel); sd [P, HV, NC, DVs] (sum_d S o dS_next partial sums); yv [HV, NC, 64] (dY . V);
    rect [HV, NC, 64] (the intra-chunk dg terms, already summed over the rectangle t >= s > j) and
    db2 [HV, NC, 64]; dqv, dkv [Ttot, G, DK] (gradients of the normalised q~ = rq q, k~ = rk k: G = HV, fp32 per
    value head, summed here by ``group_sum``; or G = H, already summed over each group: fp32, or the final dq, dk
    in the input dtype when there is no L2 norm); q, k [Ttot, H, DK] (raw inputs); tok, valid from
    ``token_index``; ``rows`` = ``valid_rows(tok, valid)`` (computed here when None).  Returns dq, dk [Ttot, H, DK], dg, dbeta [Ttot, HV] (fp32).
    ``dgdb``: (dg, dbeta) already computed (the kernel ``gdn_bwd_dg_dbeta``, the same terms): only dq, dk here, and
    the row terms and ``tok, valid, rows`` are not read.

    dg_s = sum_{t >= s} dG_t with G = cumsum(g) is formed without cancellation: a term that depends on
    G_t - G_j (t > j) contributes only to s in (j, t] (``rect`` and the exclusive prefix sum of the
    e^(GL - G_t) terms in ``_dg_dbeta``), so no two O(1) terms ever cancel and dg stays right when g is near -20
    (true dg ~ e^-20) as well as near 0."""
    dg, db = dgdb if dgdb is not None else _dg_dbeta(Fb, qz, kw, kr, sd, yv, rect, db2, dqv.shape[0], tok, valid,
                                                      rows)
    dq, dk = group_sum(dqv, H), group_sum(dkv, H)
    if use_l2:
        dq = _l2_bwd(q, dq)
        dk = _l2_bwd(k, dk)
    return dq, dk, dg, db


def _dg_dbeta(Fb, qz, kw, kr, sd, yv, rect, db2, Ttot, tok, valid, rows):
    """dg, dbeta [Ttot, HV] fp32 of ``finish`` (its arguments), the torch form of ``gdn_bwd_dg_dbeta``."""
    f32 = torch.float32
    Fb = Fb.to(f32)
    qz, kw, kr, sd = (x.to(f32).sum(0) for x in (qz, kw, kr, sd))
    F0, F2, F3, F5, F7 = Fb[:, :, 0], Fb[:, :, 2], Fb[:, :, 3], Fb[:, :, 5], Fb[:, :, 7]
    EG = torch.exp(Fb[:, :, 4])                                   # e^G, G <= 0
    vm = valid.to(f32)[None]
    # terms in e^G_t (O and X) reach every s <= t; the e^(GL - G_t) (S' update) terms every s > t;
    # e^GL S . dS' every s
    own = (EG * F5 * qz - F7 * F0 * kw) * vm
    upd = F2 * kr * vm
    dgc = torch.flip(torch.cumsum(torch.flip(own, [-1]), -1), [-1])
    dgc = dgc + torch.cumsum(torch.nn.functional.pad(upd[..., :-1], (1, 0)), -1)
    dgc = dgc + (F3[..., :1] * sd.sum(-1, keepdim=True)) + rect.to(f32)
    dbc = (-F0 * kw + yv.to(f32)) * vm + db2.to(f32)
    HV = Fb.shape[0]
    dg = torch.zeros(Ttot, HV, dtype=f32, device=Fb.device)
    db = torch.zeros_like(dg)
    tv, sel = valid_rows(tok, valid) if rows is None else rows
    dg[tv] = dgc.permute(1, 2, 0).reshape(-1, HV)[sel]
    db[tv] = dbc.permute(1, 2, 0).reshape(-1, HV)[sel]
    return dg, db


def group_sum(x, H: int):
    """``x [Ttot, G, DK]`` (G = HV, one row per value head, or H) summed over the G / H rows of each q/k head:
    [Ttot, H, DK]; ``x`` itself when G == H."""
    Ttot, G, DK = x.shape
    return x if G == H else x.reshape(Ttot, H, G // H, DK).sum(2)


def _l2_bwd(x, dxh):
    """x^ = x rx, rx = 1/sqrt(|x|^2 + 1e-6):  dx = rx (dx^ - x^ (x^ . dx^))  (fp32)."""
    x = x.float()
    rx = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    xh = x * rx
    return rx * (dxh - xh * (xh * dxh).sum(-1, keepdim=True))
