"""Compile every kernel configuration our GDN forward API can dispatch, for sm_90a, on the CPU.

Needs tilelang and nvcc, no GPU (skips with the reason otherwise).  The set of
configurations is ``kernels.gdn_fwd.build.all_configs()`` (intra-chunk kernel,
state kernel at BV 64/32/16, output kernel; bf16 and fp16) plus ``extra_configs()``
(benchmark-only: the old fused kernel and the "fast" precision, bf16).  Everything
else (T, B, N, H, HV / GVA ratio, h0, final state, state layout, l2norm, gate dtype,
varlen or dense, head dim 64 (zero-padded)) is a runtime argument of the same
binaries.

Asserts what the design relies on, from the generated CUDA and from ptxas:
* every matmul is a wgmma with input-dtype operands and fp32 accumulation, and
  there is no TF32 anywhere: 14 in the intra kernel (KK^T, QK^T, 2 merge levels
  x 2 products x 3 split terms), 12 in the recurrent one (K@S 2, X 3, Q@S 2,
  P@U 3, state update 2);
* the recurrent kernel's chunk loads are TMA (``tma_load``) into a
  double-buffered, mbarrier-synchronised pipeline (TileLang's warp-specialised
  ``T.Pipelined``);
* exponentials are exp2 (fast math);
* no register spills and no stack (the solve's columns and the fp32 state
  block stay in registers).

Compiles in 2 processes; prints each kernel's compile and ptxas time and the total
(~2 min cold on 2 cores for the 14 kernels).
"""


import importlib.util
import multiprocessing as mp
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernels.gdn_fwd.build import all_configs, compile_for_test, extra_configs


def _skip_reason():
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]

# the dispatchable configurations, then the benchmark-only ones (private API knobs)
CONFIGS = all_configs() + extra_configs()
_JOBS = [(i, True, False) for i in range(len(all_configs()))] + [(i, True, True) for i in range(len(extra_configs()))]


def _compile_job(job):
    return compile_for_test(*job)

N_WORKERS = max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def compiled():
    t = time.time()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(N_WORKERS, mp_context=ctx) as ex:
        results = list(ex.map(_compile_job, _JOBS))
    total = time.time() - t
    print(f"\n[kernels compile] {len(results)} configurations in {total:.1f} s wall ({N_WORKERS} processes)")
    for r in results:
        p = r.get("ptxas", {})
        print(f"  {r['name']:<55} tilelang {r['seconds']:6.1f} s   ptxas {r.get('ptxas_seconds', 0):5.1f} s   "
              f"regs {p.get('registers')}  spill {p.get('spill_stores')}/{p.get('spill_loads')}  "
              f"stack {p.get('stack')}")
    return {r["name"]: r for r in results}


# wgmma call sites per kernel: intra 14 (KK^T, QK^T, 2 merge levels x 2 products x 3 split terms);
# fused recurrent 12 (K@S 2, X 3, Q@S 2, P@U 3, state update 2); state kernel "high" 7 (K@S 2,
# Ag@X 3, update 2) / "fast" 4 (K@S 1, Ag@X 1, update 2); output 5 (Q@S 2, P@U 3) / 4 (S hi only).
_WANT_WGMMA = {
    "IntraConfig": lambda c: 14,
    "RecurrentConfig": lambda c: 12,
    "StateConfig": lambda c: 7 if c.precision == "high" else 4,
    "OutputConfig": lambda c: 5 if c.split_s else 4,
}


def _wgmma_instances(src):
    return re.findall(r"wgmma_(?:ss|rs)<tl::DataType::(\w+), tl::DataType::(\w+), tl::DataType::(\w+),", src)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_kernel_compiles_for_sm90a(compiled, cfg):
    r = compiled[cfg.name]
    src = r["source"]
    operand = {"bfloat16": "kBFloat16", "float16": "kFloat16"}[cfg.dtype]
    inst = _wgmma_instances(src)
    want = _WANT_WGMMA[r["kind"]](cfg)
    assert len(inst) == want, f"expected {want} wgmma call sites, found {len(inst)}"
    for a, b, c in inst:
        assert (a, b, c) == (operand, operand, "kFloat32"), (a, b, c)
    assert "TensorFloat32" not in src and "tf32" not in src.lower()
    if r["kind"] == "IntraConfig":
        assert "exp2f" in src
    elif r["kind"] in ("RecurrentConfig", "StateConfig"):
        assert "tma_load" in src and "mbarrier" in src
        if r["kind"] == "StateConfig":   # per-chunk outputs are plain stores, no TMA store + wait
            assert "tma_store" not in src
    p = r["ptxas"]
    assert p["returncode"] == 0, p["log"]
    assert p.get("spill_stores") == 0 and p.get("spill_loads") == 0, p["log"]
    assert p.get("stack") == 0, p["log"]
