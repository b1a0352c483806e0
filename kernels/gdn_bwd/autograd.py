"""``torch.autograd.Function`` around our TileLang GDN forward and backward.

``chunk_gated_delta_rule(...)`` has the forward API's signature (``kernels.gdn_fwd.api``) and is
differentiable in q, k, v, g, beta and initial_state: gradients come back in the inputs' dtypes (dh0 in
fp32).  The forward is the dispatched forward, whose intra kernel also stores Tinv when a gradient is needed
(``_SAVE_TABLES``); the Function keeps the inputs and that kernel's tables ``Th`` (Tinv), ``Ah``, ``Al`` (Ag =
Tinv diag(beta), hi + lo): 3 x [HV, NC, 64, 64] in the input dtype, 384 bytes a token and value head (FLA keeps
its A, 128), where the backward reads them (``keeps_tables``: not for the segmented reverse pass of few heads over
long sequences).  The backward's prep kernel then skips K K^T and the solve; it recomputes the chunk states with
the forward's own state kernel and runs ``gdn_bwd/api.py``.

``_impl="emulation"`` runs the torch emulations of both directions instead (any device; CPU tests).
``_tables`` picks the backward's chunk-table precision (``gdn_bwd/api.py``: "split", the default, or the opt-in
"lean_sd", ``build.parse_tables``).
"""

from __future__ import annotations

import torch

from .api import SAVED_TABLES


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


# private switch (A/B timing: off in the column ``ours-no-saved``): the forward keeps its intra tables for the backward
# (``kernels.gdn_fwd.api``'s ``_keep_tables``); off, the backward's prep recomputes them (the form until session 14)
_SAVE_TABLES = True


def keeps_tables(q, v, cu_seqlens=None) -> bool:
    """Whether the Function's forward keeps its intra tables for the backward of these inputs: ``_SAVE_TABLES`` on
    and the backward reads them (``api.saved_tables_used``)."""
    from .api import saved_tables_used
    return _SAVE_TABLES and saved_tables_used(q, v, cu_seqlens)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, impl, tables):
        fwd, _ = _impls(impl)
        keep = {} if impl == "tilelang" and any(ctx.needs_input_grad) and keeps_tables(q, v, cu_seqlens) else None
        o, ht = fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                    **({"_keep_tables": keep} if keep is not None else {}))
        kept = [keep.get(n) for n in SAVED_TABLES] if keep else [None] * len(SAVED_TABLES)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *kept)
        ctx.opts = (scale, bool(use_qk_l2norm_in_kernel), bool(state_v_first), impl, tables)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, *kept = ctx.saved_tensors
        scale, use_l2, state_v_first, impl, tables = ctx.opts
        _, bwd = _impls(impl)
        if do is None:
            do = torch.zeros(*v.shape[:2], v.shape[2], v.shape[3], device=v.device, dtype=v.dtype)
        kw = {"_tables": tables} if tables else {}
        if kept[0] is not None:
            kw["_saved_tables"] = dict(zip(SAVED_TABLES, kept))
        dq, dk, dv, dg, db, dh0 = bwd(q, k, v, g, beta, do.to(q.dtype), dht, scale=scale, initial_state=initial_state,
                                      use_qk_l2norm_in_kernel=use_l2, state_v_first=state_v_first,
                                      cu_seqlens=cu_seqlens, **kw)
        if dh0 is not None and initial_state is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, db, None, dh0, None, None, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, *,
                           _impl: str = "tilelang", _tables: str | None = None):
    """Differentiable GDN chunked forward (see ``kernels.gdn_fwd.api`` for shapes and dtypes)."""
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, _impl, _tables)
