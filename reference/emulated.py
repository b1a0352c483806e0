"""The chunked algorithm in emulated low precision: the "plain same-precision implementation".

Tolerances are calibrated against this (FlashAttention's tests allow a kernel twice the error of a
plain implementation run in the kernel's own precision). It is the chunked reference's algorithm
with the precision choices a straightforward GPU kernel makes, each made explicit:

  - every matmul takes its operands rounded to the input dtype (bf16/fp16) and accumulates in fp32
    (emulated as an fp32 matmul of rounded operands; TF32 is switched off for it);
  - the gate cumsum, every exponent, the triangular solve and all elementwise work are fp32;
  - what a kernel stores to memory between stages is rounded to the input dtype: the solved
    (I+A)^-1, W and U, the new values v_new, the chunk-start states used by the output and o itself;
  - the state carried across chunks stays fp32, and the final state is returned in fp32.

With ``dtype=torch.float32`` it is a plain fp32 implementation.
"""

from __future__ import annotations

import contextlib

import torch

from reference.chunk import CHUNK_SIZE
from reference.prepare import expand_heads, gate_from_raw, l2norm
from reference.segments import from_chunks, state_in, state_out, to_chunks
from reference.validate import check_inputs

F32 = torch.float32


@contextlib.contextmanager
def _no_tf32():
    """fp32 matmuls in IEEE fp32, restoring the caller's setting."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _emulated_core(q, k, v, g, beta, S, scale: float, C: int, dt: torch.dtype):
    """Tensors as in reference.chunk._chunk_core, already in fp32 (q, k, v already rounded to ``dt``).
    Returns o (fp32, not yet rounded) and the final fp32 state."""

    def rd(x):  # round to the operand/storage dtype, keep computing in fp32
        return x.to(dt).to(F32)

    N, L, HV, K = q.shape
    V = v.shape[-1]
    NC = L // C

    def blocks(x):
        return x.reshape(N, NC, C, HV, -1).permute(0, 3, 1, 2, 4)

    q, k, v = blocks(q), blocks(k), blocks(v)
    g = g.reshape(N, NC, C, HV).permute(0, 3, 1, 2)
    beta = beta.reshape(N, NC, C, HV).permute(0, 3, 1, 2)
    G = g.cumsum(-1)
    diff = G[..., :, None] - G[..., None, :]
    idx = torch.arange(C, device=q.device)
    neg_inf = torch.tensor(float("-inf"), dtype=F32, device=q.device)
    decay_strict = torch.where(idx[:, None] > idx[None, :], diff, neg_inf).exp()
    decay_causal = torch.where(idx[:, None] >= idx[None, :], diff, neg_inf).exp()

    A = beta[..., None] * decay_strict * (k @ k.transpose(-1, -2))
    eye = torch.eye(C, dtype=F32, device=q.device).expand(A.shape)
    Ai = rd(torch.linalg.solve_triangular(A + eye, eye, upper=False, unitriangular=True))
    W = rd(Ai @ rd(k * (beta * G.exp())[..., None]))
    U_tilde = rd(Ai @ rd(v * beta[..., None]))
    QK = rd((q @ k.transpose(-1, -2)) * decay_causal)
    G_last = G[..., -1]
    k_decay = (G_last[..., None] - G).exp()[..., None]

    outs, states = [], []
    for c in range(NC):
        h = rd(S)
        states.append(h)
        v_new = rd(U_tilde[:, :, c] - W[:, :, c] @ h)
        outs.append(scale * ((q[:, :, c] @ h) * G[:, :, c].exp()[..., None] + QK[:, :, c] @ v_new))
        S = S * G_last[:, :, c].exp()[..., None, None] + k[:, :, c].transpose(-1, -2) @ rd(v_new * k_decay[:, :, c])
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(N, L, HV, V) if outs else v.new_zeros((N, 0, HV, V))
    hs = torch.stack(states, dim=1) if states else S.new_zeros((N, 0, HV, K, V))  # [N, NC, HV, K, V]
    return o, S, hs


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
    dtype: torch.dtype | None = None,
    output_chunk_states: bool = False,
):
    """Chunked GDN with ``dtype`` operands (default: q's dtype) and fp32 accumulation, on the inputs' device.

    Same arguments and shapes as reference.chunk.chunk_gated_delta_rule. Returns o in ``dtype`` and the final
    state in fp32 (None unless output_final_state); with output_chunk_states also the chunk-start states as stored
    for the output stage (rounded to ``dtype``), dense only: [B, NT, HV, K, V]. Differentiable: autograd rounds the gradients at the
    same storage points (the backward of a cast to ``dtype`` is a cast of the gradient).
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, A_log, dt_bias)
    dt = q.dtype if dtype is None else dtype
    if dt == torch.float64:
        raise ValueError("the emulated implementation is for low precision; use reference.chunk for float64")
    HV = dims.HV
    # q/k/v as the kernel loads them; FLA's in-kernel l2norm computes in fp32 and stores in the input dtype
    q, k, v = (x.to(dt).to(F32) for x in (q, k, v))
    if use_qk_l2norm_in_kernel:
        q, k = (l2norm(x).to(dt).to(F32) for x in (q, k))
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    g, beta = g.to(F32), beta.to(F32)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log ([HV])")
        g = gate_from_raw(g, A_log.to(F32), None if dt_bias is None else dt_bias.to(F32))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    scale = dims.K ** -0.5 if scale is None else scale
    S0 = state_in(initial_state, dims, F32, q.device, state_v_first)
    C = chunk_size
    xs = to_chunks((q, k, v, g, beta), dims, cu_seqlens, C)
    with _no_tf32():
        o, S, hs = _emulated_core(*xs, S0, scale, C, dt)
    o = from_chunks(o, dims, cu_seqlens)
    final = state_out(S, state_v_first) if output_final_state else None
    if not output_chunk_states:
        return o.to(dt), final
    if dims.varlen:
        raise ValueError("output_chunk_states is implemented for dense inputs only")
    hs = hs[:, : -(-dims.T // C)]
    return o.to(dt), final, (hs.transpose(-1, -2) if state_v_first else hs).to(dt).contiguous()
