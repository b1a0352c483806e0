"""``sglang-fla``: SGLang's vendored FLA chunk GDN, ``sglang.srt.layers.attention.fla.chunk.chunk_gated_delta_rule``,
the prefill kernel SGLang runs where it does not pick FlashInfer. Not fla-core 0.6.0: natural ``exp`` on the gate
cumsum, and its gating kernel (``fused_gdn_gating``) writes sigmoid(b) in b's dtype (bf16 in a bf16 model).
Conversions: parity.backends.engine_fla."""

from __future__ import annotations

from parity.backends.engine_fla import EngineFla


class SglangFla(EngineFla):
    name = "sglang-fla"
    description = "SGLang's FLA copy (sglang.srt.layers.attention.fla.chunk.chunk_gated_delta_rule), forward"
    package = "sglang"
    chunk_module = "sglang.srt.layers.attention.fla.chunk"
    gating_module = "sglang.srt.layers.attention.fla.fused_gdn_gating"
    packages = ("sglang", "triton")
