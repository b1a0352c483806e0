"""The backend registry. A backend is named by its registry name (``fla-triton``) or, for plugins and
tests, by ``module:Class`` (any importable subclass of parity.backends.base.Backend)."""

from __future__ import annotations

import importlib

from parity.backends.base import Backend, RunResult
from parity.backends.cudnn import FlashInferCudnn
from parity.backends.fla_dispatch import FlaDispatch
from parity.backends.fla_recurrent import FlaRecurrent
from parity.backends.fla_triton import FlaTriton
from parity.backends.flash_qla import FlashQLA
from parity.backends.flashinfer import FlashInfer
from parity.backends.flashinfer_cake import FlashInferCake
from parity.backends.reference import RefRecurrent, TorchEmulated
from parity.backends.sglang_fla import SglangFla
from parity.backends.tilelang import TileLangKernels
from parity.backends.vllm_fla import VllmFla

BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls
    for cls in (RefRecurrent, TorchEmulated, FlaTriton, FlaDispatch, FlaRecurrent, FlashQLA, TileLangKernels,
                FlashInfer, FlashInferCake, FlashInferCudnn, VllmFla, SglangFla)
}
BASELINE = TorchEmulated.name  # the same-precision implementation verdicts compare against


def get_backend(spec: str) -> Backend:
    """An instance of the backend named ``spec`` (a registry name or ``module:Class``)."""
    if spec in BACKENDS:
        return BACKENDS[spec]()
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load backend {spec!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ValueError(f"{spec!r} is not a parity.backends.base.Backend subclass")
        return cls()
    raise ValueError(f"unknown backend {spec!r}; known: {', '.join(BACKENDS)} (or module:Class)")


def resolve(specs: list[str] | None) -> list[Backend]:
    """Backends for a run: the given specs, or every registered backend; BASELINE is always included."""
    names = list(specs) if specs else list(BACKENDS)
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return [get_backend(n) for n in dict.fromkeys(names)]


__all__ = ["Backend", "RunResult", "BACKENDS", "BASELINE", "get_backend", "resolve"]
