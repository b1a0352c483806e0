"""Compilation of the kernels of both directions: target, pass configs, every configuration a dispatch can
choose, an in-process cache (TileLang adds its own on-disk cache, ``TILELANG_CACHE_DIR``), parallel precompile,
and the ptxas / shared-memory reports the compile tests check.

Importing this module imports neither tilelang nor CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import os

from kernels.backward import configs as bwd
from kernels.forward import configs as fwd
from kernels.forward.configs import DTYPES, HEAD_DIMS, RV_BV, IntraConfig
from kernels.forward.precision import PRESETS, preset
from kernels.plan import ONE_TERM_FIELDS, WS_CP_BV, WS_HEAD_DIMS, BackwardPlan, ForwardPlan

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def forward_configs():
    """Every forward configuration a dispatch decision can choose (``kernels.plan.forward_plan`` and the
    backward's recompute): for bf16 and fp16, precision "default": the intra kernel (and its
    Tinv-keeping form), the rv state kernel + its CP scan and fix-up, the smem state kernel at every BV
    ``block_v`` picks (one CTA per SM at 64 / 32 / 16, two at 32 / 16), the output kernel for both table layouts,
    the recompute's smem state kernels (S lo swizzled, S hi alone, or S lo in fp8) and, at the ws head dims, its
    warp-specialised form (``BackwardPlan.recompute_ws``, S lo in fp8; per dh segment from warm-up chunks,
    ``recompute_warm``; the fused plan's, on fp16 copies of k and v, also with one-term products), the intra kernel
    with split merges (the A/B alternative of ``Precision.merge`` and ``BackwardPlan.merge``; the one-term merges'
    kernels compile when a benchmark asks for them), and the fused warp-specialised state-output kernel (the plan form
    "ws") at BV 64 / 32, computing P or (as dispatched, at the ws head dims) reading the intra kernel's P tables,
    per CP segment with warm-up starts (``ForwardPlan.warm``, with its scan and fix-up; and ``split_heads``' two
    kernels), and with fp16 operands (the A/B precision "half", at the ws head dims: BV 128, with and without P
    tables, and BV 64 / 32 with them).

    All of that for each head dim K = V in ``HEAD_DIMS`` (128 first).  Everything else (T, B, N, H, HV, the GVA
    ratio, scale, h0 present or not, final state stored or not, the state layout, l2norm on/off, gate dtype, dense
    vs varlen) is a runtime argument of the same binaries."""
    out = []
    for DK in sorted(HEAD_DIMS, reverse=True):
        for dtype in DTYPES:
            prec = preset()
            plans = [ForwardPlan(dtype, prec, "rv", RV_BV, 1, 2, DK=DK)]
            plans += [ForwardPlan(dtype, prec, "smem", bv, 1, 1, DK=DK) for bv in (64, 32, 16)]
            plans += [ForwardPlan(dtype, prec, "smem", bv, 2, 1, DK=DK) for bv in (32, 16)]
            plans += [ForwardPlan(dtype, prec, "smem", 64, 1, 1, keep_tables=True, DK=DK)]
            # the fused warp-specialised state-output kernel (the "ws" form)
            plans += [ForwardPlan(dtype, prec, "ws", bv, 1, 1, DK=DK) for bv in (64, 32)]
            if DK in WS_HEAD_DIMS:  # as dispatched: P from the intra kernel's tables (with Tinv kept, too)
                plans += [ForwardPlan(dtype, prec, "ws", bv, 1, 1, keep_tables=kt, DK=DK, p_table=True)
                          for bv, kt in ((64, False), (32, False), (64, True))]
                # per CP segment with warm-up starts (and its scan and fix-up)
                plans += [ForwardPlan(dtype, prec, "ws", WS_CP_BV, 1, 2, DK=DK, p_table=True, warm=True)]
                # the same per (sequence, value head) beside whole sequences at BV 32 (split_heads, an A/B form)
                plans += [ForwardPlan(dtype, prec, "ws", WS_CP_BV, 1, 2, DK=DK, p_table=True, warm=True,
                                      split_heads=True)]
                # the fp16-operand precision (an A/B alternative; P tables or, at BV 128, P formed in the ws kernel)
                plans += [ForwardPlan(dtype, PRESETS["half"], "ws", bv, 1, 1, DK=DK, p_table=pt)
                          for bv, pt in ((128, True), (128, False), (64, True), (32, True))]
            cfgs = [c for p in plans for c in p.configs()]
            # the intra kernel with split block merges (the benchmarks' msplit), with and without Tinv
            cfgs += [IntraConfig(dtype, "split", prec.ag, DK=DK, th=th) for th in (False, True)]
            # the backward recompute's (precision "recompute", S lo tile swizzled; S hi alone with s_single; S lo in
            # fp8 with lo8) at every BV block_v picks
            cfgs += [BackwardPlan(dtype, recompute_block_v=bv, s_single=s, lo8=lo8, DK=DK).recompute_configs()[1]
                     for s, lo8 in ((False, False), (True, False), (False, True)) for bv in (64, 32, 16)]
            if DK in WS_HEAD_DIMS:  # its warp-specialised form (recompute_ws, dispatched there), S lo in fp8
                cfgs += [BackwardPlan(dtype, recompute_block_v=bv, lo8=True, DK=DK, recompute_ws=True)
                         .recompute_configs()[1] for bv in (64, 32, 16)]
                # per dh segment from warm-up chunks (recompute_warm)
                cfgs += [BackwardPlan(dtype, dh_segments=True, recompute_block_v=WS_CP_BV, lo8=True, DK=DK,
                                      recompute_ws=True, recompute_warm=True).recompute_configs()[1]]
            if DK == bwd.DQK_E_ONCE_HEAD_DIM and dtype == "float16":     # the one-term plans' (products split)
                cfgs += [BackwardPlan(**{**ONE_TERM_FIELDS, "fused": True}, recompute_ws=True, recompute_block_v=bv,
                                      DK=DK).recompute_configs()[1] for bv in (64, 32, 16)]
                # with K S, X and F2 U one term (recompute_one), as the fused plan is dispatched (at 64 columns)
                cfgs += [BackwardPlan(**{**ONE_TERM_FIELDS, "fused": True}, recompute_ws=True, recompute_block_v=64,
                                      DK=DK, recompute_one=True).recompute_configs()[1]]
            for c in cfgs:
                if c not in out:
                    out.append(c)
    return out


def all_configs():
    """Every kernel configuration of both directions (forward first; what the compile tests build)."""
    return forward_configs() + bwd.all_configs()


def prim_func(cfg):
    """The TileLang function of a configuration of either direction."""
    return bwd.prim_func(cfg) if isinstance(cfg, bwd.BwdConfig) else fwd.prim_func(cfg)


def pass_configs():
    import tilelang
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@functools.lru_cache(maxsize=None)
def get_kernel(cfg):
    """Compile (or fetch from TileLang's cache) the kernel of ``cfg`` (either direction) for sm_90a; its calls
    launch it through ``direct_launch``."""
    import tilelang
    return direct_launch(tilelang.compile(prim_func(cfg), target=TARGET, pass_configs=pass_configs()))


def direct_launch(kern):
    """``kern`` (a TileLang ``JITKernel``) with its calls sent straight to its TVM-FFI executable where it
    allocates no outputs (the host time of the wrapper's Python argument handling saved; the executable checks
    every argument's count, dtype, shape, strides and device itself); any other kernel as it is."""
    adapter = getattr(kern, "adapter", None)
    executable = getattr(adapter, "get_exportable_executable", None)
    if (getattr(kern, "execution_backend", None) == "tvm_ffi" and executable is not None
            and not getattr(adapter, "result_idx", True) and not getattr(adapter, "_ffi_callee_allocated_output_abi",
                                                                         True)):
        kern.torch_function = executable()
    return kern


def launches_directly(kern) -> bool:
    """Whether calls of ``kern`` go straight to its TVM-FFI executable (``direct_launch``)."""
    adapter = getattr(kern, "adapter", None)
    return (getattr(kern, "execution_backend", None) == "tvm_ffi" and hasattr(adapter, "get_exportable_executable")
            and kern.torch_function is adapter.get_exportable_executable())


def _compile_named(cfg, get=None):
    import time
    t = time.time()
    try:
        (get or get_kernel)(cfg)
        return cfg.name, time.time() - t, None
    except Exception as e:  # pragma: no cover - reported by the caller
        return cfg.name, time.time() - t, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(cfgs, workers: int | None = None, log=print, get=None):
    """Compile ``cfgs`` in parallel spawned processes (each fills TileLang's disk cache, so this
    process then loads them quickly).  ``get``: the compile function of one configuration (a
    top-level function; ``get_kernel`` when None).  Returns the names that failed."""
    import multiprocessing as mp
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor

    cfgs = list(cfgs)
    workers = max(1, min(workers or (os.cpu_count() or 1), len(cfgs), 10))
    t = time.time()
    failed = []
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for name, secs, err in ex.map(functools.partial(_compile_named, get=get), cfgs):
            log(f"  compiled {name:<60} {secs:6.1f} s {err or ''}")
            if err:
                failed.append(name)
    log(f"  {len(cfgs)} kernels in {time.time() - t:.1f} s ({workers} processes)")
    return failed


def cubin_command(src_path: str, cubin_path: str) -> list:
    """The nvcc command that compiles a TileLang CUDA source file to an sm_90a cubin as the compile tests do (ptxas
    verbose: registers, spills, injected waits in its output)."""
    from tilelang.contrib.nvcc import default_compile_options

    return ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "--use_fast_math", "-Xptxas", "-v", "-DENABLE_BF16",
            "-o", cubin_path, src_path] + default_compile_options()


def ptxas_report(src: str, timeout: float = 300.0, log: str | None = None) -> dict:
    """Registers / spills / stack of a TileLang CUDA source for sm_90a (the compile tests: the design keeps the
    solve's column and the state in registers, no spills, no stack): parsed from ``log`` (ptxas' verbose output of
    that source's compile, e.g. TileLang's own, ``compile_report``), else from this source's report saved by an
    earlier call (``_ptxas_saved``), else from ``nvcc -cubin -Xptxas -v`` run here.  A report not read from the
    saved one is saved when its compile succeeded."""
    import subprocess
    import tempfile

    if log is None:
        saved = _ptxas_saved(src)
        if saved is not None:
            return _parse_ptxas(0, saved)
    if log is not None:
        info = _parse_ptxas(0, log)
        _save_ptxas(src, info["log"])
        return info
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(src)
        r = subprocess.run(cubin_command(path, os.path.join(d, "k.cubin")), capture_output=True, text=True,
                           timeout=timeout)
    info = _parse_ptxas(r.returncode, r.stdout + r.stderr)
    if r.returncode == 0:
        _save_ptxas(src, info["log"])
    return info


def _parse_ptxas(returncode: int, out: str) -> dict:
    import re

    info = {"returncode": returncode, "log": out[-4000:]}
    m = re.search(r"Used (\d+) registers", out)
    info["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if m:
        info["stack"], info["spill_stores"], info["spill_loads"] = map(int, m.groups())
    return info


def _ptxas_path(src: str) -> str:
    """Where the ptxas report of ``src`` is kept: beside TileLang's disk cache, keyed by the source's hash."""
    import hashlib

    root = os.environ.get("TILELANG_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".tilelang", "cache")
    return os.path.join(root, "gdn_parity_ptxas", hashlib.sha256(src.encode()).hexdigest() + ".txt")


def _ptxas_saved(src: str) -> str | None:
    try:
        with open(_ptxas_path(src)) as f:
            return f.read()
    except OSError:
        return None


def _save_ptxas(src: str, log: str) -> None:
    path = _ptxas_path(src)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(log)
        os.replace(tmp, path)
    except OSError:
        pass                    # a report not kept is computed again next time


@contextlib.contextmanager
def _tilelang_ptxas_log(out: list):
    """While open, TileLang compiles with ptxas' verbose output (``TILELANG_VERBOSE``) and each such output it logs
    is appended to ``out``: the compile tests read registers and spills from TileLang's own nvcc run instead of
    compiling the source a second time.  A kernel TileLang loads from its cache logs nothing."""
    import logging

    from tilelang import logger

    class Grab(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("PTXAS verbose output:"):
                out.append(msg)

    handler, level, env = Grab(), logger.level, os.environ.get("TILELANG_VERBOSE")
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    os.environ["TILELANG_VERBOSE"] = "1"
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if env is None:
            os.environ.pop("TILELANG_VERBOSE", None)
        else:
            os.environ["TILELANG_VERBOSE"] = env


def dyn_smem_bytes(host_src: str) -> int | None:
    """The dynamic shared memory (bytes) a TileLang kernel's launch asks for, read from its host code: the last
    integer argument packed before the launch (TileLang 0.1.15's TVM-FFI host code).  None if not found."""
    import re

    i = host_src.find("_kernel_packed == NULL")
    found = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host_src[:i]) if i >= 0 else []
    return int(found[-1]) if found else None


def compile_report(cfg, get, kind: str, with_ptxas: bool = True) -> dict:
    """Compile ``cfg`` with ``get`` (sm_90a); return name, kind, dtype, seconds, CUDA source, the launch's
    dynamic shared memory, whether its calls launch it directly (``launches_directly``) and ptxas stats (what the
    compile tests check)."""
    import time

    t = time.time()
    logs: list = []
    with _tilelang_ptxas_log(logs) if with_ptxas else contextlib.nullcontext():
        kern = get(cfg)
    src = kern.get_kernel_source()
    out = {"name": cfg.name, "kind": kind, "dtype": getattr(cfg, "dtype", "float32"),    # the fix-up has none
           "seconds": time.time() - t, "source": src, "dyn_smem": dyn_smem_bytes(kern.get_host_source()),
           "direct_launch": launches_directly(kern)}
    if with_ptxas:
        t = time.time()
        out["ptxas"] = ptxas_report(src, log=logs[-1] if len(logs) == 1 else None)
        out["ptxas_seconds"] = time.time() - t
    return out


def compile_for_test(index: int, with_ptxas: bool = True) -> dict:
    """``compile_report`` of ``all_configs()[index]`` (kind: the configuration's class name, or the backward
    kind).  Top-level so a process pool can call it."""
    cfg = all_configs()[index]
    kind = cfg.kind if isinstance(cfg, bwd.BwdConfig) else type(cfg).__name__
    return compile_report(cfg, get_kernel, kind, with_ptxas)
