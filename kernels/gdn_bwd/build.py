"""Configurations and compilation of the backward kernels (sm_90a), like ``gdn_fwd/build.py``
(same target, pass configs and disk cache; imports tilelang lazily)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kernels.gdn_fwd.build import DTYPES, KERNEL_HEAD_DIM, TARGET, compile_report, pass_configs
from kernels.gdn_fwd.build import precompile as fwd_precompile

# GVA group sizes (HV / H) the fused dqk kernel sums itself, in thread-block clusters (kinds "dqk_g2" ..)
CLUSTER_GROUPS = (2, 4, 8)
KINDS = ("prep", "dh", "dqk", *(f"dqk_g{g}" for g in CLUSTER_GROUPS), "gsum", "gsum32", "inter", "intra",
         "inter_lean", "dots", "intra_lean")
# dqk: the fused inter + intra kernel of "split", dqk_gN: the same storing the sums of groups of N value heads
# (clusters); gsum, gsum32: the GVA group sums of other group sizes to the input dtype / fp32;
# inter, intra: its two-kernel form (the A/B switch ``api._FUSED_DQK``); inter_lean, dots, intra_lean: "lean_sd"
TABLES = ("split", "lean_sd")  # chunk tables the inter kernel reads (api's _tables; emulation.TABLES has the study's)
DEFAULT_TABLES = "split"


@dataclass(frozen=True)
class BwdConfig:
    kind: str                      # one of KINDS
    dtype: str
    DK: int = KERNEL_HEAD_DIM
    cf: bool = False               # the fused dqk kinds only: ``conflict_free`` tiles (dqk_fused.py; the API's form)
    single: bool = False           # dh only: Tinv, dU, F0 dX single (dh.py's ``single``; the API's form)
    msingle: bool = False          # the intra terms' kinds (dqk*, intra, intra_lean): their 64x64 operands single
    dul16: bool = False            # prep and dh: dUloc^T in the input dtype (``_DUL_INPUT_DTYPE``)
    saved: bool = False            # prep only: Tinv and Ag from the forward (the autograd Function's saved tables)

    @property
    def name(self) -> str:
        flags = "".join(f",{f}" for f in ("cf", "single", "msingle", "dul16", "saved") if getattr(self, f))
        return f"bwd_{self.kind}[DK=DV={self.DK}{flags},{self.dtype}]"


# the kernels that compute the intra terms (``dqk.intra_terms``)
INTRA_KINDS = ("dqk", *(f"dqk_g{g}" for g in CLUSTER_GROUPS), "intra", "intra_lean")

# kernels without an input-dtype operand, compiled once (their BwdConfig's dtype is "float32")
DTYPE_FREE_KINDS = ("dgdb",)


def all_configs():
    """Every backward kernel the API can dispatch: prep, dh, the fused dqk, the two-kernel form of dqk (inter,
    intra: ``api._FUSED_DQK`` off) (and the "lean_sd" inter kernel, its state-dots
    kernel and the lean intra kernel) x {bf16, fp16} at K = V = 128 (K = V = 64 is zero-padded to 128 like the
    forward); the fused dqk kinds with ``_CONFLICT_FREE``'s tiles (``cf``, the API's form since session 13), and
    without them for bf16, without and with clusters (the A/B column ``ours-no-cf``: the tiles do not depend on the
    dtype); dh in both forms (``_DH_SINGLE``'s single operands, the API's since session 13, and every operand split:
    the A/B column ``ours-dh-split``); the intra terms' kinds with ``_INTRA_SINGLE``'s single 64x64 operands (the
    API's since session 14) and the bf16 fused dqk kinds with them split (the A/B column ``ours-intra-split``); the
    bf16 prep and dh of the ``_DUL_INPUT_DTYPE`` candidate (column ``ours-dul16``); prep without the solve, on the
    forward's saved Tinv and Ag (``saved``: the autograd Function's path).  The forward recompute uses the
    forward's own dispatched kernels (intra2 + the smem state kernel, precision "default_h0", with and without
    ``sl_swizzle``), compiled by the forward's test."""
    fused = ("dqk", *(f"dqk_g{g}" for g in CLUSTER_GROUPS))
    return ([BwdConfig(kind, dt, cf=kind in fused, msingle=kind in INTRA_KINDS) for dt in DTYPES for kind in KINDS]
            + [BwdConfig(k, "float32") for k in DTYPE_FREE_KINDS]
            + [BwdConfig(k, "bfloat16", msingle=True) for k in ("dqk", "dqk_g2")]
            + [BwdConfig("dh", dt, single=True) for dt in DTYPES]
            + [BwdConfig(k, "bfloat16", cf=True) for k in ("dqk", "dqk_g2")]
            + [BwdConfig("prep", "bfloat16", dul16=True), BwdConfig("dh", "bfloat16", single=True, dul16=True),
               BwdConfig("dh", "bfloat16", dul16=True)]
            + [BwdConfig("prep", dt, saved=True) for dt in DTYPES])


def prim_func(cfg: BwdConfig):
    D = cfg.DK
    if cfg.single and cfg.kind != "dh":
        raise ValueError(f"single (operands) is a switch of the dh kernel only: {cfg.name}")
    if cfg.msingle and cfg.kind not in INTRA_KINDS:
        raise ValueError(f"msingle (64x64 operands) is a switch of the intra terms' kernels only: {cfg.name}")
    if cfg.dul16 and cfg.kind not in ("prep", "dh"):
        raise ValueError(f"dul16 (dUloc^T in the input dtype) is a switch of prep and dh only: {cfg.name}")
    if cfg.saved and cfg.kind != "prep":
        raise ValueError(f"saved (the forward's Tinv and Ag) is a switch of prep only: {cfg.name}")
    if cfg.kind == "prep":
        from .prep import build_bwd_prep
        return build_bwd_prep(D, D, cfg.dtype, dul16=cfg.dul16, saved=cfg.saved)
    if cfg.kind == "dh":
        from .dh import build_bwd_dh
        return build_bwd_dh(D, D, cfg.dtype, single=cfg.single, dul16=cfg.dul16)
    if cfg.kind == "dqk" or cfg.kind.startswith("dqk_g"):
        from .dqk_fused import build_bwd_dqk_fused
        return build_bwd_dqk_fused(D, D, cfg.dtype, group=int(cfg.kind[5:]) if cfg.kind != "dqk" else 1,
                                   conflict_free=cfg.cf, intra_single=cfg.msingle)
    if cfg.cf:
        raise ValueError(f"cf (conflict-free tiles) is a switch of the fused dqk kernel only: {cfg.name}")
    if cfg.kind == "dgdb":
        from .dg_dbeta import build_dg_dbeta
        return build_dg_dbeta(D)
    if cfg.kind in ("gsum", "gsum32"):
        from .group_sum import build_group_sum
        return build_group_sum(D, "float32" if cfg.kind == "gsum32" else cfg.dtype)
    if cfg.kind == "inter":
        from .dqk import build_bwd_dqk_inter
        return build_bwd_dqk_inter(D, D, cfg.dtype)
    if cfg.kind in ("intra", "intra_lean"):
        from .dqk import build_bwd_dqk_intra
        return build_bwd_dqk_intra(D, D, cfg.dtype, lean="lean" in cfg.kind, single=cfg.msingle)
    if cfg.kind == "inter_lean":
        from .dqk_lean import build_bwd_dqk_inter_lean
        return build_bwd_dqk_inter_lean(D, D, cfg.dtype)
    if cfg.kind == "dots":
        from .dqk_lean import build_bwd_state_dots
        return build_bwd_state_dots(D, D, cfg.dtype)
    raise ValueError(cfg.kind)


@functools.lru_cache(maxsize=None)
def get_kernel(cfg: BwdConfig):
    import tilelang
    return tilelang.compile(prim_func(cfg), target=TARGET, pass_configs=pass_configs())


def forward_recompute_configs(dtype: str, n_seq: int = 1, HV: int = 1):
    """The forward kernels the backward runs to recompute S and U: (intra2, state_smem) at precision
    "default_h0" (S and U stored hi + lo, key-first tables).  The API runs intra2 only with
    ``api._RECOMPUTE_FROM_PREP`` off (prep stores the same ``Ag`` and gate rows).  The state kernel's value columns
    per CTA: ``recompute_state_shape``.  All are in ``gdn_fwd.build.all_configs()``."""
    from kernels.gdn_fwd.build import Intra2Config, State2Config, precision_v2
    prec = precision_v2("default_h0")
    bv, occ = recompute_state_shape(n_seq, HV)
    return Intra2Config(dtype, prec.merge, prec.ag), State2Config(dtype, bv, prec, form="smem", ctas_per_sm=occ,
                                                                  sl_swizzle=_CONFLICT_FREE)


def dqk_config(kind: str, dtype: str) -> BwdConfig:
    """The fused dqk kernel's configuration (``kind`` "dqk" or "dqk_gN"), with ``_CONFLICT_FREE``'s tiles and
    ``_INTRA_SINGLE``'s operands."""
    return BwdConfig(kind, dtype, cf=_CONFLICT_FREE, msingle=_INTRA_SINGLE)


def intra_config(kind: str, dtype: str) -> BwdConfig:
    """The two-kernel form's intra kernel (``kind`` "intra" or "intra_lean"), with ``_INTRA_SINGLE``'s operands."""
    return BwdConfig(kind, dtype, msingle=_INTRA_SINGLE)


# private switch (A/B timing: off in the column ``ours-intra-split``): the intra terms' four 64x64 operands single in
# every kernel that computes them (fused dqk, intra, intra_lean; ``dqk.intra_terms(mlo=False)``; the emulation
# follows it).  A candidate of session 13, the API's form since session 14 (4 fewer wgmma; fwd + bwd at B1 T32768
# H16 HV32 8.140 against 8.252 ms, B8 T4096 7.551 against 7.668, varlen 7.565 against 7.698: rep 200, one run)
_INTRA_SINGLE = True


def dh_config(dtype: str, single: bool | None = None) -> BwdConfig:
    """The reverse pass's configuration, with ``_DH_SINGLE``'s operands (``single`` overrides it: the segmented pass
    runs every operand split) and ``_DUL_INPUT_DTYPE``'s dUloc^T."""
    return BwdConfig("dh", dtype, single=_DH_SINGLE if single is None else single, dul16=_DUL_INPUT_DTYPE)


def stage_config(kind: str, dtype: str) -> BwdConfig:
    """The configuration the API runs for stage ``kind`` (``stage_kinds``), with the build switches' forms."""
    if kind.startswith("dqk"):
        return dqk_config(kind, dtype)
    if kind in ("intra", "intra_lean"):
        return intra_config(kind, dtype)
    if kind == "dh":
        return dh_config(dtype)
    if kind == "prep":
        return prep_config(dtype)
    return BwdConfig(kind, "float32" if kind in DTYPE_FREE_KINDS else dtype)


def prep_config(dtype: str, saved: bool = False) -> BwdConfig:
    """prep's configuration, with ``_DUL_INPUT_DTYPE``'s dUloc^T; ``saved``: Tinv and Ag come from the forward (the
    autograd Function's tables, where the API's reverse pass is the sequential single one: ``api``)."""
    return BwdConfig("prep", dtype, dul16=_DUL_INPUT_DTYPE, saved=saved)


# private switch (A/B timing: on in the column ``ours-dul16``; a candidate of session 13, not yet timed): prep stores
# dUloc^T in the input dtype and dh reads it so (0.27 GB less written and read at B1 T32768 H16 HV32); the emulation
# follows it.  Accuracy (emulation, six GPU cases' inputs, with dh's single form): worst 0.8235x the FLA-like
# baseline against 0.8233 without it
_DUL_INPUT_DTYPE = False


# private switch (A/B timing: off in the column ``ours-dh-split``; session 13): dh with single Tinv, dU and F0 dX
# operands (``dh.py``'s ``single``; the emulation follows it)
_DH_SINGLE = True

# private switch (A/B timing: off in the column ``ours-no-cf``): the shared tiles whose per-thread accesses are bank
# conflicts in the generated CUDA laid out without them (``kernels.common.bank_conflicts``) - the recompute's state
# kernel's S lo tile swizzled (``state2.py``'s ``swizzle_sl``) and the fused dqk kernel's v, m_s, stage and inbox
# tiles (``dqk_fused.py``'s ``conflict_free``); the same values in the same order (session 13, call 1, one H200:
# backward 7.27 -> 6.98 ms at B1 T32768 H16 HV32, bitwise equal gradients on 7 cases)
_CONFLICT_FREE = True


def recompute_state_shape(n_seq: int, HV: int) -> tuple[int, int]:
    """(BV, CTAs per SM) of the recompute's state kernel (``N x HV x 128 / BV`` CTAs, sequential over chunks): the
    forward's ``block_v`` at one CTA per SM, also beside dh.  Measured on an H200 (session 10, call 1,
    ``bench_kernels_bwd.py --ab ours-rc-bv32,ours-rc-bv64``, backward ms) against a rule that fitted the state
    kernel into the SMs dh leaves free (BV 32 at two CTAs per SM beside dh's 64 CTAs at B1 T32768 H16 HV32): 8.05
    against 8.24 there (the recompute was hidden either way; two CTAs per SM slowed dh down: 2.51 ms against 2.11
    alone), equal elsewhere; BV 64 lost at B1 T65536 H2 HV4 (5.23 against 3.76).  ``_RECOMPUTE_STATE`` overrides
    it (A/B timing)."""
    from kernels.gdn_fwd.build import block_v
    if _RECOMPUTE_STATE is not None:
        return _RECOMPUTE_STATE
    return block_v(n_seq, HV), 1


# private override (A/B timing): (BV, CTAs per SM) of the recompute's state kernel, None = recompute_state_shape's
_RECOMPUTE_STATE: tuple[int, int] | None = None


def _get_any(cfg):
    """The compiled kernel of a backward or forward configuration."""
    if isinstance(cfg, BwdConfig):
        return get_kernel(cfg)
    from kernels.gdn_fwd.build import get_kernel as fwd_get
    return fwd_get(cfg)


def precompile(cfgs, workers: int | None = None, log=print):
    """Compile backward (and forward) configurations in parallel spawned processes (fills TileLang's
    disk cache): the forward's ``precompile``.  Returns the names that failed."""
    return fwd_precompile(cfgs, workers, log, get=_get_any)


def compile_for_test(index: int, with_ptxas: bool = True) -> dict:
    """``compile_report`` of ``all_configs()[index]``: name, kind, dtype, seconds, CUDA source, ptxas stats."""
    cfg = all_configs()[index]
    return compile_report(cfg, get_kernel, cfg.kind, with_ptxas)


def parse_tables(tables: str | None = None, precisions: tuple[str, ...] = TABLES) -> str:
    """The precision of the API's ``_tables``: "split" (default) or "lean_sd".  ``precisions``: the accepted
    precisions (the emulation also takes its study's "lean")."""
    tables = tables or DEFAULT_TABLES
    if tables not in precisions:
        raise ValueError(f"unknown chunk table precision {tables!r}; choices: {precisions}")
    return tables


def stage_kinds(tables: str | None = None, fused: bool | None = None) -> tuple[str, ...]:
    """The backward kernels a call runs with ``_tables`` ``tables`` (``parse_tables``); ``fused``: the "split"
    tables' inter and intra terms in one kernel ("dqk") or two ("inter", "intra"); None = the API's default
    (``api._FUSED_DQK``)."""
    if parse_tables(tables) != "split":
        return ("prep", "dh", "inter_lean", "dots", "intra_lean")
    if fused is None:
        from . import api
        fused = api._FUSED_DQK
    fused_kinds = ("prep", "dh", "dqk", *(f"dqk_g{g}" for g in CLUSTER_GROUPS), "gsum", "gsum32", "dgdb")
    return fused_kinds if fused else ("prep", "dh", "inter", "intra")


def configs_for_call(dtype: str, n_seq: int, HV: int, max_chunks: int, has_h0: bool, tables: str | None = None,
                     fused: bool | None = None):
    """Every kernel a forward + backward call of the autograd Function runs (for precompiling): the
    forward's dispatch for this call, the forward recompute, and the backward stages (``stage_kinds``; ``fused``
    as there)."""
    from kernels.gdn_fwd import build as fb
    out = []
    try:
        form, cp = fb.plan_v2(n_seq, HV, max_chunks)
        prec = fb.precision_v2(None, has_h0)
        out += list(fb.dispatch_v2(dtype, n_seq, HV, precision=prec, cp=cp, form=form))
        out += list(fb.dispatch_v2(dtype, n_seq, HV, precision=prec, cp=cp, form=form, th=True))[:1]  # Tinv kept
    except Exception:       # the forward's planner changed: everything it can dispatch
        out += [c for c in fb.all_configs() if c.dtype == dtype]
    out += list(forward_recompute_configs(dtype, n_seq, HV))
    kinds = stage_kinds(tables, fused)
    out += [stage_config(kind, dtype) for kind in kinds]
    if "dh" in kinds:
        out.append(dh_config(dtype, single=False))  # every operand split: the segmented reverse pass's (api, dh_cp)
    if "prep" in kinds:
        out.append(prep_config(dtype, saved=True))  # on the forward's saved tables (the autograd Function's path)
    uniq = []
    for c in out:
        if c not in uniq:
            uniq.append(c)
    return uniq
