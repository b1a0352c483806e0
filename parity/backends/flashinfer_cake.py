"""``flashinfer-cake``: FlashInfer's Cake GDN prefill, ``flashinfer.gdn_prefill.chunk_gated_delta_rule(...,
backend="cake_gdn")``, with the same conversions as ``flashinfer`` (parity.backends.flashinfer). Cake GDN is built
for SM100a/SM103a only: the architecture is checked with FlashInfer's own
``flashinfer.jit.cake_gdn.arch_for_compute_capability`` (which raises "Cake GDN supports only SM100a/SM103a"), so on
other GPUs the cell is unsupported with that reason and the kernel never runs."""

from __future__ import annotations

import importlib.util

from parity.backends.flashinfer import CONVERSION, FlashInfer

ARCH_CHECK = "flashinfer.jit.cake_gdn"


class FlashInferCake(FlashInfer):
    name = "flashinfer-cake"
    description = 'FlashInfer gdn_prefill.chunk_gated_delta_rule(backend="cake_gdn"), SM100a/SM103a'
    conversion = CONVERSION + '; backend="cake_gdn"'
    call_backend = "cake_gdn"

    def available(self) -> tuple[bool, str]:
        ok, reason = super().available()
        if not ok:
            return ok, reason
        try:
            found = importlib.util.find_spec(ARCH_CHECK) is not None
        except Exception as err:  # noqa: BLE001 - finding it imports flashinfer.jit, which may fail: unavailable
            return False, f"{ARCH_CHECK} does not import: {type(err).__name__}: {err}"
        return (True, "") if found else (False, f"{ARCH_CHECK} is not installed (the source-only Cake GDN backend)")

    def arch_supports(self, cap) -> tuple[bool, str]:
        import importlib

        try:
            cake = importlib.import_module(ARCH_CHECK)
        except Exception as err:  # noqa: BLE001 - no check to ask: say why
            return False, f"{ARCH_CHECK} does not import: {type(err).__name__}: {err}"
        try:
            cake.arch_for_compute_capability(*cap)
        except cake.CakeGDNUnsupportedError as err:
            return False, str(err)
        return True, ""
