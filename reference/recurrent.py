"""The recurrent fp64 reference: the GDN recurrence token by token, nothing clever.

    S' = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T;  o_t = scale * S_t^T q_t

This is the ground truth every other path (the chunked reference included) is checked against.
Named after FLA's ``fused_recurrent_gated_delta_rule`` (lax_reference style), with the same
arguments; ``g`` and ``beta`` may be passed positionally here.
"""

from __future__ import annotations

import torch

from reference.prepare import prepare
from reference.segments import pad_tokens, segments, state_in, state_out
from reference.validate import check_inputs


def _recur(q, k, v, g, beta, S, scale):
    """One batch of equal-length sequences. q, k [N, L, HV, K]; v [N, L, HV, V]; g, beta [N, L, HV];
    S [N, HV, K, V]. Returns o [N, L, HV, V] and the final S."""
    outs = []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t])[..., None, None]
        kS = torch.einsum("nhk,nhkv->nhv", k[:, t], S)
        u = beta[:, t, :, None] * (v[:, t] - kS)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def fused_recurrent_gated_delta_rule(
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
    dtype: torch.dtype = torch.float64,
):
    """Token-by-token GDN in ``dtype`` (fp64 by default) on the inputs' device.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V] ([N, HV, V, K] with
    state_v_first); cu_seqlens [N+1] with B=1. Inputs of any float dtype are upcast to ``dtype``.
    Returns o [B, T, HV, V] and the final state [N, HV, K, V] (or V-first), both in ``dtype``; the state is
    None unless output_final_state. Differentiable through autograd.
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, A_log, dt_bias)
    q, k, v, g, beta = prepare(q, k, v, g, beta, dtype=dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                               use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    scale = dims.K ** -0.5 if scale is None else scale
    S0 = state_in(initial_state, dims, dtype, q.device, state_v_first)
    if not dims.varlen:
        o, S = _recur(q, k, v, g, beta, S0, scale)
    else:
        os_, Ss = [], []
        for n, (bos, eos) in enumerate(segments(cu_seqlens)):
            sl = slice(bos, eos)
            o_n, S_n = _recur(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S0[n:n + 1], scale)
            os_.append(o_n)
            Ss.append(S_n)
        o = pad_tokens(torch.cat(os_, dim=1), dims.T)
        S = torch.cat(Ss, dim=0)
    return o, (state_out(S, state_v_first) if output_final_state else None)
