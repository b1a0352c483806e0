"""Reference implementations of the Gated Delta Rule forward, in plain PyTorch.

- ``fused_recurrent_gated_delta_rule``: token by token, fp64 (the ground truth).
- ``chunk_gated_delta_rule``: the chunked WY form, fp64, vectorised (fast enough for long T);
  optionally returns the per-chunk states.
- ``emulated.chunk_gated_delta_rule``: the chunked form in emulated bf16/fp16 with fp32
  accumulation, the same-precision baseline tolerances are calibrated against.

Names mirror FLA's kernels (lax_reference style). Inputs of any float dtype are upcast; everything
runs on the inputs' device and is differentiable in fp64.
"""

from reference.chunk import chunk_gated_delta_rule
from reference.recurrent import fused_recurrent_gated_delta_rule
from reference.validate import Dims, check_inputs

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "check_inputs", "Dims"]
