"""Configurations of the backward kernels (sm_90a) and their TileLang functions; compiled by ``kernels.build``.
Imports tilelang lazily."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.forward.configs import DTYPES, HEAD_DIMS, KERNEL_HEAD_DIM

# GVA group sizes (HV / H) the dqk kernel sums itself, in thread-block clusters (kinds "dqk_g2" ..)
CLUSTER_GROUPS = (2, 4, 8)
# prep, dh; dqk: the inter + intra terms of one value head; dqk_gN: the same in clusters of N value heads storing
# the group sums; gsum, gsum32: the GVA group sums of other group sizes to the input dtype / fp32; dgdb: dg, dbeta
KINDS = ("prep", "dh", "dqk", *(f"dqk_g{g}" for g in CLUSTER_GROUPS), "gsum", "gsum32")
DQK_KINDS = tuple(kind for kind in KINDS if kind.startswith("dqk"))
# value columns a CTA of the warp-specialised reverse pass (``dh_ws``) can own
DH_WS_BLOCKS = (32,)
# the head dim at which dqk forms its gates once and widens its fp8 lo tiles by a mask (dispatched and built there)
DQK_E_ONCE_HEAD_DIM = 128
# the one-term backward's inputs: v and dO under their GVA groups' powers of two, q, k, v, dO from the caller's
# dtype (``io``) to the kernels' (``dtype``; the same dtype: v and dO scaled alone)
CONVERT_KIND = "cvt"
# the one-term backward's largest magnitudes of v and dO per value head (``dtype``: the inputs')
AMAX_KIND = "amax"
# the one-term backward's element-wise passes (built at DQK_E_ONCE_HEAD_DIM, where its forms are)
ONE_TERM_KINDS = (AMAX_KIND, CONVERT_KIND)
# the one-term backward's dh and dqk in one warp-specialised kernel (fp16 operands, at DQK_E_ONCE_HEAD_DIM)
FUSED_KIND = "fused"
# kernels without an input-dtype operand, compiled once (their BwdConfig's dtype is "float32")
DTYPE_FREE_KINDS = ("dgdb",)


@dataclass(frozen=True)
class BwdConfig:
    kind: str                      # one of KINDS or DTYPE_FREE_KINDS
    dtype: str
    DK: int = KERNEL_HEAD_DIM
    single: bool = False           # dh only: Tinv, dU, F0 dX single (the sequential reverse pass)
    saved: bool = False            # prep only: Tinv and Ag from the forward (the autograd Function's saved tables)
    bounds: bool = False           # prep with saved: the chunks' log2 norm bounds Lb too (the warm segmented pass)
    tinv_hi: bool = False          # dh: dU and F0 dX split, Tinv's hi term alone (the forward's saved tables);
    #                                prep computing Tinv: its hi term alone stored (the one-term plans')
    s_single: bool = False         # dqk only: the recomputed S its hi term alone (no S lo table)
    merge: str = "bf16"            # prep only (computing Tinv): the block merges "fp32", "bf16" or "split" (the
    #                                forward's Precision.merge; "bf16" where prep reads the saved tables: no merge)
    lo8: bool = False              # dh, dqk: the lo terms of the S and dS' tables as fp8 (kernels.common.lo8)
    ws_bv: int = 0                 # dh only: the warp-specialised key-first kernel (dh_ws) at this many value
    #                                columns a CTA (32); 0: the value-first register kernel (64 columns)
    e_once: bool = False           # dqk only: e^(G_t - G_j) formed once a chunk for the intra terms' four uses
    exp_mask: bool = False         # dqk only: the fp8 lo tiles' powers of two by a mask of hi's exponent bits
    one: bool = False              # dh_ws (with single), dqk (with s_single): every table and operand one input-dtype
    #                                term (the dS', dY tables hi alone; dqk reads S, U, dS', dY hi alone)
    warm: bool = False             # dh, fused: the segmented reverse pass in one launch, each segment from its warm-up
    #                                chunks or its sequence's end (the split register dh, ``gdn_bwd_dh_warm``; the
    #                                fused kernel, ``gdn_bwd_fused_warm``)
    chain: bool = False            # fused only: the reverse chain alone, each segment's start gradient its one output
    #                                (pass A of the exact segmented pass, ``gdn_bwd_fused_chain``)
    no_du: bool = False            # prep computing Tinv only: no dUloc^T (the fused backward forms it; dO not read)
    io: str = ""                   # dh_ws, dqk with one, fused: the caller's dtype where the operands are another
    #                                (dtype): dv, dq, dk stored in it ("": dtype); cvt: the source dtype (may be dtype);
    #                                prep with no_du: its converting form (gdn_bwd_convert's work too), from io
    dq16: bool = False             # fused: dq~, dk~ stored in fp16 under the GVA group scales (the chain form: its
    #                                unwritten dq~, dk~ arguments declared fp16); gsum, gsum32: their scaled form,
    #                                reading those and applying the factors

    @property
    def name(self) -> str:
        names = ("single", "saved", "bounds", "tinv_hi", "s_single", "lo8", "e_once", "exp_mask", "one", "warm",
                 "chain", "no_du", "dq16")
        flags = "".join(f",{f}" for f in names if getattr(self, f))
        flags += f",merge={self.merge}" if self.merge != "bf16" else ""
        flags += f",ws{self.ws_bv}" if self.ws_bv else ""
        flags += f",io={self.io}" if self.io else ""
        return f"bwd_{self.kind}[DK=DV={self.DK}{flags},{self.dtype}]"


def all_configs():
    """Every backward kernel a dispatch decision can choose, for each head dim K = V in ``HEAD_DIMS`` (128 first):
    each kind x {bf16, fp16}, dh in its split form (every operand; on the saved tables, Tinv hi alone) and its
    single form (an A/B alternative), prep computing the tables (with fp32 merges, and split ones, the A/B
    alternative; one-term ones compile when a benchmark asks for them) and on the forward's saved ones (with and
    without the chunks' bounds), dqk also on S's hi term alone (an A/B alternative); the split dh and dqk with fp8
    lo tables (``lo8``), the split dh with fp8 lo tables also warp-specialised at 32 value columns (``ws_bv``) and
    in the segmented pass's warm-up form (``warm``, on Tinv hi + lo or hi alone), and at ``DQK_E_ONCE_HEAD_DIM`` dqk
    with fp8 lo tables forming the intra terms' gates once (``e_once``) and widening its lo tiles with a masked power
    of two (``exp_mask``), as dispatched there, and the one-term forms of dh_ws and dqk (``one``: an A/B
    alternative; fp16 operands with bf16 dv, dq, dk too, ``io``, and the one-term passes: the maxima and the inputs'
    scaling, bf16 to fp16 or in their dtype) and the fused kernel of both on fp16 operands (``FUSED_KIND``, dv in
    bf16 or fp16, and its prep, without dUloc^T: ``no_du``, also converting bf16 inputs: ``io``); the dtype-free
    dgdb once.  The forward recompute runs the forward's intra and state kernels (``kernels.build.forward_configs``)."""
    return [c for D in sorted(HEAD_DIMS, reverse=True) for c in _configs_at(D)]


def _configs_at(D: int):
    return ([BwdConfig(kind, dt, D) for dt in DTYPES for kind in KINDS if kind != "prep"]
            + [BwdConfig(k, "float32", D) for k in DTYPE_FREE_KINDS]
            + [BwdConfig("dh", dt, D, single=True) for dt in DTYPES]
            + [BwdConfig("dh", dt, D, tinv_hi=True) for dt in DTYPES]
            + [BwdConfig("prep", dt, D, saved=True, bounds=b) for dt in DTYPES for b in (False, True)]
            + [BwdConfig("prep", dt, D, merge=m) for dt in DTYPES for m in ("fp32", "split")]
            + [BwdConfig(kind, dt, D, s_single=True) for dt in DTYPES for kind in DQK_KINDS]
            + [BwdConfig("dh", dt, D, tinv_hi=t, lo8=True) for dt in DTYPES for t in (False, True)]
            + [BwdConfig("dh", dt, D, tinv_hi=t, lo8=True, ws_bv=32) for dt in DTYPES for t in (False, True)]
            + [BwdConfig("dh", dt, D, tinv_hi=t, lo8=True, warm=True) for dt in DTYPES for t in (False, True)]
            + [BwdConfig(kind, dt, D, lo8=True) for dt in DTYPES for kind in DQK_KINDS]
            + ([BwdConfig(kind, dt, D, lo8=True, e_once=True, exp_mask=True) for dt in DTYPES for kind in DQK_KINDS]
               if D == DQK_E_ONCE_HEAD_DIM else [])
            + ([BwdConfig("dh", dt, D, single=True, ws_bv=32, one=True) for dt in DTYPES]
               + [BwdConfig(kind, dt, D, s_single=True, e_once=True, one=True) for dt in DTYPES for kind in DQK_KINDS]
               + [BwdConfig("dh", "float16", D, single=True, ws_bv=32, one=True, io="bfloat16")]
               + [BwdConfig(kind, "float16", D, s_single=True, e_once=True, one=True, io="bfloat16")
                  for kind in DQK_KINDS]
               + [BwdConfig(CONVERT_KIND, dt, D, io=src) for dt, src in (("float16", "bfloat16"), *zip(DTYPES, DTYPES))]
               + [BwdConfig(AMAX_KIND, dt, D) for dt in DTYPES]
               + [BwdConfig(FUSED_KIND, "float16", D, one=True, io=io, warm=w, chain=c)
                  for io in ("bfloat16", "") for w, c in ((False, False), (True, False), (False, True))]
               + [BwdConfig(FUSED_KIND, "float16", D, one=True, io="bfloat16", warm=w, chain=c, dq16=True)
                  for w, c in ((False, False), (True, False), (False, True))]
               + [BwdConfig(k, dt, D, dq16=True) for k, dt in (("gsum", "bfloat16"), ("gsum32", "float16"))]
               + [BwdConfig("prep", "float16", D, merge="fp32", no_du=n, tinv_hi=True) for n in (True, False)]
               + [BwdConfig("prep", "float16", D, merge="fp32", no_du=True, tinv_hi=True, io="bfloat16")]
               if D == DQK_E_ONCE_HEAD_DIM else []))


def prim_func(cfg: BwdConfig):
    """The TileLang function of ``cfg``."""
    D = cfg.DK
    if cfg.single and cfg.kind != "dh":
        raise ValueError(f"single (operands) is a form of the dh kernel only: {cfg.name}")
    if cfg.dq16 and cfg.kind not in (FUSED_KIND, "gsum", "gsum32"):
        raise ValueError(f"dq16 (dq~, dk~ stored in fp16) is a form of {FUSED_KIND} and of its group sums: "
                         f"{cfg.name}")
    if cfg.tinv_hi and not ((cfg.kind == "dh" and not cfg.single) or (cfg.kind == "prep" and not cfg.saved)):
        raise ValueError(f"tinv_hi (Tinv's hi term alone) is a form of the split dh kernel and of prep computing "
                         f"Tinv: {cfg.name}")
    if cfg.saved and cfg.kind != "prep":
        raise ValueError(f"saved (the forward's Tinv and Ag) is a form of prep only: {cfg.name}")
    if cfg.bounds and not cfg.saved:
        raise ValueError(f"bounds (Lb on the forward's tables) is a form of prep with saved; prep computing Tinv "
                         f"always stores them: {cfg.name}")
    if cfg.s_single and cfg.kind not in DQK_KINDS:
        raise ValueError(f"s_single (S's hi term alone) is a form of dqk only: {cfg.name}")
    if cfg.merge != "bf16" and (cfg.kind != "prep" or cfg.saved):
        raise ValueError(f"merge (the block merges) is a form of prep computing Tinv only: {cfg.name}")
    split_tables = (cfg.kind == "dh" and not cfg.single) or (cfg.kind in DQK_KINDS and not cfg.s_single)
    if cfg.lo8 and not split_tables:
        raise ValueError(f"lo8 (fp8 lo tables) is a form of the split dh and of dqk on the split S: {cfg.name}")
    if cfg.e_once and cfg.kind not in DQK_KINDS:
        raise ValueError(f"e_once (the intra terms' gates formed once) is a form of dqk only: {cfg.name}")
    if cfg.exp_mask and not (cfg.kind in DQK_KINDS and cfg.lo8):
        raise ValueError(f"exp_mask (the fp8 lo tiles' masked powers of two) is a form of dqk with fp8 lo tables: "
                         f"{cfg.name}")
    if cfg.kind == FUSED_KIND and not (cfg.one and cfg.dtype == "float16" and cfg.DK == DQK_E_ONCE_HEAD_DIM
                                       and not (cfg.lo8 or cfg.single or cfg.s_single)):
        raise ValueError(f"{FUSED_KIND}: the one-term backward on fp16 operands at K = V = {DQK_E_ONCE_HEAD_DIM} "
                         f"(one, no other form): {cfg.name}")
    if cfg.one and not ((cfg.kind == "dh" and cfg.single and cfg.ws_bv and not cfg.lo8)
                        or (cfg.kind in DQK_KINDS and cfg.s_single and not cfg.lo8) or cfg.kind == FUSED_KIND):
        raise ValueError(f"one (every term single) is a form of the warp-specialised dh with single, of dqk with "
                         f"s_single, neither with fp8 lo tables, and of {FUSED_KIND}: {cfg.name}")
    converting_prep = cfg.kind == "prep" and cfg.no_du and not cfg.saved and cfg.io in DTYPES
    if cfg.io and not (cfg.one and cfg.io in DTYPES and cfg.io != cfg.dtype) and cfg.kind != CONVERT_KIND \
            and not converting_prep:
        raise ValueError(f"io (the caller's dtype: dv, dq, dk stored in it) is a form of the one-term dh_ws, dqk and "
                         f"{FUSED_KIND}, another dtype of {DTYPES} than the operands'; prep without dUloc^T: the "
                         f"dtype it converts q, k, v, dO from: {cfg.name}")
    if cfg.kind == CONVERT_KIND and cfg.io not in DTYPES:
        raise ValueError(f"{CONVERT_KIND} converts from its io dtype, one of {DTYPES}: {cfg.name}")
    if cfg.kind == CONVERT_KIND:
        from .convert import build_convert
        return build_convert(D, cfg.io, cfg.dtype)
    if cfg.kind == AMAX_KIND:
        from .convert import build_amax
        return build_amax(D, cfg.dtype)
    if cfg.no_du and (cfg.kind != "prep" or cfg.saved):
        raise ValueError(f"no_du (no dUloc^T) is a form of prep computing Tinv only: {cfg.name}")
    if cfg.kind == "prep":
        from .prep import build_bwd_prep
        return build_bwd_prep(D, D, cfg.dtype, saved=cfg.saved, merge=cfg.merge, bounds=cfg.bounds, du=not cfg.no_du,
                              tinv_lo=not cfg.tinv_hi, io=cfg.io)
    if cfg.ws_bv and (cfg.kind != "dh" or cfg.ws_bv not in DH_WS_BLOCKS):
        raise ValueError(f"ws_bv (the warp-specialised reverse pass) is a form of dh at {DH_WS_BLOCKS}: {cfg.name}")
    if cfg.warm and not ((cfg.kind == "dh" and not (cfg.single or cfg.ws_bv)) or cfg.kind == FUSED_KIND):
        raise ValueError(f"warm (the segmented reverse pass's warm-up starts) is a form of the split register dh "
                         f"and of {FUSED_KIND}: {cfg.name}")
    if cfg.kind == "dh" and cfg.ws_bv:
        from .dh_ws import build_bwd_dh_ws
        return build_bwd_dh_ws(D, D, cfg.dtype, BV=cfg.ws_bv, single=cfg.single, tinv_lo=not cfg.tinv_hi,
                               lo8=cfg.lo8, one=cfg.one, io=cfg.io)
    if cfg.kind == "dh":
        from .dh import build_bwd_dh
        return build_bwd_dh(D, D, cfg.dtype, single=cfg.single, tinv_lo=not cfg.tinv_hi, lo8=cfg.lo8, warm=cfg.warm)
    if cfg.kind == "dqk" or cfg.kind.startswith("dqk_g"):
        from .dqk import build_bwd_dqk
        return build_bwd_dqk(D, D, cfg.dtype, group=int(cfg.kind[5:]) if cfg.kind != "dqk" else 1,
                             s_lo=not cfg.s_single, lo8=cfg.lo8, e_once=cfg.e_once, exp_mask=cfg.exp_mask,
                             one=cfg.one, io=cfg.io)
    if cfg.chain and (cfg.kind != FUSED_KIND or cfg.warm):
        raise ValueError(f"chain (the reverse chain alone) is a form of {FUSED_KIND} without warm: {cfg.name}")
    if cfg.kind == FUSED_KIND:
        from .fused import build_bwd_fused
        return build_bwd_fused(D, io=cfg.io or cfg.dtype, warm=cfg.warm, chain=cfg.chain, dq16=cfg.dq16)
    if cfg.kind == "dgdb":
        from .dg_dbeta import build_dg_dbeta
        return build_dg_dbeta(D)
    if cfg.kind in ("gsum", "gsum32"):
        from .group_sum import build_group_sum
        return build_group_sum(D, "float32" if cfg.kind == "gsum32" else cfg.dtype, scaled=cfg.dq16)
    raise ValueError(f"unknown backward kernel kind {cfg.kind!r}: {cfg.name}")
