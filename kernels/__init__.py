"""TileLang GDN (gated delta rule) chunked forward and backward for Hopper (sm_90a).

``kernels.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None,
dt_bias=None, use_beta_sigmoid_in_kernel=False) -> (o, final_state)`` follows FLA's
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (the in-kernel gate and beta sigmoid included; padded varlen:
``cu_seqlens[-1] < T``, o and the gradients zero past it) and is differentiable in q, k, v, g, beta,
initial_state, A_log and dt_bias.  It runs as the ``torch.library`` ops ``gdn_parity::chunk_gdr_fwd`` /
``chunk_gdr_bwd`` (``library.py``: ``torch.compile`` traces it without a graph break; CPU tensors run the torch
emulation).  See ``kernels/README.md``.

Importing this package imports neither tilelang nor CUDA: the kernels are built on the first call.
"""

from kernels.library import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
