"""``torch.autograd.Function`` around our TileLang GDN forward and backward.

``chunk_gated_delta_rule(...)`` has the forward API's signature (``kernels.gdn_fwd.api``) and is
differentiable in q, k, v, g, beta and initial_state: gradients come back in the inputs' dtypes (dh0 in
fp32).  The forward is the dispatched forward unchanged; the backward recomputes the chunk states with the
forward's own intra/state kernels and runs ``gdn_bwd/api.py``.  Nothing is saved besides the inputs.

``_impl="emulation"`` runs the torch emulations of both directions instead (any device; CPU tests).
``_tables`` picks the backward's chunk-table precision (``gdn_bwd/api.py``: "split", the default, or the opt-in
"lean_sd", ``build.parse_tables``).
"""

from __future__ import annotations

import torch


def _impls(impl: str):
    if impl == "tilelang":
        from kernels.gdn_fwd.api import chunk_gated_delta_rule as fwd

        from .api import chunk_gated_delta_rule_bwd as bwd
    elif impl == "emulation":
        from kernels.gdn_fwd.emulation import chunk_gated_delta_rule as fwd

        from .emulation import chunk_gated_delta_rule_bwd as bwd
    else:
        raise ValueError(f"unknown implementation {impl!r} (tilelang | emulation)")
    return fwd, bwd


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, impl, tables):
        fwd, _ = _impls(impl)
        o, ht = fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    state_v_first=state_v_first, cu_seqlens=cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.opts = (scale, bool(use_qk_l2norm_in_kernel), bool(state_v_first), impl, tables)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        scale, use_l2, state_v_first, impl, tables = ctx.opts
        _, bwd = _impls(impl)
        if do is None:
            do = torch.zeros(*v.shape[:2], v.shape[2], v.shape[3], device=v.device, dtype=v.dtype)
        dq, dk, dv, dg, db, dh0 = bwd(q, k, v, g, beta, do.to(q.dtype), dht, scale=scale, initial_state=initial_state,
                                      use_qk_l2norm_in_kernel=use_l2, state_v_first=state_v_first,
                                      cu_seqlens=cu_seqlens, **({"_tables": tables} if tables else {}))
        if dh0 is not None and initial_state is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, db, None, dh0, None, None, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                           _impl: str = "tilelang", _tables: str | None = None):
    """Differentiable GDN chunked forward (see ``kernels.gdn_fwd.api`` for shapes and dtypes)."""
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, _impl, _tables)
