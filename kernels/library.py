"""The GDN chunked forward and backward as ``torch.library`` custom ops, and ``chunk_gated_delta_rule`` on them.

``gdn_parity::chunk_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
use_qk_l2norm_in_kernel, state_v_first, keep_tables) -> (o, final_state, Th, Ah, Al)``:

* o ``[B, T, HV, V]`` in the input dtype;
* final_state fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), or ``[0]`` when not asked for;
* Th, Ah, Al ``[HV, n, 64, 64]`` in the input dtype: the forward's intra tables for the backward
  (``kernels.autograd.run_forward``), n = the call's chunks where ``keep_tables`` and the backward reads them
  (CUDA only), else n = 0.  Dense input: n follows from the shapes.  Varlen input: n depends on ``cu_seqlens``'
  values (an unbacked size under ``torch.compile``).

``gdn_parity::chunk_gdr_bwd(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, Th, Ah, Al, scale,
use_qk_l2norm_in_kernel, state_v_first) -> (dq, dk, dv, dg, dbeta, dh0)``: gradients in the dtypes of their
inputs, dh0 in the initial state's dtype and layout (``[0]`` fp32 without an initial state).

CUDA: the TileLang pipelines (sm_90).  CPU: the torch emulations of the same kernels (same roundings; slow).
Shapes and errors as ``kernels.forward.pipeline``.  Both ops have fake implementations (exact shapes and dtypes)
and the forward has autograd, so ``torch.compile(fullgraph=True)`` traces ``chunk_gated_delta_rule`` without a
graph break.  Host synchronisation: none on the dense path (chunk tables cached per (B, T, device), so it can be
captured in a CUDA graph once warmed up); a varlen call copies ``cu_seqlens`` to the host to build its chunk
tables (``kernels.interface.call_tables``: once per ``cu_seqlens`` tensor, on every call for an inference
tensor).
"""

from typing import Optional     # runtime annotations: infer_schema reads them (no ``from __future__``)

import torch
from torch import Tensor

from kernels.activations import activations
from kernels.autograd import apply, run_backward, run_forward
from kernels.interface import BT, check_inputs

__all__ = ["chunk_gated_delta_rule", "op_call", "chunk_gdr_fwd", "chunk_gdr_bwd"]

_FLOAT = torch.float32
_KEEPS_TABLES = ("cuda",)          # device types whose forward keeps intra tables for the backward
_REQUIRED = ("q", "k", "v", "g", "beta")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False):
    """GDN chunked forward -> (o, final state or None), FLA's in-kernel activations first (``kernels.activations``,
    plain torch); differentiable in q, k, v, g, beta, initial_state, A_log and dt_bias.  Under ``torch.compile``
    and on the CPU the call is the op ``gdn_parity::chunk_gdr_fwd`` (``op_call``); an eager CUDA call runs the same
    pipelines through ``kernels.autograd.apply`` (its Function, or the forward alone where no gradient can be
    asked), which spares the op's eager dispatch (host time that bounds small calls)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if not isinstance(x, Tensor) and (x is not None or name in _REQUIRED):
            raise ValueError(f"{name} must be a torch.Tensor{'' if name in _REQUIRED else ' or None'}, "
                             f"got {type(x).__name__}")
    if q.is_cuda and not torch.compiler.is_compiling():
        return apply(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     state_v_first, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    g, beta = activations(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    return op_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   state_v_first, cu_seqlens)


def op_call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None):
    """The forward's signature (no activations) through ``gdn_parity::chunk_gdr_fwd`` -> (o, final state or
    None); differentiable through ``gdn_parity::chunk_gdr_bwd``."""
    keep = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                           for t in (q, k, v, g, beta, initial_state))
    o, ht, *_ = chunk_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, None if scale is None else float(scale),
                              bool(output_final_state), bool(use_qk_l2norm_in_kernel), bool(state_v_first), keep)
    return o, (ht if output_final_state else None)


@torch.library.custom_op("gdn_parity::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: Optional[float], output_final_state: bool,
                  use_qk_l2norm_in_kernel: bool, state_v_first: bool,
                  keep_tables: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward (module docstring): ``_fwd_tilelang`` on CUDA, ``_fwd_emulation`` on the CPU."""
    raise NotImplementedError(f"gdn_parity::chunk_gdr_fwd runs on CUDA or the CPU, got {q.device}")


@torch.library.custom_op("gdn_parity::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor, dht: Optional[Tensor],
                  initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], Th: Tensor, Ah: Tensor, Al: Tensor,
                  scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                  state_v_first: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward (module docstring): ``_bwd_tilelang`` on CUDA, ``_bwd_emulation`` on the CPU."""
    raise NotImplementedError(f"gdn_parity::chunk_gdr_bwd runs on CUDA or the CPU, got {q.device}")


def _fwd_tilelang(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
                  state_v_first, keep_tables):
    o, ht, kept = run_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                              state_v_first, cu_seqlens, impl="tilelang", keep=keep_tables)
    tables = kept if kept is not None else _no_tables(v)
    if cu_seqlens is None:
        want = dense_kept_chunks(q, v, keep_tables)
        if tables[0].shape[1] != want:
            raise RuntimeError(f"chunk_gdr_fwd kept intra tables of {tables[0].shape[1]} chunks where "
                               f"dense_kept_chunks says {want}: the fake implementation would be wrong")
    return o, _final_state(ht, v), *tables


def _fwd_emulation(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
                   state_v_first, keep_tables):
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, require_cuda=False)
    o, ht, _ = run_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           state_v_first, cu_seqlens, impl="emulation")
    return o, _final_state(ht, v), *_no_tables(v)


def _bwd_tilelang(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, Th, Ah, Al, scale, use_qk_l2norm_in_kernel,
                  state_v_first):
    kept = [Th, Ah, Al] if Th.shape[1] > 0 else None      # the forward's tables where it kept any
    grads = run_backward(q, k, v, g, beta, initial_state, do, dht, scale, use_qk_l2norm_in_kernel, state_v_first,
                         cu_seqlens, impl="tilelang", kept=kept)
    return _gradients(grads, v)


def _bwd_emulation(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, Th, Ah, Al, scale,
                   use_qk_l2norm_in_kernel, state_v_first):
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, require_cuda=False)
    grads = run_backward(q, k, v, g, beta, initial_state, do, dht, scale, use_qk_l2norm_in_kernel, state_v_first,
                         cu_seqlens, impl="emulation")
    return _gradients(grads, v)


@chunk_gdr_fwd.register_fake
def _fwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
              state_v_first, keep_tables):
    B, T, H, HV, K, V, N = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first,
                                        require_cuda=False)
    o = v.new_empty(B, T, HV, V)
    ht = v.new_empty(((N, HV, V, K) if state_v_first else (N, HV, K, V)) if output_final_state else (0,),
                     dtype=_FLOAT)
    if cu_seqlens is None:
        n = dense_kept_chunks(q, v, keep_tables)
    elif keep_tables and q.device.type in _KEEPS_TABLES:
        n = torch.library.get_ctx().new_dynamic_size()
    else:
        n = 0
    return o, ht, *(v.new_empty(HV, n, BT, BT) for _ in range(3))


@chunk_gdr_bwd.register_fake
def _bwd_fake(q, k, v, g, beta, do, dht, initial_state, cu_seqlens, Th, Ah, Al, scale, use_qk_l2norm_in_kernel,
              state_v_first):
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, require_cuda=False)
    dh0 = v.new_empty(0, dtype=_FLOAT) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, state_v_first, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, *output[2:])
    ctx.cu_seqlens = cu_seqlens     # not differentiable; may be an inference tensor, which autograd cannot save
    ctx.opts = (scale, output_final_state, use_l2, state_v_first)


def _backward(ctx, do, dht, *_tables):
    q, k, v, g, beta, initial_state, Th, Ah, Al = ctx.saved_tensors
    scale, output_final_state, use_l2, state_v_first = ctx.opts
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, db, dh0 = chunk_gdr_bwd(q, k, v, g, beta, do, dht if output_final_state else None,
                                            initial_state, ctx.cu_seqlens, Th, Ah, Al, scale, use_l2,
                                            state_v_first)
    return dq, dk, dv, dg, db, (dh0 if initial_state is not None else None), None, None, None, None, None, None


chunk_gdr_fwd.register_kernel("cuda")(_fwd_tilelang)
chunk_gdr_fwd.register_kernel("cpu")(_fwd_emulation)
chunk_gdr_bwd.register_kernel("cuda")(_bwd_tilelang)
chunk_gdr_bwd.register_kernel("cpu")(_bwd_emulation)
chunk_gdr_fwd.register_autograd(_backward, setup_context=_setup_context)


def dense_kept_chunks(q, v, keep_tables: bool) -> int:
    """Chunks of the intra tables a dense forward of q [B, T, H, K], v [B, T, HV, V] keeps for the backward
    (``run_forward``): B * ceil(T / 64) on CUDA where ``keep_tables`` and the dispatched precision computes them
    (the backward reads them wherever the forward runs, except where it is the fused plan:
    ``backward.pipeline.reads_saved_tables``); else 0.  Host arithmetic only (no tensor is made)."""
    from kernels.backward.pipeline import reads_saved_tables
    from kernels.forward.precision import preset
    from kernels.plan import keeps_tables
    B, T = int(q.shape[0]), int(q.shape[1])
    if (not keep_tables or q.device.type not in _KEEPS_TABLES or B * T == 0 or not keeps_tables(preset())
            or not reads_saved_tables(q, v)):
        return 0
    return B * -(-T // BT)


def _no_tables(v):
    return tuple(v.new_empty(v.shape[2], 0, BT, BT) for _ in range(3))


def _final_state(ht, v):
    return v.new_empty(0, dtype=_FLOAT) if ht is None else ht.contiguous()    # a clone of h0 keeps its strides


def _gradients(grads, v):
    """Contiguous gradients (the fake's strides): a head-dim-padded pipeline returns views of wider buffers."""
    *gx, dh0 = grads
    return *(x.contiguous() for x in gx), v.new_empty(0, dtype=_FLOAT) if dh0 is None else dh0.contiguous()
