"""``cudnn``: cuDNN's fused linear-attention engine through FlashInfer,
``flashinfer.gdn_prefill.chunk_gated_delta_rule(..., backend="cudnn")``
(``flashinfer.cudnn.cudnn_chunk_gated_delta_rule``: gate in linear space, state V-major), with the same conversions
as ``flashinfer``. FlashInfer documents it as "cuDNN's fused SM100 engine" and exposes no capability check (cuDNN
declines a graph it cannot serve: on SM90 "gdn has no cuDNN backend lowering"), so the documented list decides:
other GPUs are unsupported without a call. Needs the cuDNN frontend (``cudnn``) 1.29 or newer."""

from __future__ import annotations

import importlib.util

from parity.backends.flashinfer import CONVERSION, FlashInfer

DOCUMENTED_ARCHS = {(10, 0), (10, 3)}  # flashinfer 0.7.2 flashinfer/cudnn/linear_attention.py: "fused SM100 engine"


class FlashInferCudnn(FlashInfer):
    name = "cudnn"
    description = 'cuDNN GDN engine via FlashInfer gdn_prefill.chunk_gated_delta_rule(backend="cudnn"), SM100/103'
    conversion = CONVERSION + '; backend="cudnn"'
    call_backend = "cudnn"
    untraced = "cudnn fused engine"  # FlashInfer imports flashinfer.cudnn inside the call: nothing to trace
    packages = FlashInfer.packages + ("nvidia-cudnn-frontend",)

    def available(self) -> tuple[bool, str]:
        ok, reason = super().available()
        if ok and importlib.util.find_spec("cudnn") is None:
            return False, "package nvidia-cudnn-frontend (module cudnn) is not installed"
        return ok, reason

    def arch_supports(self, cap) -> tuple[bool, str]:
        if cap not in DOCUMENTED_ARCHS:
            return False, (f"cuDNN's GDN engine is SM100/SM103 only (FlashInfer: \"cuDNN's fused SM100 engine\"); on "
                           f"sm_{cap[0]}{cap[1]} cuDNN declines the graph (\"gdn has no cuDNN backend lowering\")")
        return True, ""
