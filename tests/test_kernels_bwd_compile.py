"""Compile every backward kernel configuration of our TileLang GDN backward for sm_90a, on the CPU.

Needs tilelang and nvcc, no GPU (skips with the reason otherwise).  The configurations are
``kernels.gdn_bwd.build.all_configs()``: the 4 stages (prep, dh, dqk_inter, dqk_intra) x {bf16, fp16} at
K = V = 128.  Everything else (T, B, N, H, HV / GVA ratio, h0, dht present, state layout, l2norm, gate dtype,
varlen or dense, head dim 64 zero-padded, scale) is a runtime argument of the same binaries.  The forward
recompute runs the forward's dispatched intra2 / state kernels, compiled by ``test_kernels_compile.py``.

Asserts, from the generated CUDA and from ptxas (bf16 only: the fp16 binaries differ only in the operand
type, so ptxas is run once per stage to stay within ~2 min on 2 cores):
* every matmul is a wgmma with input-dtype operands and fp32 accumulation, the number of call sites the
  design implies (``_WANT_WGMMA``), no TF32;
* the reverse sequential kernel takes every A operand from registers (wgmma_rs) and loads its chunks with
  TMA into an mbarrier pipeline, with no TMA stores;
* exponentials are exp2 (fast math); no register spills and no stack.
"""

import importlib.util
import multiprocessing as mp
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernels.gdn_bwd.build import all_configs, compile_for_test


def _skip_reason():
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]

CONFIGS = all_configs()
N_WORKERS = max(1, min(2, os.cpu_count() or 1))

# wgmma call sites: prep = K K^T + 2 merge levels x 2 + Q K^T + dO^T (Ph, Pl); dh = dS K^T (2) + dU Tinv (3)
# + dO^T Q (2) + dX^T K (2); inter = dO S^T (2) + dY S^T (3) + U dS'^T (3); intra = Q K^T + K K^T + dO U^T (2)
# + dY U^T (3) + dq (2) + dk (6)
_WANT_WGMMA = {"prep": 1 + 4 + 1 + 2, "dh": 2 + 3 + 2 + 2, "inter": 2 + 3 + 3, "intra": 1 + 1 + 2 + 3 + 2 + 6}


def _job(i):
    return compile_for_test(i, with_ptxas=CONFIGS[i].dtype == "bfloat16")


@pytest.fixture(scope="module")
def compiled():
    t = time.time()
    with ProcessPoolExecutor(N_WORKERS, mp_context=mp.get_context("spawn")) as ex:
        results = list(ex.map(_job, range(len(CONFIGS))))
    print(f"\n[bwd kernels compile] {len(results)} configurations in {time.time() - t:.1f} s wall "
          f"({N_WORKERS} processes)")
    for r in results:
        p = r.get("ptxas", {})
        print(f"  {r['name']:<40} tilelang {r['seconds']:6.1f} s   ptxas {r.get('ptxas_seconds', 0):5.1f} s   "
              f"regs {p.get('registers')}  spill {p.get('spill_stores')}/{p.get('spill_loads')}  "
              f"stack {p.get('stack')}")
    return {r["name"]: r for r in results}


def _wgmma_instances(src):
    return re.findall(r"wgmma_(?:ss|rs)<tl::DataType::(\w+), tl::DataType::(\w+), tl::DataType::(\w+),", src)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_bwd_kernel_compiles_for_sm90a(compiled, cfg):
    r = compiled[cfg.name]
    src = r["source"]
    operand = {"bfloat16": "kBFloat16", "float16": "kFloat16"}[cfg.dtype]
    inst = _wgmma_instances(src)
    want = _WANT_WGMMA[cfg.kind]
    assert len(inst) == want, f"expected {want} wgmma call sites, found {len(inst)}"
    for a, b, c in inst:
        assert (a, b, c) == (operand, operand, "kFloat32"), (a, b, c)
    assert "TensorFloat32" not in src and "tf32" not in src.lower()
    assert "exp2f" in src or cfg.kind == "dh"
    if cfg.kind == "dh":
        assert src.count("wgmma_rs<") == want, src.count("wgmma_rs<")
        assert "tma_load" in src and "mbarrier" in src and "tma_store" not in src
    if "ptxas" in r:
        p = r["ptxas"]
        assert p["returncode"] == 0, p["log"]
        assert p.get("spill_stores") == 0 and p.get("spill_loads") == 0, p["log"]
        assert p.get("stack") == 0, p["log"]
