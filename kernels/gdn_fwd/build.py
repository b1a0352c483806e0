"""Compilation of the TileLang kernels: target, pass configs, the dispatchable
configurations, and an in-process cache (TileLang adds its own on-disk cache,
``TILELANG_CACHE_DIR``).

Everything here imports tilelang lazily, so importing this module is cheap and
works without tilelang / CUDA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

TARGET = {"kind": "cuda", "arch": "sm_90a"}
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)          # DK == DV required


@dataclass(frozen=True)
class IntraConfig:
    DK: int
    dtype: str

    @property
    def name(self) -> str:
        return f"intra[DK={self.DK},{self.dtype}]"


@dataclass(frozen=True)
class RecurrentConfig:
    DK: int
    DV: int
    BV: int
    dtype: str
    state_v_first: bool

    @property
    def name(self) -> str:
        vf = ",v_first" if self.state_v_first else ""
        return f"recurrent[DK={self.DK},DV={self.DV},BV={self.BV},{self.dtype}{vf}]"


def block_v(DV: int) -> int:
    """Value columns per CTA of the recurrent kernel (the only choice dispatched today)."""
    return min(64, DV)


def dispatch_configs(DK: int, DV: int, dtype: str, state_v_first: bool):
    """The two kernel configurations one API call uses."""
    return IntraConfig(DK, dtype), RecurrentConfig(DK, DV, block_v(DV), dtype, bool(state_v_first))


def all_configs():
    """Every configuration the API can dispatch (what the compile test builds).

    Everything else (T, B, N, H, HV, the GVA ratio, scale, h0 present or not,
    final state stored or not, l2norm on/off, gate dtype (cast to fp32 on the
    host), dense vs varlen (dense is run as varlen)) is a runtime argument.
    """
    out = []
    for dtype in DTYPES:
        for D in HEAD_DIMS:
            out.append(IntraConfig(D, dtype))
            for vf in (False, True):
                out.append(RecurrentConfig(D, D, block_v(D), dtype, vf))
    return out


def prim_func(cfg):
    if isinstance(cfg, IntraConfig):
        from .kkt_solve import build_intra_kernel
        return build_intra_kernel(cfg.DK, cfg.dtype)
    from .chunk_h import build_recurrent_kernel
    return build_recurrent_kernel(cfg.DK, cfg.DV, cfg.BV, cfg.dtype, cfg.state_v_first)


def pass_configs():
    import tilelang
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@functools.lru_cache(maxsize=None)
def get_kernel(cfg):
    """Compile (or fetch from TileLang's cache) the kernel of ``cfg`` for sm_90a."""
    import tilelang
    return tilelang.compile(prim_func(cfg), target=TARGET, pass_configs=pass_configs())


def ptxas_report(src: str, timeout: float = 300.0) -> dict:
    """Compile a TileLang CUDA source with ``nvcc -cubin -Xptxas -v`` (sm_90a) and parse
    registers / spills / stack.  Used by the compile test (the design keeps the
    solve's column and the state in registers: no spills, no stack)."""
    import os
    import re
    import subprocess
    import tempfile

    from tilelang.contrib.nvcc import default_compile_options

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(src)
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "--use_fast_math", "-Xptxas", "-v", "-DENABLE_BF16",
               "-o", os.path.join(d, "k.cubin"), path] + default_compile_options()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    info = {"returncode": r.returncode, "log": out[-4000:]}
    m = re.search(r"Used (\d+) registers", out)
    info["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if m:
        info["stack"], info["spill_stores"], info["spill_loads"] = map(int, m.groups())
    return info


def compile_for_test(index: int, with_ptxas: bool = True) -> dict:
    """Compile ``all_configs()[index]`` for sm_90a; return name, seconds, CUDA source and ptxas stats.
    Top-level so a process pool can call it."""
    import time

    cfg = all_configs()[index]
    t = time.time()
    kern = get_kernel(cfg)
    secs = time.time() - t
    src = kern.get_kernel_source()
    out = {"name": cfg.name, "kind": type(cfg).__name__, "dtype": cfg.dtype, "seconds": secs, "source": src}
    if with_ptxas:
        t = time.time()
        out["ptxas"] = ptxas_report(src)
        out["ptxas_seconds"] = time.time() - t
    return out
