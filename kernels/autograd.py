"""``torch.autograd.Function`` of the TileLang GDN forward and backward.

``chunk_gated_delta_rule(...)`` has the forward's signature (``kernels.forward.pipeline``) plus FLA's in-kernel
activations (``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``use_beta_sigmoid_in_kernel``: ``kernels.activations``,
applied in torch before the Function) and is differentiable in q, k, v, g, beta, initial_state, A_log and dt_bias:
gradients come back in the inputs' dtypes (dh0 in fp32).  Where a gradient
is needed and the backward reads them (``backward.pipeline.reads_saved_tables``), the forward's intra kernel also
stores Tinv and the Function keeps its tables ``Th`` (Tinv), ``Ah``, ``Al`` (Ag = Tinv diag(beta), hi + lo):
3 x [HV, NC, 64, 64] in the input dtype, 384 bytes a token and value head; the backward's prep kernel then skips
K K^T and the solve.

``apply(..., impl="emulation")`` runs the torch emulations of both directions instead (any device; CPU tests);
``alter``: a function of a plan returning the plan to run (a benchmark's alternative, ``dataclasses.replace``),
applied to the forward's and the backward's dispatched plans.
"""

from __future__ import annotations

import torch

from kernels.activations import activations
from kernels.backward.pipeline import SAVED_TABLES


def _directions(impl: str):
    if impl == "tilelang":
        from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as bwd
        from kernels.forward.pipeline import chunk_gated_delta_rule as fwd
    elif impl == "emulation":
        from kernels.backward.emulation import chunk_gated_delta_rule_bwd as bwd
        from kernels.forward.emulation import chunk_gated_delta_rule as fwd
    else:
        raise ValueError(f"unknown implementation {impl!r} (tilelang | emulation)")
    return fwd, bwd


def _forward_plan(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, state_v_first, cu_seqlens,
                  keep: bool, alter):
    """The forward's dispatched plan (keeping the tables where ``keep``), through ``alter``."""
    from kernels.forward.pipeline import plan_for, prepare
    x = prepare(q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, state_v_first, cu_seqlens)
    return alter(plan_for(x, keep)) if x.NC else None


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, impl, alter):
        fwd, _ = _directions(impl)
        kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
                  cu_seqlens=cu_seqlens)
        keep = None
        if impl == "tilelang":
            from kernels.backward.pipeline import reads_saved_tables
            want = any(ctx.needs_input_grad) and reads_saved_tables(q, v, cu_seqlens)
            keep = {} if want else None
            if alter is not None:
                kw["plan"] = _forward_plan(q, k, v, g, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, want, alter)
            o, ht = fwd(q, k, v, g, beta, **kw, keep_tables=keep)
        else:
            o, ht = fwd(q, k, v, g, beta, **kw)
        kept = [keep.get(n) for n in SAVED_TABLES] if keep else [None] * len(SAVED_TABLES)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *kept)
        ctx.cu_seqlens = cu_seqlens  # not differentiable; may be an inference tensor, which autograd cannot save
        ctx.opts = (scale, bool(use_qk_l2norm_in_kernel), bool(state_v_first), impl, alter)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, *kept = ctx.saved_tensors
        cu_seqlens = ctx.cu_seqlens
        scale, use_l2, state_v_first, impl, alter = ctx.opts
        _, bwd = _directions(impl)
        if do is None:
            do = torch.zeros(*v.shape[:2], v.shape[2], v.shape[3], device=v.device, dtype=v.dtype)
        args = (q, k, v, g, beta, do.to(q.dtype), dht)
        kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_l2,
                  state_v_first=state_v_first, cu_seqlens=cu_seqlens)
        if impl == "tilelang":
            if kept[0] is not None:
                kw["saved_tables"] = dict(zip(SAVED_TABLES, kept))
            if alter is not None:
                from kernels.backward.pipeline import plan_for, prepare_backward
                b = prepare_backward(*args, **{n: a for n, a in kw.items() if n != "saved_tables"})
                kw["plan"] = alter(plan_for(b)) if b.x.NC else None
        dq, dk, dv, dg, db, dh0 = bwd(*args, **kw)
        if dh0 is not None and initial_state is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, db, None, dh0, None, None, None, None, None, None


def apply(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
          state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
          use_beta_sigmoid_in_kernel=False, *, impl: str = "tilelang", alter=None):
    """The activations, then ``ChunkGatedDeltaRuleFunction`` with the forward's signature; ``impl`` and ``alter``
    as the module says."""
    g, beta = activations(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, impl, alter)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False):
    """Differentiable GDN chunked forward (``kernels.forward.pipeline`` for shapes and dtypes,
    ``kernels.activations`` for the in-kernel gate and beta)."""
    return apply(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 state_v_first, cu_seqlens, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
