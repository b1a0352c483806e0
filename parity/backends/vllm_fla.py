"""``vllm-fla``: vLLM's vendored FLA chunk GDN, ``vllm.model_executor.layers.fla.ops.chunk_gated_delta_rule``, the
prefill kernel vLLM runs where it does not pick FlashInfer (``_resolve_gdn_prefill_backend`` in
vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py). Not fla-core 0.6.0: natural ``exp`` on the gate
cumsum, and ``solve_tril`` as a separate kernel in "ieee" precision. Conversions: parity.backends.engine_fla."""

from __future__ import annotations

from parity.backends.engine_fla import EngineFla


class VllmFla(EngineFla):
    name = "vllm-fla"
    description = "vLLM's FLA copy (vllm.model_executor.layers.fla.ops.chunk_gated_delta_rule), forward"
    package = "vllm"
    chunk_module = "vllm.model_executor.layers.fla.ops"
    gating_module = "vllm.model_executor.layers.fla.ops.fused_gdn_gating"
    packages = ("vllm", "triton")
