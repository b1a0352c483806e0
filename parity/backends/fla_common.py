"""What the FLA adapters share: lazy import (with the Triton-interpreter shims on a CPU), switching
FLA's backend dispatch off, and tracing which implementation FLA's dispatcher really ran.

FLA 0.6 routes ``chunk_gated_delta_rule`` to FlashQLA on Hopper when flash_qla is installed, and can
route sub-kernels to TileLang; each registered backend is switched off by its environment variable
(``FLA_FLASH_QLA=0``, ``FLA_TILELANG=0``, ...), which FLA reads at call time. The tracer wraps every
registered backend's implementation so a run records exactly what executed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings

import torch

from cases.case import Case
from parity.backends.base import all_float, unpadded

_interpret_shims_applied = False


def on_cpu_interpreter() -> bool:
    """True when FLA's Triton kernels would run under the Triton interpreter (no CUDA here)."""
    return not torch.cuda.is_available()


def fla_available() -> tuple[bool, str]:
    """(ok, reason) for importing FLA's GDN ops here; on a CPU this needs TRITON_INTERPRET=1 before import."""
    for mod in ("fla", "triton"):
        if importlib.util.find_spec(mod) is None:
            pkg = "fla-core" if mod == "fla" else mod
            return False, f"package {pkg} is not installed"
    if on_cpu_interpreter():
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "triton" in sys.modules or "fla" in sys.modules:
                return False, "no GPU, and triton was imported without TRITON_INTERPRET=1 (the CPU interpreter)"
            os.environ["TRITON_INTERPRET"] = "1"
        return True, "no GPU: Triton interpreter on the CPU (fp32 wiring checks only)"
    return True, ""


FLA_PADDING = "FLA (fla-core 0.6 allocates them with torch.empty_like and writes the sequences' tokens only)"


def cpu_interpreter_supports(case: Case, max_tokens: int = 128) -> tuple[bool, str]:
    """The interpreter runs fp32 faithfully but not bf16/fp16, and slowly (seconds per chunk of 64 tokens):
    fp32 inputs and at most ``max_tokens`` tokens.  Padded varlen is refused on any device (``FLA_PADDING``)."""
    ok, why = unpadded(case, FLA_PADDING)
    if not ok or not on_cpu_interpreter():
        return ok, why
    if not all_float(case, "fp32"):
        return False, "no GPU: the Triton interpreter does not emulate bf16/fp16 faithfully (fp32 inputs only)"
    if case.B * case.T > max_tokens:
        return False, f"no GPU: the Triton interpreter is only run up to {max_tokens} tokens"
    return True, ""


def _apply_interpreter_shims() -> None:
    """Two shims FLA's kernels need under the Triton interpreter: the autotuner keeps one config (it cannot
    benchmark without a GPU), and loop indices from ``range`` get a no-op ``.to`` (compiled Triton has it)."""
    global _interpret_shims_applied
    if _interpret_shims_applied:
        return
    import builtins

    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    prune = autotuner.Autotuner.prune_configs

    def keep_first(self, kwargs):
        return prune(self, kwargs)[:1]

    class _Index(int):
        def to(self, *args, **kwargs):
            return self

    def index_range(*args):
        return (_Index(i) for i in builtins.range(*args))

    patch_lang = interpreter._patch_lang

    def patch(fn):
        fn.__globals__["range"] = index_range
        return patch_lang(fn)

    autotuner.Autotuner.prune_configs = keep_first
    interpreter._patch_lang = patch
    _interpret_shims_applied = True


def import_gdn():
    """fla.ops.gated_delta_rule, imported on first use (with the interpreter shims on a CPU)."""
    ok, reason = fla_available()
    if not ok:
        raise RuntimeError(reason)
    if on_cpu_interpreter():
        _apply_interpreter_shims()
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    import fla.ops.gated_delta_rule as gdn

    return gdn


def _registered_backends():
    import fla.backends as fb

    for op, registry in getattr(fb, "_operation_registries", {}).items():
        for backend_type, backend in getattr(registry, "_backends", {}).items():
            yield op, backend_type, backend


@contextlib.contextmanager
def dispatch_off(on: tuple[str, ...] = ()):
    """Switch every FLA dispatch backend off for the duration (their env vars set to 0), except the env vars named in
    ``on`` (set to 1); restoring after."""
    names = {"FLA_FLASH_QLA", "FLA_TILELANG", "FLA_INTRACARD_CP", "FLA_GLUON"}
    for _, backend_type, backend in _registered_backends():
        names.add(f"FLA_{backend_type.upper()}")
        if backend.env_var:
            names.add(backend.env_var)
    saved = {n: os.environ.get(n) for n in names | set(on)}
    os.environ.update({n: "0" for n in names})
    os.environ.update({n: "1" for n in on})
    try:
        yield
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


@contextlib.contextmanager
def trace_dispatch(allow: set[str] | None = None):
    """Yield a list that collects 'operation.function->backend' for every dispatched call FLA makes.  With
    ``allow`` (function names), a backend offered any other function declines it, so FLA runs its Triton one."""
    calls: list[str] = []
    patched = []
    for op, backend_type, backend in _registered_backends():
        original = backend.get_implementation

        def traced(function_name, _orig=original, _op=op, _bt=backend_type):
            if allow is not None and function_name not in allow:
                return None
            impl = _orig(function_name)
            if impl is None:
                return None

            def call(*args, **kwargs):
                calls.append(f"{_op}.{function_name}->{_bt}")
                return impl(*args, **kwargs)

            return call

        backend.get_implementation = traced
        patched.append(backend)
    try:
        yield calls
    finally:
        for backend in patched:
            del backend.get_implementation


def triton_refuses_gated_dqkwg() -> str | None:
    """Why FLA will not run its Triton ``chunk_bwd_dqkwg`` with gates here, or None when it will.  fla-core 0.6
    raises instead on Hopper with Triton in [3.4, 3.7.1) (wrong results there, fla #640) and sends the call to its
    TileLang kernel by default; FLA's own flags decide (``fla.utils``), read after FLA is imported."""
    import fla.utils as fu

    if getattr(fu, "IS_NVIDIA_HOPPER", False) and getattr(fu, "TRITON_ABOVE_3_4_0", False) \
            and not getattr(fu, "TRITON_ABOVE_3_7_1", True):
        import triton

        return (f"FLA refuses its Triton gated chunk_bwd_dqkwg on Hopper with Triton {triton.__version__} "
                "(fla #640); FLA's TileLang kernel runs it")
    return None


@contextlib.contextmanager
def triton_backward():
    """The context FLA's backward runs in for a Triton-only run: every dispatch backend off, except FLA's TileLang
    ``chunk_bwd_dqkwg`` where FLA refuses its Triton one (``triton_refuses_gated_dqkwg``; FLA's own workaround,
    the only way its backward runs there).  Yields a dict: ``"impl"`` names what ran when anything was dispatched.
    Every other function a backend is offered is declined (``trace_dispatch(allow)``), so FLA runs its Triton one."""
    refused = triton_refuses_gated_dqkwg()
    allow = {"chunk_bwd_dqkwg"} if refused else set()
    note: dict = {}
    with dispatch_off(on=("FLA_TILELANG",) if refused else ()), trace_dispatch(allow) as calls:
        yield note
    if calls:
        note["impl"] = f"fla/triton + {','.join(sorted(set(calls)))} ({refused})"


def describe(calls: list[str]) -> str:
    """'fla/triton' when nothing was dispatched, else 'fla/' + the dispatched backends."""
    if not calls:
        return "fla/triton"
    return "fla/" + ",".join(sorted({c.split("->")[1] for c in calls}))


def fla_kwargs(inputs) -> dict:
    """FLA call kwargs: FLA's in-kernel gate needs A_log/dt_bias; cu_seqlens as int64."""
    kw = inputs.kwargs()
    if kw.get("cu_seqlens") is not None:
        kw["cu_seqlens"] = kw["cu_seqlens"].to(torch.int64)
    return kw


def triton_chunk_gated_delta_rule():
    """FLA's ``chunk_gated_delta_rule`` (FLA's call signature) with every dispatch backend switched off while it
    runs, so that its Triton kernels run: the callable the kernel benchmarks time (no dispatch trace around the call).
    RuntimeError with the reason when FLA cannot be imported here."""
    gdn = import_gdn()

    def call(*args, **kwargs):
        with dispatch_off():
            return gdn.chunk_gated_delta_rule(*args, **kwargs)

    return call
