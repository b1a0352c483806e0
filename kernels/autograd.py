"""``torch.autograd.Function`` of the TileLang GDN forward and backward.

``apply(...)`` has the forward's signature (``kernels.forward.pipeline``) plus FLA's in-kernel activations
(``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``use_beta_sigmoid_in_kernel``: ``kernels.activations``, applied in
torch before the Function) and is differentiable in q, k, v, g, beta, initial_state, A_log and dt_bias: gradients
come back in the inputs' dtypes.  ``run_forward`` / ``run_backward`` are the two directions, shared with the
``torch.library`` ops (``kernels.library``).  Where a gradient
is needed and the backward reads them (``backward.pipeline.reads_saved_tables``), the forward's intra kernel also
stores Tinv and the Function keeps its tables ``Th`` (Tinv), ``Ah``, ``Al`` (Ag = Tinv diag(beta), hi + lo):
3 x [HV, NC, 64, 64] in the input dtype, 384 bytes a token and value head; the backward's prep kernel then skips
K K^T and the solve.  The Function hands them to its backward (``backward.pipeline.HandedTables``), which frees
them once dh and the recompute have read them.

``apply(..., impl="emulation")`` runs the torch emulations of both directions instead (any device; CPU tests),
with the tilelang Function's arithmetic (its dh reads Tinv's hi term alone where the tables are the forward's);
``alter``: a function of a plan returning the plan to run (a benchmark's alternative, ``dataclasses.replace``),
applied to the forward's and the backward's dispatched plans.
"""

from __future__ import annotations

import torch

from kernels.activations import activations
from kernels.backward.pipeline import SAVED_TABLES, HandedTables


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


def run_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, state_v_first,
                cu_seqlens, *, impl: str, alter=None, keep: bool = False):
    """(o, final state or None, kept tables ``[Th, Ah, Al]`` or None) of one forward.  ``keep``: a gradient will be
    asked, so the tilelang forward keeps its intra tables where the backward reads them
    (``backward.pipeline.reads_saved_tables``, or ``alter.keep_tables`` where an ``alter`` function carries it:
    an A/B plan that reads tables where the dispatched one does not); the emulation keeps none."""
    fwd, _ = _directions(impl)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first, cu_seqlens=cu_seqlens)
    if impl != "tilelang":
        o, ht = fwd(q, k, v, g, beta, **kw)
        return o, ht, None
    from kernels.backward.pipeline import reads_saved_tables
    forced = getattr(alter, "keep_tables", None)        # an A/B plan's own answer
    want = keep and (reads_saved_tables(q, v, cu_seqlens) if forced is None else forced and reads_saved_tables(q))
    tables = {} if want else None
    if alter is not None:
        kw["plan"] = alter
    o, ht = fwd(q, k, v, g, beta, **kw, keep_tables=tables)
    return o, ht, [tables[n] for n in SAVED_TABLES] if tables else None


def run_backward(q, k, v, g, beta, initial_state, do, dht, scale, use_qk_l2norm_in_kernel, state_v_first,
                 cu_seqlens, *, impl: str, alter=None, kept=None):
    """(dq, dk, dv, dg, dbeta, dh0) of one backward on the forward's inputs; ``do`` None = 0; ``kept``: the forward's
    ``[Th, Ah, Al]``, or a ``backward.pipeline.HandedTables`` (emptied once read, so that the tables' memory is
    reused within the backward), or None / empty (prep recomputes them); dh0 in the initial state's dtype (None
    without one)."""
    _, bwd = _directions(impl)
    if do is None:
        do = torch.zeros(*v.shape[:2], v.shape[2], v.shape[3], device=v.device, dtype=v.dtype)
    args = (q, k, v, g, beta, do.to(q.dtype), dht)
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              state_v_first=state_v_first, cu_seqlens=cu_seqlens)
    if impl == "tilelang":
        if alter is not None:
            kw["plan"] = alter
        if kept:
            kw["saved_tables"] = kept if isinstance(kept, dict) else dict(zip(SAVED_TABLES, kept))
    else:       # the tilelang Function's arithmetic: its fused one-term plan where dispatched, else Tinv's hi term
        #         alone where its dh reads the forward's tables
        from kernels.backward.emulation import FUSED_FP16
        from kernels.backward.pipeline import reads_saved_tables, runs_fused
        if runs_fused(q, v, cu_seqlens):
            kw.update(FUSED_FP16)
        else:       # (not fused: q alone decides)
            kw["tinv_hi_only"] = reads_saved_tables(q)
    dq, dk, dv, dg, db, dh0 = bwd(*args, **kw)
    if dh0 is not None and initial_state is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, db, dh0


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, impl, alter):
        o, ht, kept = run_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, impl=impl, alter=alter,
                                  keep=any(ctx.needs_input_grad))
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        # the tables are handed to the backward, which frees them after their last read (a second backward of a
        # retained graph finds the dict empty and recomputes them)
        ctx.kept = HandedTables(zip(SAVED_TABLES, kept)) if kept else None
        ctx.cu_seqlens = cu_seqlens  # not differentiable; may be an inference tensor, which autograd cannot save
        ctx.opts = (scale, bool(use_qk_l2norm_in_kernel), bool(state_v_first), impl, alter)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        scale, use_l2, state_v_first, impl, alter = ctx.opts
        grads = run_backward(q, k, v, g, beta, initial_state, do, dht, scale, use_l2, state_v_first, ctx.cu_seqlens,
                             impl=impl, alter=alter, kept=ctx.kept)
        return (*grads[:5], None, grads[5], None, None, None, None, None, None)


def apply(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
          state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
          use_beta_sigmoid_in_kernel=False, *, impl: str = "tilelang", alter=None):
    """The activations, then ``ChunkGatedDeltaRuleFunction`` with the forward's signature, or where no gradient can
    be asked (grad mode off, or no input requires one) the forward alone (``run_forward``, no tables kept); ``impl``
    and ``alter`` as the module says."""
    g, beta = activations(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                            for t in (q, k, v, g, beta, initial_state))):
        # no gradient can be asked: the forward alone, without the Function's host time
        o, ht, _ = run_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                               state_v_first, cu_seqlens, impl=impl, alter=alter)
        return o, ht
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, impl, alter)
