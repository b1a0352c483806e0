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
KERNEL_HEAD_DIM = 128          # the kernels are built for K == V == 128; K == V == 64 is zero-padded to 128
BV_CHOICES = (64,)             # value columns per CTA of the recurrent kernel that the API dispatches
NUM_STAGES = 2                 # software pipelining depth of the recurrent kernel's chunk loads


@dataclass(frozen=True)
class IntraConfig:
    dtype: str
    DK: int = KERNEL_HEAD_DIM

    @property
    def name(self) -> str:
        return f"intra[DK={self.DK},{self.dtype}]"


@dataclass(frozen=True)
class RecurrentConfig:
    dtype: str
    BV: int = 64
    DK: int = KERNEL_HEAD_DIM
    num_stages: int = NUM_STAGES

    @property
    def name(self) -> str:
        return f"recurrent[DK=DV={self.DK},BV={self.BV},stages={self.num_stages},{self.dtype}]"


def block_v(n_seq: int, HV: int) -> int:
    """Value columns per CTA of the recurrent kernel (only 64 is dispatched today)."""
    return 64


def dispatch_configs(dtype: str, n_seq: int, HV: int, BV: int | None = None):
    """The two kernel configurations one API call uses."""
    return IntraConfig(dtype), RecurrentConfig(dtype, BV or block_v(n_seq, HV))


def all_configs():
    """Every configuration the API can dispatch (what the compile test builds).

    Everything else (T, B, N, H, HV, the GVA ratio, scale, h0 present or not,
    final state stored or not, the state layout (K == V, so both layouts have
    the same shape), l2norm on/off, gate dtype (cast to fp32 on the host),
    dense vs varlen (dense is run as varlen), head dim 64 (zero-padded to 128))
    is a runtime argument of the same binaries.
    """
    out = []
    for dtype in DTYPES:
        out.append(IntraConfig(dtype))
        for bv in BV_CHOICES:
            out.append(RecurrentConfig(dtype, bv))
    return out


def prim_func(cfg):
    if isinstance(cfg, IntraConfig):
        from .kkt_solve import build_intra_kernel
        return build_intra_kernel(cfg.DK, cfg.dtype)
    from .chunk_h import build_recurrent_kernel
    return build_recurrent_kernel(cfg.DK, cfg.DK, cfg.BV, cfg.dtype, cfg.num_stages)


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
