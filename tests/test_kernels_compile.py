"""Compile every forward kernel configuration a dispatch can choose, for sm_90a, on the CPU.

Needs tilelang and nvcc, no GPU (skips with the reason otherwise).  The configurations are
``kernels.build.forward_configs()`` (the intra kernel and its Tinv-keeping form; the register-operand state kernel
and its CP scan and fix-up; the shared-memory state kernel at every BV ``block_v`` picks, one and two CTAs per SM;
the output kernel for both table layouts; precision "default"; bf16 and fp16; the backward recompute's
``sl_swizzle`` state kernels; the fused warp-specialised state-output kernel; each head dim K = V in 128, 64).
Everything else (T, B, N, H, HV / GVA ratio, h0, final state, state layout, l2norm, gate dtype, varlen or dense) is
a runtime argument of the same binaries.

Asserts what the design relies on, from the generated CUDA and from ptxas:
* each kernel's calls launch its TVM-FFI executable directly (``kernels.build.direct_launch``);
* every matmul is a wgmma with input-dtype operands and fp32 accumulation, and there is no TF32 anywhere, with the
  number of products the precision implies (``_WANT_WGMMA``); the rv state kernel takes every A operand from
  registers (``wgmma_rs``), the output kernel its P;
* the sequential kernels' and the output kernel's chunk loads are TMA (``tma_load``) into a double-buffered,
  mbarrier-synchronised pipeline, and they store no chunk table with TMA;
* exponentials are exp2 (fast math);
* no register spills and no stack;
* the smem state kernel's fragment <-> shared accesses of its S, U, X and v tiles are free of bank conflicts, as
  worked out from the generated addresses (``kernels.common.bank_conflicts``), and so is the S lo tile's with
  ``sl_swizzle`` (without it the same model finds 2- to 8-way conflicts).

Compiles in 2 processes; prints each kernel's compile and ptxas time and the total.
"""


import os

import pytest

from kernels.build import compile_for_test, forward_configs
from kernels.common.bank_conflicts import worst_degrees
from tests.kernel_support import check_ptxas, check_wgmma, compile_in_processes, compile_skip_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compile_skip_reason() is not None, reason=compile_skip_reason() or "")]

CONFIGS = forward_configs()        # the first entries of kernels.build.all_configs()


def _compile_job(i):
    return compile_for_test(i, with_ptxas=True)


N_WORKERS = max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def compiled():
    return compile_in_processes(_compile_job, len(CONFIGS), "kernels compile", 55, N_WORKERS)


def _sp(prec, f):
    return int(getattr(prec, f) == "split")


# wgmma call sites per kernel: intra = K K^T + 2 merge levels x 2 products (x3 when split; none in fp32);
# state/scan = K S (+ K Sl) + Ag X (+ Al X) (+ Ag Xl) + update (+ lo); output = Q K^T + Q S (+ Q Sl)
# + P U (+ Pl U) (+ P Ul).
_WANT_WGMMA = {
    "IntraConfig": lambda c: 1 + {"fp32": 0, "bf16": 4, "split": 12}[c.merge] + c.pt,
    "StateConfig": lambda c: (1 + _sp(c.prec, "ks") + 1 + _sp(c.prec, "ag") + _sp(c.prec, "x")
                               + 1 + _sp(c.prec, "upd")),
    "OutputConfig": lambda c: 1 + 1 + _sp(c.prec, "s") + 1 + _sp(c.prec, "p") + _sp(c.prec, "u"),
}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_kernel_compiles_for_sm90a(compiled, cfg):
    r = compiled[cfg.name]
    src = r["source"]
    assert r["direct_launch"], f"{cfg.name}: its calls go through TileLang's Python wrapper (build.direct_launch)"
    if r["kind"] == "FixupConfig":                              # fp64 FMA, no tensor core; fp32 in and out
        assert "wgmma" not in src and "double" in src and "tf32" not in src.lower()
        check_ptxas(r["ptxas"])
        return
    want = _WANT_WGMMA[r["kind"]](cfg)
    if r["kind"] == "StateConfig" and cfg.form == "ws" and not cfg.tables:   # the output kernel's products as well
        want += _WANT_WGMMA["OutputConfig"](cfg) - cfg.pt       # (but Q K^T with the intra kernel's P tables)
    # the state kernels' operands in the precision's operand type (fp16 with fp16 operands), the intra kernel's in
    # the input dtype (K K^T, Q K^T and the merges take the inputs as they are)
    check_wgmma(src, cfg.prec.operand_dtype(cfg.dtype) if r["kind"] == "StateConfig" else cfg.dtype, want)
    if r["kind"] == "IntraConfig":
        assert "exp2f" in src
        # k (and q for the L2 norm, but with the split merges) by one TMA copy each, not per element
        assert src.count("tma_load(") == (1 if cfg.merge == "split" else 2) and "expect_transaction" in src
        # CTAs per SM the design relies on: 4 (53 KiB) with fp32 or bf16 merges, 3 with split ones' lo tiles
        ctas = 3 if cfg.merge == "split" else 4
        assert r["dyn_smem"] is not None and r["dyn_smem"] + 1024 <= 228 * 1024 // ctas, r["dyn_smem"]
        if cfg.pt:                  # P staged in swizzled tiles (no bank conflict) and stored by TMA copies: hi +
            #                         lo, or with fp16 operands of bf16 inputs P one term and the fp16 copies of q, k
            half = cfg.ag == "fp16"
            cv = half and cfg.dtype != "float16"
            tiles = ["ph_s"] + ([] if half else ["pl_s"]) + (["cv_s"] if cv else [])
            assert src.count("tma_store(") == len(tiles) + cv, src.count("tma_store(")
            w = worst_degrees(src, tiles)
            assert all(d <= 1 and n > 0 for d, n in w.values()), w
    elif r["kind"] == "StateConfig":
        # (the ws form's own barriers: a TMA transaction count on each stage's)
        assert "tma_load" in src and ("expect_transaction" in src if cfg.form == "ws" else "mbarrier" in src)
        assert "tma_store" not in src                           # per-chunk outputs: plain stores, no TMA store + wait
        if cfg.form == "rv":                                    # every A operand from registers
            assert src.count("wgmma_rs<") == want, src.count("wgmma_rs<")
        if cfg.form == "ws":        # four warpgroups: chain, P, output, TMA producer; every operand in shared memory
            assert "__launch_bounds__(512" in src and "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src
            assert "wgmma_rs<" not in src
            # with P tables, P lands by TMA (one load site each for hi and lo) and no thread writes its tiles; with
            # the chunk tables (the recompute's form) no q and no P
            loads = 5 + _sp(cfg.prec, "ag") + cfg.pt * (1 + _sp(cfg.prec, "p")) - cfg.tables
            assert src.count("tma_load(") == loads, src.count("tma_load(")
            p_tiles = not (cfg.pt or cfg.tables)
            tiles = ["sh_s", "uh_s", "xh_s", "v_s"] + (["ph_s"] if p_tiles else [])
            if not cfg.prec.half:   # (fp16 operands have no lo tiles; each lo tile where its operand is split)
                sp = {f: _sp(cfg.prec, f) for f in ("ks", "s", "u", "x", "upd")}
                lo = (("sl_s", sp["ks"] or sp["s"]), ("ul_s", sp["u"]), ("xl_s", sp["x"] or sp["upd"]))
                tiles += [t for t, on in lo if on] + (["pl_s"] if p_tiles else [])
            w = worst_degrees(src, tiles)
            assert all(d <= 1 for d, _ in w.values()) and all(n > 0 for _, n in w.values()), w
        if cfg.form == "smem":                                  # no bank conflicts (the model: module docstring)
            w = worst_degrees(src, ["sh_s", "uh_s", "ul_s", "xh_s", "xl_s", "v_s"])
            assert all(d <= 1 for d, _ in w.values()) and w["sh_s"][1] > 0 and w["uh_s"][1] > 0, w
            if cfg.lo8:                                         # the fp8 S lo tile: swizzled from BV 32
                d, n = worst_degrees(src, ["sl8_s"])["sl8_s"]
                assert n > 0 and d == 1, (d, n)
            elif cfg.prec.s == "split" and cfg.prec.ks != "split":  # S lo stored only: swizzled by sl_swizzle
                d, n = worst_degrees(src, ["sl_s"])["sl_s"]
                assert n > 0 and (d == 1 if cfg.sl_swizzle else d > 1), (d, n)
        if cfg.ctas_per_sm == 2:                                # two resident CTAs of 256 threads per SM
            assert "__launch_bounds__(256, 2)" in src and "warpgroup_reg_alloc" not in src
            assert r["ptxas"]["registers"] <= 65536 // (2 * 256), r["ptxas"]["registers"]
    elif r["kind"] == "OutputConfig":                          # P (+ Pl) from registers
        assert src.count("wgmma_rs<") == 1 + _sp(cfg.prec, "p") + _sp(cfg.prec, "u")
        assert "tma_load" in src and "mbarrier" in src and "warpgroup_reg_alloc" in src
    check_ptxas(r["ptxas"])
