"""FLA's in-kernel gate and beta activations, as plain differentiable torch before the autograd Function.

``activations(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel) -> (g, beta)`` with
the semantics of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core 0.6):

* ``use_gate_in_kernel``: ``g`` is the raw gate input ``[B, T, HV]``; the log decay is
  ``-exp(A_log) * softplus(g + dt_bias)`` in fp32 (softplus with beta 1, threshold 20), ``A_log`` ``[HV]``
  required, ``dt_bias`` ``[HV]`` or None;
* ``use_beta_sigmoid_in_kernel``: ``beta`` is the logits ``[B, T, HV]``; beta = ``sigmoid(beta)`` in fp32.

Gradients reach g, beta, A_log and dt_bias through autograd, in their dtypes.  Importing this module imports
neither tilelang nor CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["activations"]


def _check(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel):
    """Raise ValueError naming the first bad activation argument."""
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {type(flag).__name__}")
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is given but use_gate_in_kernel=False: it is only read by the in-kernel "
                                 f"gate (pass use_gate_in_kernel=True, or the log decay g without {name})")
        if not use_beta_sigmoid_in_kernel:
            return
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError("v must be a 4-D tensor [B, T, HV, V]")
    B, T, HV = v.shape[:3]
    raw = ([("g", g)] if use_gate_in_kernel else []) + ([("beta", beta)] if use_beta_sigmoid_in_kernel else [])
    for name, x in raw:
        what = "raw gate input" if name == "g" else "beta logits"
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, T, HV) or not x.is_floating_point():
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} ({what}) must be a floating [B, T, HV] = {(B, T, HV)} tensor, got {got}")
    if not use_gate_in_kernel:
        return
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log ([HV] decay parameter)")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (HV,) or not x.is_floating_point():
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a floating [HV] = ({HV},) tensor, got {got}")
        if x.device != g.device:
            raise ValueError(f"{name} is on {x.device}, expected {g.device} like g")


def activations(g, beta, v, use_gate_in_kernel: bool = False, A_log=None, dt_bias=None,
                use_beta_sigmoid_in_kernel: bool = False):
    """(g, beta) as the kernels take them: the log decay and beta, fp32 where an activation ran, else the inputs
    themselves.  ``v`` [B, T, HV, V] gives the expected shapes.  ValueError names the first bad argument."""
    _check(g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if use_gate_in_kernel:
        x = g.float() if dt_bias is None else g.float() + dt_bias.float()
        g = -A_log.float().exp() * F.softplus(x)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    return g, beta
