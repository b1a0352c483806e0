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
DEFAULT_PATH = "split2"        # the only forward path: intra2 / state kernel [+ CP scan] / output2
REMOVED_PATHS = ("split", "fused")  # the older paths, removed after the H200 comparison (last in commit 830262b)
DEFAULT_PRECISION_V2 = "default"   # preset name in variants.PRECISIONS_V2
OUT2_BV = 64                   # value columns per CTA of the v2 output kernel, one chunk per CTA ("chunk")
OUT_CPB = 8                    # chunks per CTA of the pipelined output kernel ("pipe"; the API's _cpb: OUT_CPBS)
OUT_CPBS = (8, 16)              # 4 was no faster (benchmarks/results/2026-11-30-h200-bench_kernels_fwd-cpb-s5.txt)
OUTPUT_FORMS = ("chunk", "pipe")
INTRA_FORMS = ("v2", "ax")      # "ax": Intra2Config.alias_x (4 CTAs per SM instead of 3)
# "ax" measured faster on an H200 (benchmarks/results/2026-11-30-h200-bench_kernels_fwd-ax-s5.txt, forward ms, v2 ->
# ax: B1 T32768 HV32 2.114 -> 2.005, B8 T4096 HV32 2.041 -> 1.938, B1 T8192 HV8 0.263 -> 0.255, varlen 8 2.047 ->
# 1.946), o within 1.004x of the bf16 floor (reports/2026-11-30-pytest-h200-s5/kernels-ax-lean_sd-3837239.txt)
DEFAULT_INTRA = "ax"
# output kernel form unless the API's _out or GDN_TILELANG_OUTPUT says otherwise.  "pipe" measured faster on every
# benchmark shape on an H200 (benchmarks/results/2026-11-30-h200-bench_kernels_fwd-pipe.txt; forward ms, chunk ->
# pipe: B1 T32768 HV32 2.995 -> 2.114, B8 T4096 HV32 2.916 -> 2.038, B1 T8192 HV8 0.316 -> 0.263, B1 T65536 HV4
# 1.222 -> 0.990, varlen 8 HV32 3.261 -> 2.337), same o and state errors
DEFAULT_OUTPUT = "pipe"
SCAN_BV = 32                   # value columns per CTA of the CP phase-1 scan (over 2 x 128 columns)
NUM_STAGES = 2                 # software pipelining depth of the sequential kernels' chunk loads


@dataclass(frozen=True)
class Intra2Config:
    dtype: str
    merge: str = "bf16"
    ag: str = "bf16"
    DK: int = KERNEL_HEAD_DIM
    alias_x: bool = False          # the merges' product over the A_o tile: 49 instead of 57 KiB of shared memory
    th: bool = False               # also store Tinv (input dtype) for the backward (the autograd Function's forward)

    @property
    def name(self) -> str:
        ax = ",ax" if self.alias_x else ""
        th = ",th" if self.th else ""
        return f"intra2[DK={self.DK},merge={self.merge},ag={self.ag}{ax}{th},{self.dtype}]"


@dataclass(frozen=True)
class State2Config:
    dtype: str
    BV: int
    prec: object                   # variants.PrecisionV2 (frozen, hashable)
    scan: bool = False
    form: str = "rv"               # "rv": state3.py (register operands, value-first tables, BV 64/128)
                                   # "smem": state2.py (shared-memory operands, key-first tables)
    DK: int = KERNEL_HEAD_DIM
    num_stages: int = NUM_STAGES
    ctas_per_sm: int = 1           # "smem" only: 2 = two resident CTAs per SM (BV <= 32; state2.py)
    sl_swizzle: bool = False       # "smem" only: the S lo staging tile swizzled (state2.py, a candidate)

    @property
    def name(self) -> str:
        kind = ("scan" if self.scan else "state") + ("_rv" if self.form == "rv" else "_smem")
        occ = f",occ{self.ctas_per_sm}" if self.ctas_per_sm != 1 else ""
        slz = ",slz" if self.sl_swizzle else ""
        return (f"{kind}[DK=DV={self.DK},BV={self.BV},{self.prec.tag()},stages={self.num_stages}{occ}{slz},"
                f"{self.dtype}]")


@dataclass(frozen=True)
class Output2Config:
    dtype: str
    prec: object
    BV: int = OUT2_BV
    vt: bool = True                # value-first chunk tables (from the "rv" state kernel)
    DK: int = KERNEL_HEAD_DIM
    cpb: int = 0                   # 0: one chunk per CTA; > 0: that many chunks per CTA, pipelined TMA loads

    @property
    def name(self) -> str:
        pipe = f",cpb={self.cpb}" if self.cpb else ""
        return f"output2[DK=DV={self.DK},BV={self.BV},{self.prec.tag()},{'vt' if self.vt else 'kt'}{pipe},{self.dtype}]"


def output_form(out: str | None = None) -> str:
    """The output kernel form: ``out`` if given, else the environment's ``GDN_TILELANG_OUTPUT`` (a developer
    override, e.g. to run the harness on the other form), else ``DEFAULT_OUTPUT``."""
    import os

    form = out or os.environ.get("GDN_TILELANG_OUTPUT") or DEFAULT_OUTPUT
    if form not in OUTPUT_FORMS:
        raise ValueError(f"unknown output kernel form {form!r}; forms: {OUTPUT_FORMS}")
    return form


def out_cpb(cpb: int | None = None) -> int:
    """Chunks per CTA of the "pipe" output kernel: ``cpb`` if given (one of ``OUT_CPBS``; others raise), else
    ``OUT_CPB``.  It changes only the schedule: o is bitwise the same."""
    cpb = OUT_CPB if cpb is None else cpb
    if cpb not in OUT_CPBS:
        raise ValueError(f"unknown output kernel chunks per CTA _cpb={cpb!r}; one of {OUT_CPBS}")
    return cpb


def output_config(dtype: str, prec, vt: bool, out: str | None = None, cpb: int | None = None) -> "Output2Config":
    """"chunk": ``output2`` with one chunk per CTA and ``OUT2_BV`` value columns.  "pipe": ``out_cpb(cpb)`` chunks
    per CTA in a pipelined loop, all 128 value columns (q and k read once per chunk and head), or 64 when the
    chunk-start state is split (``prec.s``: two 32 KB state tiles per stage would not fit twice in shared
    memory)."""
    if output_form(out) == "chunk":
        return Output2Config(dtype, prec, vt=vt)
    bv = 64 if prec.s == "split" else KERNEL_HEAD_DIM
    return Output2Config(dtype, prec, BV=bv, vt=vt, cpb=out_cpb(cpb))


# ~SMs of an H200 (132); the sequential state kernel wants about one CTA per SM.
N_SM = 128


def block_v(n_seq: int, HV: int, occ: int = 1) -> int:
    """Value columns per CTA of the sequential "smem" state kernel: the widest block that still gives
    about ``occ`` CTAs per SM (N x HV x 128/BV CTAs), 16 at the least; with occ 2, 32 at the most
    (shared memory)."""
    for bv in ((64, 32) if occ == 1 else (32,)):
        if n_seq * HV * (KERNEL_HEAD_DIM // bv) >= N_SM * occ:
            return bv
    return 16


STATE_OCCS = (1, 2)            # CTAs per SM of the "smem" state kernel (the API's _occ)


def state_occ(occ: int | None = None, n_seq: int = 1, HV: int = 1) -> int:
    """CTAs per SM of the "smem" state kernel: ``occ`` if given (1 or 2; others raise), else 2 when BV 32 gives
    two CTAs per SM (N x HV x 4 >= 2 N_SM), else 1.  Measured on an H200
    (benchmarks/results/2026-11-30-h200-bench_kernels_fwd-occ-s5.txt, forward ms, intra "ax"): two CTAs of BV 32
    beat one of BV 64 at B8 T4096 HV32 (1.830 vs 1.924) and on the varlen pack of 8 (1.841 vs 1.932); at B1
    T32768 HV32 two CTAs of BV 16 lost to one of BV 32 (2.115 vs 1.997: BV 16 doubles the k / Ag reads)."""
    if occ is None:
        return 2 if block_v(n_seq, HV, occ=2) == 32 else 1
    if occ not in STATE_OCCS:
        raise ValueError(f"unknown state kernel occupancy _occ={occ!r}; CTAs per SM: {STATE_OCCS}")
    return occ


CP_MIN_CHUNKS = 16             # chunks per CP segment at the least
DEFAULT_FORM = "rv"            # state kernel form whenever CP runs (see State2Config); form_for picks per call
RV_BV = 64                     # value columns per warpgroup of the "rv" state kernel (wgmma M)
# form_for: measured on an H200 (benchmarks/results/2026-11-30-h200-bench_kernels_fwd-v2.txt), the
# shared-memory-operand state kernel ("smem", BV by block_v) beat the register-operand one ("rv") on
# every shape without CP (B1 T32768 HV32 2.98 vs 4.14 ms, B8 T4096 HV32 2.91 vs 3.21, B1 T8192 HV8 0.32
# vs 0.69), and "rv" + CP won only with very few CTAs over very many chunks (B1 T65536 HV4: 1.22 vs
# 1.86 ms; at B1 T8192 HV8 CP cost 1.18 vs 0.69 ms).
CP_MAX_CTAS = 8                # "rv" CTAs (N x HV x 128/64) at most for CP
CP_MIN_TOTAL_CHUNKS = 512      # chunks of the longest sequence at the least for CP


def cp_segments_for(n_seq: int, HV: int, max_chunks: int, form: str = DEFAULT_FORM) -> int:
    """Segments per sequence of the segment-parallel (CP) state passing, 1 = off.

    CP costs a phase-1 scan over twice the value columns (state from zero + the transition product),
    a short fix-up (P small fp64 matmuls) and buys P-fold parallelism of the sequential pass; it pays
    when N x HV leaves most SMs idle and the sequences are long (>= CP_MIN_CHUNKS chunks per segment).
    Phase 3 then has about N_SM CTAs."""
    ctas = n_seq * HV * (KERNEL_HEAD_DIM // RV_BV)
    if form != "rv" or ctas >= 48 or max_chunks < 2 * CP_MIN_CHUNKS:
        return 1
    per = -(-N_SM // ctas)
    return max(1, min(16, per, max_chunks // CP_MIN_CHUNKS))


def plan_v2(n_seq: int, HV: int, max_chunks: int, form: str | None = None, cp: int | None = None):
    """(form, cp) of one v2 call: the API's private ``_form`` / ``_cp`` when given (a forced cp > 1
    implies "rv", the only form with a CP scan), else "rv" with CP for at most CP_MAX_CTAS CTAs over at
    least CP_MIN_TOTAL_CHUNKS chunks and the "smem" form without CP otherwise (measurements above)."""
    if form is None:
        if cp is not None:
            form = "rv" if cp > 1 else "smem"
        else:
            few = n_seq * HV * (KERNEL_HEAD_DIM // RV_BV) <= CP_MAX_CTAS and max_chunks >= CP_MIN_TOTAL_CHUNKS
            form = "rv" if few else "smem"
    if form not in ("rv", "smem"):
        raise ValueError(f"unknown state kernel form {form!r}")
    if cp is None:
        cp = cp_segments_for(n_seq, HV, max_chunks, form)
    return form, (cp if form == "rv" else 1)


def check_path(path: str | None) -> str:
    """The API's private ``_path`` knob: None or "split2" (the only path left); anything else raises."""
    if path is None or path == DEFAULT_PATH:
        return DEFAULT_PATH
    if path in REMOVED_PATHS:
        raise ValueError(f"_path={path!r} was removed (only {DEFAULT_PATH!r} is left; the old paths are in "
                         f"commit 830262b)")
    raise ValueError(f"unknown path {path!r}; the only path is {DEFAULT_PATH!r}")


def precision_v2(precision, has_h0: bool = False):
    """The PrecisionV2 of a preset name / "sp[f1+f2]" / PrecisionV2; None = "default", or
    "default_h0" when an initial state is given."""
    from .variants import PRECISIONS_V2, PrecisionV2
    if precision is None:
        return PRECISIONS_V2["default_h0" if has_h0 else DEFAULT_PRECISION_V2]
    if isinstance(precision, PrecisionV2):
        return precision
    if precision in PRECISIONS_V2:
        return PRECISIONS_V2[precision]
    if isinstance(precision, str) and precision.startswith("sp[") and precision.endswith("]"):
        return PrecisionV2(**{f: "split" for f in precision[3:-1].split("+") if f})
    raise ValueError(f"unknown v2 precision {precision!r}; presets: {sorted(PRECISIONS_V2)} or 'sp[f1+f2]'")


def intra_form(intra: str | None = None) -> str:
    """The intra kernel form: ``intra`` if given, else ``DEFAULT_INTRA``; an unknown form raises."""
    intra = intra or DEFAULT_INTRA
    if intra not in INTRA_FORMS:
        raise ValueError(f"unknown intra kernel form {intra!r}; forms: {INTRA_FORMS}")
    return intra


def intra_config(dtype: str, prec, intra: str | None = None, th: bool = False) -> "Intra2Config":
    """The intra kernel's configuration: form "v2" (``DEFAULT_INTRA``) or "ax" (``alias_x``); ``th``: it also stores
    Tinv for the backward (``keeps_tables``)."""
    return Intra2Config(dtype, prec.merge, prec.ag, alias_x=intra_form(intra) == "ax", th=th)


def keeps_tables(prec) -> bool:
    """Whether a forward at precision ``prec`` can hand its intra tables (Tinv, Ag = Tinv diag(beta) hi + lo) to the
    backward: only where they are the backward's own (``gdn_bwd_prep``: bf16 merges, Ag split)."""
    return prec.merge == "bf16" and prec.ag == "split"


def check_knobs(path: str | None, out: str | None, intra: str | None, precision, occ: int | None = None,
                cpb: int | None = None) -> None:
    """The private knobs that select kernels (``_path``, ``_out``, ``_intra``, ``_precision``, ``_occ``, ``_cpb``):
    the API and its emulation raise the same ``ValueError`` for an unknown value, before any other check."""
    check_path(path)
    state_occ(occ)
    out_cpb(cpb)
    output_form(out)
    intra_form(intra)
    precision_v2(precision)


def dispatch_v2(dtype: str, n_seq: int, HV: int, BV: int | None = None, precision=None, cp: int = 1,
                form: str | None = None, out: str | None = None, intra: str | None = None, occ: int | None = None,
                cpb: int | None = None, th: bool = False):
    """(intra2, state, output2[, scan]) of the v2 path; the scan only when cp > 1 (rv form only: the
    smem form's scan compiles with a 16 KB stack frame, so that form always runs without CP).  ``occ``: CTAs
    per SM of the smem state kernel (``state_occ``; the rv form runs one);
    ``cpb``: chunks per CTA of the "pipe" output kernel (``out_cpb``); ``th``: the intra kernel also stores Tinv
    (the autograd Function's forward keeps the intra tables for the backward; ``keeps_tables``)."""
    prec = precision_v2(precision)
    form = form or DEFAULT_FORM
    if form not in ("rv", "smem"):
        raise ValueError(f"unknown state kernel form {form!r}")
    if form == "smem":
        cp = 1
    if form == "rv":
        bv, sbv = BV or RV_BV, RV_BV
        if bv not in (64, 128):
            raise ValueError(f"the rv state kernel needs BV in (64, 128), got {bv}")
    else:
        occ = state_occ(occ, n_seq, HV)
        bv, sbv = BV or (SCAN_BV if cp > 1 else block_v(n_seq, HV, occ)), SCAN_BV
        if occ > 1 and bv > 32:
            raise ValueError(f"two state CTAs per SM (_occ=2) need BV <= 32, got {bv}")
    occ = occ if form == "smem" else 1
    out = [intra_config(dtype, prec, intra, th=th and keeps_tables(prec)),
           State2Config(dtype, bv, prec, form=form, ctas_per_sm=occ),
           output_config(dtype, prec, form == "rv", out, cpb)]
    if cp > 1:
        out.append(State2Config(dtype, sbv, prec.for_scan(), scan=True, form=form))
    return tuple(out)


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
        for prec in (precision_v2(None), precision_v2(None, has_h0=True)):
            for form in OUTPUT_FORMS:
                cfgs = list(dispatch_v2(dtype, 1, 1, precision=prec, cp=2, out=form))    # rv + CP scan
                for bv in (64, 32, 16):                                                   # smem, by block_v
                    cfgs += dispatch_v2(dtype, 1, 1, BV=bv, precision=prec, cp=1, form="smem", out=form)
                for bv in (32, 16):                                                       # smem, 2 CTAs/SM
                    cfgs += dispatch_v2(dtype, 1, 1, BV=bv, precision=prec, cp=1, form="smem", out=form, occ=2)
                if form == "pipe":                                      # the pipe kernel's other chunks per CTA
                    for cpb in OUT_CPBS:
                        cfgs += dispatch_v2(dtype, 1, 1, precision=prec, cp=1, form="smem", out=form, cpb=cpb)[2:3]
                        cfgs += dispatch_v2(dtype, 1, 1, precision=prec, cp=1, form="rv", out=form, cpb=cpb)[2:3]
                for c in cfgs:
                    if c not in out:
                        out.append(c)
            if prec.s == "split" and prec.ks != "split":          # the backward recompute's candidate (sl_swizzle)
                for bv in (64, 32, 16):
                    c = State2Config(dtype, bv, prec, form="smem", sl_swizzle=True)
                    if c not in out:
                        out.append(c)
            for c in (intra_config(dtype, prec, "v2"),            # the intra kernel's other form (_intra="v2")
                      intra_config(dtype, prec, th=True)):        # the autograd forward's (Tinv kept)
                if c not in out:
                    out.append(c)
    return out


def prim_func(cfg):
    if isinstance(cfg, Intra2Config):
        from .intra2 import build_intra_v2
        return build_intra_v2(cfg.DK, cfg.dtype, cfg.merge, cfg.ag, cfg.alias_x, cfg.th)
    if isinstance(cfg, State2Config):
        if cfg.form == "rv":
            if cfg.sl_swizzle:
                raise ValueError(f"sl_swizzle is a switch of the smem state kernel, not of the rv form: {cfg!r}")
            from .state3 import build_state_rv
            return build_state_rv(cfg.DK, cfg.DK, cfg.dtype, cfg.prec, cfg.num_stages, cfg.scan, cfg.BV)
        from .state2 import build_state_v2
        return build_state_v2(cfg.DK, cfg.DK, cfg.BV, cfg.dtype, cfg.prec, cfg.num_stages, cfg.scan, cfg.ctas_per_sm,
                              cfg.sl_swizzle)
    if isinstance(cfg, Output2Config):
        from .output2 import build_output_v2
        return build_output_v2(cfg.DK, cfg.DK, cfg.dtype, cfg.prec, cfg.BV, cfg.vt, cfg.cpb, NUM_STAGES)
    raise TypeError(f"not a forward kernel configuration: {cfg!r}")


def pass_configs():
    import tilelang
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@functools.lru_cache(maxsize=None)
def get_kernel(cfg):
    """Compile (or fetch from TileLang's cache) the kernel of ``cfg`` for sm_90a."""
    import tilelang
    return tilelang.compile(prim_func(cfg), target=TARGET, pass_configs=pass_configs())


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
    top-level function, so the processes can call it; ``get_kernel`` when None).  Returns the names
    that failed."""
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


def dyn_smem_bytes(host_src: str) -> int | None:
    """The dynamic shared memory (bytes) a TileLang kernel's launch asks for, read from its host code: the last
    integer argument packed before the launch (TileLang 0.1.15's TVM-FFI host code).  None if not found."""
    import re

    i = host_src.find("_kernel_packed == NULL")
    found = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host_src[:i]) if i >= 0 else []
    return int(found[-1]) if found else None


def compile_report(cfg, get, kind: str, with_ptxas: bool = True) -> dict:
    """Compile ``cfg`` with ``get`` (sm_90a); return name, kind, dtype, seconds, CUDA source, the launch's
    dynamic shared memory and ptxas stats (what the compile tests check)."""
    import time

    t = time.time()
    kern = get(cfg)
    src = kern.get_kernel_source()
    out = {"name": cfg.name, "kind": kind, "dtype": cfg.dtype, "seconds": time.time() - t, "source": src,
           "dyn_smem": dyn_smem_bytes(kern.get_host_source())}
    if with_ptxas:
        t = time.time()
        out["ptxas"] = ptxas_report(src)
        out["ptxas_seconds"] = time.time() - t
    return out


def compile_for_test(index: int, with_ptxas: bool = True) -> dict:
    """``compile_report`` of ``all_configs()[index]``.  Top-level so a process pool can call it."""
    cfg = all_configs()[index]
    return compile_report(cfg, get_kernel, type(cfg).__name__, with_ptxas)
