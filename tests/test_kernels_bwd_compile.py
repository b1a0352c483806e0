"""Compile every backward kernel configuration a dispatch can choose, for sm_90a, on the CPU.

Needs tilelang and nvcc, no GPU (skips with the reason otherwise).  The configurations are
``kernels.backward.configs.all_configs()`` (every stage x {bf16, fp16} at each head dim K = V in 128, 64, dh in
both operand forms, prep on the forward's saved tables; the dtype-free dgdb once per head dim).  Everything else
(T, B, N, H, HV / GVA ratio, h0, dht present, state layout, l2norm, gate dtype, varlen or dense, scale) is a
runtime argument of the same binaries.  The forward recompute runs the forward's kernels, compiled by
``test_kernels_compile.py``.

Asserts, from the generated CUDA and from ptxas (bf16 only: the fp16 binaries differ only in the operand type; the
fused kernel, fp16 alone):
* every matmul is a wgmma with input-dtype operands and fp32 accumulation, the number of call sites the
  design implies (``_WANT_WGMMA``), no TF32;
* the reverse sequential kernel takes every A operand from registers (wgmma_rs; its warp-specialised form
  ``dh_ws`` every operand from shared memory) and loads its chunks with TMA into an mbarrier pipeline; its split
  tables leave through four TMA store sites;
* exponentials are exp2 (fast math); no register spills and no stack (the fused kernel: a few hundred bytes, and
  wgmma kept asynchronous);
* shared-memory bank conflicts, as worked out from the generated addresses (``kernels.common.bank_conflicts``):
  dh's swizzled dUloc^T and dO tiles at most 2-way and none, ``dh_ws`` conflict-free in every tile; the dqk kernels conflict-free in every tile (at
  DK 64 with fp8 lo tables but for the 2-way 16-byte accesses that widen the lo codes);
* the dqk kernels' TMA loads in flight together land in disjoint tiles (TileLang's allocator places buffers by
  their reads; a TMA load is not one), and the late ones (dY, v) only over the dead dS' tiles.
"""

import os
import re

import pytest

from kernels.common.bank_conflicts import buffer_degrees, shared_buffers, threads_of, worst_degrees
from kernels.backward.configs import CLUSTER_GROUPS, FUSED_KIND, all_configs
from kernels.build import compile_for_test, forward_configs
from tests.kernel_support import check_ptxas, check_wgmma, compile_in_processes, compile_skip_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compile_skip_reason() is not None, reason=compile_skip_reason() or "")]

CONFIGS = all_configs()
OFFSET = len(forward_configs())     # the backward's entries of kernels.build.all_configs() follow the forward's
N_WORKERS = max(1, min(2, os.cpu_count() or 1))

# wgmma call sites: prep = K K^T + 2 merge levels x 2 + Q K^T + dO^T (Ph, Pl); dh = dS K^T (2) + dU Tinv (3)
# + dO^T Q (2) + dX^T K (2); dqk = the state products dO S^T (2) + dY S^T (3) + U dS'^T (3), then the intra terms
# Q K^T + K K^T + dO U^T (2) + dY U^T (3) + dq (1) + dk (3) with single 64x64 operands
_WANT_WGMMA = {"prep": 1 + 4 + 1 + 2, "dh": 2 + 3 + 2 + 2, "dqk": (2 + 3 + 3) + (1 + 1 + 2 + 3 + 1 + 3),
               "gsum": 0, "gsum32": 0, "dgdb": 0, "cvt": 0, "amax": 0}
_WANT_WGMMA.update({f"dqk_g{g}": _WANT_WGMMA["dqk"] for g in CLUSTER_GROUPS})
_WANT_WGMMA["dh_single"] = 2 + 1 + 2 + 1          # dS' and F1 dO keep their lo products; Tinv, dU, F0 dX single
_WANT_WGMMA["dh_tinv_hi"] = 2 + 2 + 2 + 2        # every operand split, Tinv's hi term alone (no dU Tl)
_WANT_WGMMA["prep_saved"] = 1 + 2                  # on the forward's Tinv and Ag: Q K^T and dO^T (Ph, Pl) alone
_WANT_WGMMA["prep_bounds"] = 1 + 2 + 1             # the same, and K K^T for the chunk bounds
_WANT_WGMMA["dh_one"] = 1 + 1 + 1 + 1              # every operand one term: dS K^T, dU Tinv, dO^T Q, dX^T K
_WANT_WGMMA["dqk_one"] = (1 + 1 + 1) + (1 + 1 + 1 + 1 + 1 + 3)   # every table one term (S, U, dS', dY hi alone)
# the fused kernel, a site per product (the halves' loops one site each): the chain Q K^T, K dS', P^T dO, Th^T dU,
# Q^T D1, K^T D2; the dq side dO S^T, dO U^T, M0 K, Q K^T, K K^T, dY U^T and the dg rectangle's U m (three bf16
# terms of m: ``FUSED_BF16_SITES``); the dk side the dY.v dots' dY V^T (in the loop, and after it for the last chunk
# run), the S o dS' dots' S^T dS', U dS'^T, dY S^T, M1^T Q, M2 K, M3^T K
_WANT_WGMMA["fused"] = 6 + 6 + (2 + 6)
FUSED_BF16_SITES = 3
# its chain form (the exact segmented pass's pass A): the chain's six products alone
_WANT_WGMMA["fused_chain"] = 6
# loosened for the fused kernel: at its registers (184, 168, 136, 24) each warpgroup spills scalars of 4 or 8 bytes
# (180 B in all in the one-pass form: stored before the chunk loop, each reloaded a few times a chunk); its speed
# needs wgmma kept asynchronous (ptxas C7512 serialises every wgmma of a kernel whose fragments outgrow its registers)
FUSED_MAX_SPILL_BYTES = 384


_OFFSET = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")
_TMA_TILE = re.compile(r"tl::tma_load\((\w+)_desc, ld\[(\d)\], \(&\(\(\(\w+\*\)(\w+)\)")
_TMA_BULK = re.compile(r"tl::tma_load\(\(&\(\(\(\w+\*\)(\w+)\)\[0\]\)\), \(&\((\w+)\[[^;]*ld\[(\d)\]")


def _widened_tile(src, table):
    """The shared tile that ``widen_lo8`` writes from the fp8 codes of ``table`` (None when not widened)."""
    i = src.find(f"({table} + ")
    if i < 0:
        return None
    m = re.search(r"\*\(uint4\*\)\(\(\(\w+\*\)(\w+)\) \+ [^;]*\) = \*\(uint4\*\)\(xl \+ 0\)", src[i:])
    return m.group(1)


def dqk_tile_overlaps(cfg, src) -> list:
    """Pairs of dqk tiles that are live together and share shared memory: the tiles of the loads issued at the start
    (barriers 0, 1, 2, 4) with the widened lo tiles among themselves; the late loads (barrier 3) among themselves
    and with every early tile but dS' hi and lo (dead by then)."""
    off = {v: int(o) for v, o in _OFFSET.findall(src)}
    size = {"q": 64 * cfg.DK, "k": 64 * cfg.DK, "do": 64 * cfg.DK, "v": 64 * cfg.DK, "Uh": 64 * cfg.DK,
            "Ul": 64 * cfg.DK, "dYh": 64 * cfg.DK, "dYl": 64 * cfg.DK, "Sch": cfg.DK * cfg.DK,
            "Scl": cfg.DK * cfg.DK, "dSh": cfg.DK * cfg.DK, "dSl": cfg.DK * cfg.DK}
    tiles = {}                                              # tensor -> (buffer, barrier)
    for t, b, buf in _TMA_TILE.findall(src):
        tiles[t] = (buf, int(b))
    for buf, t, b in _TMA_BULK.findall(src):
        tiles[t] = (buf, int(b))
    want = {"q", "k", "Fb", "Sch", "dSh", "Uh", "do", "dYh", "v"} | (set() if cfg.one else {"Ul", "dYl"})
    assert set(tiles) >= want, sorted(tiles)
    rng = {t: (off[buf], off[buf] + (8 * 64 * 4 if t == "Fb" else 2 * size[t])) for t, (buf, _) in tiles.items()}
    for t in ("Scl", "dSl"):
        w = _widened_tile(src, t) if cfg.lo8 else None
        if w is not None:
            rng[t] = (off[w], off[w] + 2 * size[t])
    early = [t for t in rng if t not in tiles or tiles[t][1] != 3]
    late = [t for t in rng if t in tiles and tiles[t][1] == 3]

    def meet(a, b):
        return rng[a][0] < rng[b][1] and rng[b][0] < rng[a][1]
    bad = [(a, b) for i, a in enumerate(early) for b in early[i + 1:] if meet(a, b)]
    bad += [(a, b) for i, a in enumerate(late) for b in late[i + 1:] + [e for e in early if e not in ("dSh", "dSl")]
            if meet(a, b)]
    return bad


def _job(i):
    # float32: dtype-free; the fused kernel is built for fp16 operands alone
    return compile_for_test(OFFSET + i, with_ptxas=CONFIGS[i].dtype in ("bfloat16", "float32")
                            or CONFIGS[i].kind == FUSED_KIND)


@pytest.fixture(scope="module")
def compiled():
    return compile_in_processes(_job, len(CONFIGS), "bwd kernels compile", 40, N_WORKERS)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_bwd_kernel_compiles_for_sm90a(compiled, cfg):
    r = compiled[cfg.name]
    src = r["source"]
    assert r["direct_launch"], f"{cfg.name}: its calls go through TileLang's Python wrapper (build.direct_launch)"
    if cfg.kind == FUSED_KIND:
        kind = "fused_chain" if cfg.chain else FUSED_KIND
    elif cfg.one:
        kind = "dh_one" if cfg.kind == "dh" else "dqk_one"
    else:
        kind = ("dh_single" if cfg.single else "dh_tinv_hi" if cfg.tinv_hi else "prep_bounds" if cfg.bounds
                else "prep_saved" if cfg.saved else cfg.kind)
    want = _WANT_WGMMA[kind] - (2 if cfg.s_single and not cfg.one else 0)     # S hi alone: no dO Sl^T, dY Sl^T
    want += {"split": 8, "fp32": -4}.get(cfg.merge, 0)         # merges: 3 products a merge product, or none
    want -= 3 if cfg.no_du else 0                             # prep without dUloc^T: no Q K^T, no dO^T (Ph, Pl)
    others = {"bfloat16": FUSED_BF16_SITES} if kind == FUSED_KIND else None
    # dtype-free kinds: no wgmma; prep's converting form: K K^T on the caller's (io) tiles
    wg_dtype = cfg.io if cfg.kind == "prep" and cfg.io else "bfloat16" if cfg.dtype == "float32" else cfg.dtype
    check_wgmma(src, wg_dtype, want, others)
    assert "exp2f" in src or cfg.kind in ("dh", "gsum", "gsum32", "cvt", "amax")
    if cfg.kind == "dh":
        # the register kernel: every A operand from registers; the warp-specialised one: every operand in shared
        # memory (the state gradient key-first, the rows of its products DK, 64)
        assert src.count("wgmma_rs<") == (0 if cfg.ws_bv else want), src.count("wgmma_rs<")
        # loads through the TMA pipeline; the split dS' and dY tables leave through shared tiles (stmatrix in the
        # register kernel) and TMA stores, four store sites (dSh, dSl, dYh, dYl; two, the hi ones, with ``one``); one
        # CTA per SM must fit
        assert "tma_load" in src and ("full[" in src if cfg.ws_bv else "mbarrier" in src)
        stores = 2 if cfg.one else 4
        assert src.count("tma_store(") == stores and (cfg.ws_bv or "stmatrix" in src), src.count("tma_store(")
        # the register kernel waits for each chunk's table stores at the next chunk's, and at the end; the
        # warp-specialised one for the dS' and the dY stores before their tiles are handed back
        assert src.count("tma_store_wait") == 2, src.count("tma_store_wait")
        assert r["dyn_smem"] is not None and r["dyn_smem"] + 1024 <= 228 * 1024, r["dyn_smem"]
    if cfg.kind == "dh":
        # every shared tile at an offset of its own: TileLang's allocator merges buffers by their reads, so a tile
        # TMA-loaded but never read could share another tile's memory (and overwrite it in flight)
        offs = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)
        assert len(offs) >= (7 if cfg.one else 9) and len({o for _, o in offs}) == len(offs), offs
    if cfg.kind == "dh" and not cfg.ws_bv:          # swizzled (4-way each without)
        w = worst_degrees(src, ["dul_s", "do_s"])
        assert w["dul_s"][0] <= 2 and w["do_s"][0] <= 1 and w["dul_s"][1] > 0 and w["do_s"][1] > 0, w
    if cfg.kind == "dh" and cfg.ws_bv:
        # conflict-free, the value-first tiles written from key-first accumulators and dUloc^T read into one among
        # them (128-byte swizzles; 4-way each without)
        w = worst_degrees(src)
        tiles = ("dsh_s", "yh_s", "dul_s") + (() if cfg.one else ("dsl_s", "yl_s"))
        assert all(w[b][1] > 0 for b in tiles), w
        assert max(d for d, _ in w.values()) == 1, (cfg.name, w)
    if cfg.kind.startswith("dqk") and cfg.DK == 128:    # conflict-free tiles (laid out without them: 8-way)
        w = max(d for d, _ in worst_degrees(src).values())
        assert w == 1, (cfg.name, worst_degrees(src))
    if cfg.kind.startswith("dqk") and cfg.DK == 64:
        # loosened at DK 64 with fp8 lo tables: TileLang lays the [64, 64] key-dim operand tiles (q, k, dS' hi + lo),
        # whose columns the two warpgroups split as wgmma B operands, out in 64-byte swizzles, so the 16-byte
        # accesses of ``widen_lo8`` to the dS' and S hi and lo tiles (twice a chunk) are 2-way; the tiles arrive by
        # TMA, and every other access is conflict-free
        bad = [(b, s.line, s.width, s.store, d) for b in shared_buffers(src) for s, d in buffer_degrees(src, b)
               if d is not None and d > 1]
        assert bool(bad) == cfg.lo8 and all(d == 2 and width == 16 for _, _, width, _, d in bad), (cfg.name, bad)
    # CTAs per SM the design relies on (shared memory, and registers of 128-thread CTAs): prep loads in phases
    # (60 KiB; 111 in one phase)
    ctas = {"prep": 2 if cfg.merge == "split" else 3}.get(cfg.kind)      # the split merges' lo tiles: 24 KiB more
    if ctas:
        assert r["dyn_smem"] is not None and r["dyn_smem"] + 1024 <= 228 * 1024 // ctas, r["dyn_smem"]
    if cfg.kind.startswith("dqk"):   # one CTA of 256 threads per SM (shared memory and registers), at either DK
        assert threads_of(src) == 256, threads_of(src)
        assert r["dyn_smem"] is not None and r["dyn_smem"] + 1024 <= 228 * 1024, r["dyn_smem"]
        if "ptxas" in r:
            assert -(-r["ptxas"]["registers"] // 8) * 8 * 256 <= 65536, r["ptxas"]["registers"]
        assert "AtomicAdd" not in src      # dq~, dk~ stored once per value head (the group sums: gsum) or group
    if cfg.kind.startswith("dqk"):
        assert src.count("tma_load(") >= (9 if cfg.one else 11), src.count("tma_load(")
        assert not dqk_tile_overlaps(cfg, src), dqk_tile_overlaps(cfg, src)
    if cfg.kind.startswith("dqk_g"):      # a group's sums through distributed shared memory: one SM-to-SM bulk copy
        # site, a barrier each CTA waits on, cluster barriers around the exchange (after the barrier's init too)
        assert src.count("tma_store_cluster(") == 1 and "bar[0].wait(0)" in src, src.count("tma_store_cluster(")
        assert src.count("tl::cluster_sync()") == 3, src.count("tl::cluster_sync()")
    if cfg.kind == FUSED_KIND:         # one CTA of four warpgroups per SM
        assert threads_of(src) == 512, threads_of(src)
        assert r["dyn_smem"] is not None and r["dyn_smem"] + 1024 <= 228 * 1024, r["dyn_smem"]
    if "ptxas" in r and cfg.kind == FUSED_KIND:
        p = r["ptxas"]
        assert p["returncode"] == 0 and "C7512" not in p["log"], p["log"][-2000:]
        assert p["spill_stores"] <= FUSED_MAX_SPILL_BYTES and p["spill_loads"] <= 2 * FUSED_MAX_SPILL_BYTES, p
    elif "ptxas" in r:
        check_ptxas(r["ptxas"])
        if ctas:
            regs = -(-r["ptxas"]["registers"] // 8) * 8        # allocated per thread in steps of 8
            assert regs * 128 * ctas <= 65536, r["ptxas"]["registers"]
