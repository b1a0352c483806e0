"""The chunked fp64 reference (WY / UT form), vectorised over chunks, heads and sequences.

Per chunk of C tokens with local cumulative gates G_i = sum_{s<=i} g_s and chunk-start state S0:
    A_ij  = beta_i exp(G_i - G_j) (k_i . k_j)            for j < i   (strictly lower)
    W     = (I + A)^-1 diag(beta exp(G)) K,   U~ = (I + A)^-1 diag(beta) V,   U = U~ - W S0
    o_i   = scale (exp(G_i) q_i^T S0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j)
    S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
Exponents are always differences of cumulative gates taken under the causal mask, so per-token
gates near -20 never overflow. Only the state recurrence between chunks is a Python loop.

Named after FLA's ``chunk_gated_delta_rule``; ``output_chunk_states=True`` also returns the state at
the start of every chunk in FLA's layout for ``h`` ([B, NT, HV, K, V]; varlen [1, sum NT_n, HV, K, V]).
"""

from __future__ import annotations

import torch

from reference.prepare import prepare
from reference.segments import from_chunks, segments, state_in, state_out, to_chunks
from reference.validate import check_inputs

CHUNK_SIZE = 64


def _intra_chunk(q, k, v, g, beta, C: int):
    """Everything that does not depend on the carried state, for a run of whole chunks.

    In: q, k [N, L, HV, K]; v [N, L, HV, V]; g, beta [N, L, HV] with L = NC * C.
    Out (all [NC, N, HV, ...], contiguous per chunk): W [C, K], U~ [C, V], q_decayed [C, K], QK [C, C],
    k_decayed^T [K, C] and the chunk's total decay exp(G_C) [1, 1].
    """
    N, L, HV, _ = q.shape
    NC = L // C

    def blocks(x):  # [N, L, HV, D] -> [NC, N, HV, C, D]
        return x.reshape(N, NC, C, HV, -1).permute(1, 0, 3, 2, 4).contiguous()

    q, k, v = blocks(q), blocks(k), blocks(v)
    beta = blocks(beta[..., None])[..., 0]
    G = blocks(g[..., None])[..., 0].cumsum(-1)
    diff = G[..., :, None] - G[..., None, :]
    idx = torch.arange(C, device=q.device)
    neg_inf = torch.tensor(float("-inf"), dtype=G.dtype, device=G.device)
    decay_strict = torch.where(idx[:, None] > idx[None, :], diff, neg_inf).exp()
    decay_causal = torch.where(idx[:, None] >= idx[None, :], diff, neg_inf).exp()

    A = beta[..., None] * decay_strict * (k @ k.transpose(-1, -2))
    M = A + torch.eye(C, dtype=A.dtype, device=A.device)
    W = torch.linalg.solve_triangular(M, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    U_tilde = torch.linalg.solve_triangular(M, beta[..., None] * v, upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * decay_causal
    q_decayed = q * G.exp()[..., None]
    G_last = G[..., -1]
    k_decayed_t = (k * (G_last[..., None] - G).exp()[..., None]).transpose(-1, -2)
    return W, U_tilde, q_decayed, QK, k_decayed_t, G_last.exp()[..., None, None]


def _chunk_core(q, k, v, g, beta, S, scale: float, C: int, keep_states: bool, block: int = 16):
    """q, k [N, L, HV, K]; v [N, L, HV, V]; g, beta [N, L, HV]; S [N, HV, K, V]; L a multiple of C.
    Returns o [N, L, HV, V], the final S and (if keep_states) the chunk-start states [N, NC, HV, K, V].
    Chunks are prepared ``block`` at a time so the working set stays small at long T."""
    N, L, HV, _ = q.shape
    V = v.shape[-1]
    outs, states = [], []
    for t0 in range(0, L, block * C):
        sl = slice(t0, min(L, t0 + block * C))
        W, U_tilde, q_decayed, QK, k_decayed_t, decay_last = _intra_chunk(q[:, sl], k[:, sl], v[:, sl], g[:, sl],
                                                                           beta[:, sl], C)
        for c in range(W.shape[0]):
            if keep_states:
                states.append(S)
            U = U_tilde[c] - W[c] @ S
            outs.append(scale * (q_decayed[c] @ S + QK[c] @ U))
            S = S * decay_last[c] + k_decayed_t[c] @ U
    if outs:
        o = torch.stack(outs, dim=0).permute(1, 0, 3, 2, 4).reshape(N, L, HV, V)
    else:
        o = v.new_zeros((N, 0, HV, V))
    chunk_states = torch.stack(states, dim=1) if keep_states and states else None
    return o, S, chunk_states


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    output_chunk_states: bool = False,
    dtype: torch.dtype = torch.float64,
):
    """Chunked GDN in ``dtype`` (fp64 by default) on the inputs' device; same arguments as FLA's call.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V] ([N, HV, V, K] with
    state_v_first); cu_seqlens [N+1] with B=1. Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None)
    and, with output_chunk_states, a third tensor: the state at each chunk start, [B, NT, HV, K, V]
    (varlen: [1, sum_n ceil(T_n / chunk_size), HV, K, V]; V-first layouts swap the last two dims).
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, A_log, dt_bias)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta = prepare(q, k, v, g, beta, dtype=dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                               use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    scale = dims.K ** -0.5 if scale is None else scale
    S0 = state_in(initial_state, dims, dtype, q.device, state_v_first)
    C = chunk_size
    xs = to_chunks((q, k, v, g, beta), dims, cu_seqlens, C)
    o, S, hs = _chunk_core(*xs, S0, scale, C, output_chunk_states)
    o = from_chunks(o, dims, cu_seqlens)
    final = state_out(S, state_v_first) if output_final_state else None
    if not output_chunk_states:
        return o, final
    if hs is None:
        hs = S0.new_zeros((dims.N, 0, dims.HV, dims.K, dims.V))
    if dims.varlen:
        lens = [eos - bos for bos, eos in segments(cu_seqlens)]
        hs = torch.cat([hs[n, : -(-ln // C)] for n, ln in enumerate(lens)], dim=0)[None]
    else:
        hs = hs[:, : -(-dims.T // C)]
    return o, final, (hs.transpose(-1, -2) if state_v_first else hs).contiguous()
