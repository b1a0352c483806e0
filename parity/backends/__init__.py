"""The backend registry. A backend is named by its registry name (``fla-triton``), by the name of an entry point
another distribution registers under ``gdn_parity.backends`` (parity.plugins), or, for tests, by ``module:Class``
(any importable subclass of parity.backends.base.Backend)."""

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


def plugins():
    """The installed ``gdn_parity.backends`` entry points (parity.plugins.Plugins: backends by name, an
    unavailable one saying why where loading failed, and the problems), loaded once per process."""
    from parity.plugins import installed_plugins

    return installed_plugins(tuple(BACKENDS))


def all_backends() -> dict[str, type[Backend]]:
    """The built-in backends, then the entry-point ones."""
    return {**BACKENDS, **plugins().backends}


def get_backend(spec: str) -> Backend:
    """An instance of the backend named ``spec`` (a registry or entry-point name, or ``module:Class``)."""
    if spec in BACKENDS:
        return BACKENDS[spec]()
    if ":" not in spec and spec in plugins().backends:
        return plugins().backends[spec]()
    if ":" in spec:
        module, _, attr = spec.partition(":")
        if module == "parity.plugins":  # an entry point's stand-in: exists once the entry points are loaded
            plugins()
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load backend {spec!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ValueError(f"{spec!r} is not a parity.backends.base.Backend subclass")
        return cls()
    raise ValueError(f"unknown backend {spec!r}; known: {', '.join(all_backends())} (or module:Class)")


def resolve(specs: list[str] | None) -> list[Backend]:
    """Backends for a run: the given specs, or every registered backend (entry points included); BASELINE is
    always included."""
    names = list(specs) if specs else list(all_backends())
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return [get_backend(n) for n in dict.fromkeys(names)]


__all__ = ["Backend", "RunResult", "BACKENDS", "BASELINE", "all_backends", "get_backend", "plugins", "resolve"]
