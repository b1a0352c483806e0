"""The kernels a call runs, decided once per call and passed down explicitly.

``forward_plan`` and ``backward_plan`` are the one dispatch function of each direction: they read the call's
shapes, dtype and device and return a frozen plan; the pipelines (``forward/pipeline.py``,
``backward/pipeline.py``) do what the plan says and decide nothing themselves.  A benchmark's alternative is
another plan value (``dataclasses.replace(plan, ...)``) passed to the same pipeline.

Importing this module imports neither tilelang nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from kernels.backward.configs import (AMAX_KIND, CLUSTER_GROUPS, CONVERT_KIND, DH_WS_BLOCKS, DQK_E_ONCE_HEAD_DIM,
                                      FUSED_KIND, BwdConfig)
from kernels.forward.configs import (HEAD_DIMS, KERNEL_HEAD_DIM, OUT_CPB, RV_BV, SCAN_BV, STATE_FORMS, FixupConfig,
                                     IntraConfig, OutputConfig, StateConfig, output_block_v)
from kernels.forward.cp_warm import MAX_SEGMENTS
from kernels.forward.precision import PRESETS, Precision, preset

__all__ = ["ForwardPlan", "BackwardPlan", "forward_plan", "backward_plan", "dispatches_fused", "replace"]

# ~SMs of an H200 (132); the sequential state kernel wants about one CTA per SM.
N_SM = 128
CP_MIN_CHUNKS = 16             # chunks per CP segment at the least
CP_MAX_CTAS = 8                # rv CTAs (N x HV x DK/64) at most for CP
CP_MIN_TOTAL_CHUNKS = 512      # chunks of the longest sequence at the least for CP
WS_HEAD_DIMS = (128,)          # head dims at which the "ws" form is dispatched (where it was measured faster)
WS_CP_BV = 64                  # value columns per CTA of the "ws" form run per CP segment
SPLIT_EXACT_BV = 32            # value columns per CTA of split_heads' whole sequences (as the ws form without CP)
# dh's warp-specialised kernel at 32 value columns (one CTA per SM: 384 threads x 168 registers) up to this many
# CTAs.  On an H200 it took dh from 3.07 to 1.53 ms at B1 T32768 H16 HV32 (128 CTAs against the register kernel's
# 64) and from 1.23 to 1.54 at B8 T4096 H16 HV32 (1024 CTAs against 512).
DH_WS_MAX_CTAS = N_SM
# the backward's recompute runs on a side stream beside dh from this many (chunk, value head) pairs
OVERLAP_MIN_CHUNK_HEADS = 4096
# the one-term backward on fp16 operands for bf16 inputs (``BackwardPlan.one_term``: q, k, v, dO converted, v and dO
# under powers of two per GVA group; S, U, dS', dY hi alone; prep computes Tinv, so the forward keeps no tables),
# with the sequential dh_ws at every layout
ONE_TERM_FIELDS = dict(dtype="float16", io_dtype="bfloat16", one_term=True, dh_single=True, s_single=True,
                       lo8=False, reads_saved_tables=False, dh_ws_bv=32, dh_segments=None, dh_warm=False,
                       recompute_warm=False, shared_scan=False)
# the fused one-term backward (``BackwardPlan.fused``, one CTA per (value head, sequence)) is dispatched for bf16
# inputs at ``DQK_E_ONCE_HEAD_DIM`` from this many CTAs (``dispatches_fused``)
FUSED_MIN_CTAS = N_SM


@dataclass(frozen=True)
class ForwardPlan:
    """The forward kernels of one call.

    ``state_form``: "rv" (register operands, value-first tables), "smem" (shared-memory operands, key-first) or
    "ws" (the smem products with o in the same warp-specialised kernel, ``gdn_state_output_ws``: no chunk tables,
    no output kernel);
    ``block_v``: the state kernel's value columns per CTA; ``ctas_per_sm``: resident state CTAs per SM ("smem": 1
    or 2, BV <= 32 for 2); ``cp``: segments per sequence of the segment-parallel state passing (1 = off; "rv" and
    "ws": the rv scan and the fp64 fix-up give every segment its start state, then the state kernel runs per
    segment); ``keep_tables``: the intra kernel also stores Tinv and the call hands Tinv, Ag to the backward;
    ``p_table``: the intra kernel stores the gated scores P and the "ws" kernel reads them (its P warpgroup idles);
    ``DK``: the head dim K == V every kernel is built for (``HEAD_DIMS``); ``warm``: the "ws" form's CP segments
    start from warm-up chunks where the gates allow (``forward.cp_warm``), the scan and fix-up running only for
    those that need an exact start state; ``split_heads`` (with ``warm``): no scan and no fix-up; each (sequence,
    value head) runs in one of two "ws" kernels launched side by side, decided on the GPU: the CP segments at
    ``block_v`` where every segment start of the sequence takes a warm-up, else the whole sequence without CP at
    ``SPLIT_EXACT_BV`` columns a CTA (``state_output_ws``'s ``split``); ``longest_first`` (read by the "ws" form's
    one pass, dispatched with it): its CTAs run the sequences longest first (``ForwardInputs.seq_order``), else in
    index order, so that on a ragged batch the long sequences do not start last and set the kernel's time."""
    dtype: str
    precision: Precision
    state_form: str
    block_v: int
    ctas_per_sm: int = 1
    cp: int = 1
    keep_tables: bool = False
    DK: int = KERNEL_HEAD_DIM
    p_table: bool = False
    warm: bool = False
    split_heads: bool = False
    longest_first: bool = False

    def __post_init__(self):
        check_head_dim(self.DK)
        if self.state_form not in STATE_FORMS:
            raise ValueError(f"unknown state kernel form {self.state_form!r}; forms: {STATE_FORMS}")
        if self.state_form == "rv" and (self.block_v not in (64, 128) or self.block_v > self.DK
                                        or self.ctas_per_sm != 1):
            raise ValueError(f"the rv state kernel needs BV in (64, 128), at most DK, at one CTA per SM: {self}")
        if self.state_form == "smem" and (self.cp != 1 or self.block_v not in (16, 32, 64)
                                          or self.ctas_per_sm not in (1, 2)
                                          or (self.ctas_per_sm == 2 and self.block_v > 32)):
            raise ValueError(f"the smem state kernel needs cp 1, BV in (16, 32, 64), "
                             f"1 CTA per SM or 2 with BV <= 32: {self}")
        if self.state_form == "ws" and (self.block_v not in (16, 32, 64, 128) or self.ctas_per_sm != 1
                                        or (self.block_v == 128 and not self.precision.half)):
            raise ValueError(f"the fused warp-specialised state-output kernel needs BV in (16, 32, 64), or 128 with "
                             f"fp16 operands, and one CTA per SM: {self}")
        if self.cp < 1 or (self.cp > 1 and self.precision.half):
            raise ValueError(f"cp counts segments (>= 1); fp16 operands' value scales are per sequence, not per "
                             f"segment (cp 1): {self}")
        if self.p_table and (self.state_form != "ws" or self.precision.merge == "split"):
            raise ValueError(f"P tables are read by the ws form alone, and stored by an intra kernel with fp32 or "
                             f"bf16 merges: {self}")
        if self.precision.pu16:
            raise ValueError(f"P @ U as one fp16 product (Precision.pu16) is the emulation's study: no kernel "
                             f"computes it: {self}")
        if self.precision.half and self.state_form != "ws":
            raise ValueError(f"fp16 operands (Precision.half) are a form of the ws kernel: {self}")
        if self.warm and (self.state_form != "ws" or not 2 <= self.cp <= MAX_SEGMENTS):
            raise ValueError(f"warm-up starts are the ws form's, per CP segment (2 <= cp <= {MAX_SEGMENTS}): {self}")
        if self.split_heads and not self.warm:
            raise ValueError(f"split_heads chooses between warm-up CP segments and whole sequences (warm): {self}")
        if self.keep_tables and not keeps_tables(self.precision):
            raise ValueError(f"precision {self.precision.tag()} does not compute the backward's tables: {self}")

    def configs(self) -> tuple:
        """(intra, state, output[, scan, fix-up]) kernel configurations; the CP scan and fix-up only when
        ``cp > 1``; (intra, state-output[, scan, fix-up]) for the "ws" form.  Built once per plan value: each stage
        of a call asks for its own."""
        return _forward_configs(self)


@lru_cache(maxsize=512)
def _forward_configs(plan: ForwardPlan) -> tuple:
    prec, rv, DK = plan.precision, plan.state_form == "rv", plan.DK
    past = prec.past_intra()                    # what the state and output kernels read of the precision
    scan = ()
    if plan.split_heads:                        # the two ws kernels side by side: no scan, no fix-up
        return (IntraConfig(plan.dtype, prec.merge, prec.ag, DK=DK, th=plan.keep_tables, pt=plan.p_table),
                StateConfig(plan.dtype, plan.block_v, past, form="ws", DK=DK, pt=plan.p_table, warm=True,
                            split="warm"),
                StateConfig(plan.dtype, SPLIT_EXACT_BV, past, form="ws", DK=DK, pt=plan.p_table, split="exact"))
    if plan.cp > 1:
        scan = (StateConfig(plan.dtype, min(SCAN_BV, DK), past.for_scan(), scan=True, form="rv", DK=DK,
                            warm=plan.warm),
                FixupConfig(DK, warm=plan.warm))
    if plan.state_form == "ws":                 # o from the state kernel: no output kernel
        return (IntraConfig(plan.dtype, prec.merge, prec.ag, DK=DK, th=plan.keep_tables, pt=plan.p_table),
                StateConfig(plan.dtype, plan.block_v, past, form="ws", DK=DK, pt=plan.p_table, warm=plan.warm),
                *scan)
    out = [IntraConfig(plan.dtype, prec.merge, prec.ag, DK=DK, th=plan.keep_tables),
           StateConfig(plan.dtype, plan.block_v, past, form=plan.state_form, DK=DK, ctas_per_sm=plan.ctas_per_sm),
           OutputConfig(plan.dtype, past, BV=output_block_v(prec, DK), vt=rv, DK=DK, cpb=OUT_CPB)]
    return (*out, *scan)                        # (of the forms with chunk tables, only rv takes CP: __post_init__)


@lru_cache(maxsize=512)
def _recompute_configs(dtype, DK, s_single, merge, ks_single, cp, ws, bv, occ, lo8, warm=False,
                       u_single=False, chain_single=False) -> tuple:
    """``BackwardPlan.recompute_configs`` of the fields it depends on (``cp``: the CP plan's segments, 0 = none;
    ``warm``: the ws tables form per dh segment from warm-up chunks; ``u_single``: U stored hi alone;
    ``chain_single``: X and F2 U one term)."""
    prec = recompute_precision(s_single, merge, ks_single, u_single, chain_single)
    scan = ForwardPlan(dtype, preset(), "rv", RV_BV, 1, cp, DK=DK).configs()[-2:] if cp else ()
    if ws:
        state = StateConfig(dtype, bv, prec.past_intra(), form="ws", DK=DK, lo8=lo8, tables=True, warm=warm)
    else:
        state = StateConfig(dtype, bv, prec.past_intra(), form="smem", DK=DK, ctas_per_sm=occ,
                            sl_swizzle=prec.s == "split" and prec.ks != "split" and not lo8, lo8=lo8)
    return (IntraConfig(dtype, prec.merge, prec.ag, DK=DK), state, *scan)


def check_head_dim(DK) -> int:
    """``DK`` itself when the kernels are built for it (``HEAD_DIMS``), else a ValueError naming it."""
    if DK not in HEAD_DIMS:
        raise ValueError(f"no kernel is built for head dim DK={DK!r}; head dims: {HEAD_DIMS}")
    return DK


def recompute_precision(s_single: bool = False, merge: str = "fp32", ks_single: bool = False,
                        u_single: bool = False, chain_single: bool = False) -> Precision:
    """The backward's forward recompute: precision "recompute", with S one term where ``s_single``, S one term in
    K S where ``ks_single``, U stored as one term where ``u_single`` (its hi term: the same values, no lo table),
    X and F2 U one term where ``chain_single``, and prep's block merges in ``merge`` (``Precision.merge``)."""
    one = "bf16" if chain_single else "split"
    return replace(PRESETS["recompute"], s="bf16" if s_single else "split", merge=merge,
                   ks="bf16" if ks_single else "split", u="bf16" if u_single else "split", x=one, upd=one)


def keeps_tables(prec: Precision) -> bool:
    """Whether a forward at ``prec`` computes the backward's intra tables (Tinv, Ag hi + lo): Ag split, what
    ``gdn_bwd_prep`` computes (with the same merges: ``BackwardPlan.merge``)."""
    return prec.ag == "split"


def block_v(n_seq: int, HV: int, occ: int = 1, DK: int = KERNEL_HEAD_DIM) -> int:
    """Value columns per CTA of the sequential smem state kernel: the widest block that still gives about ``occ``
    CTAs per SM (N x HV x DK/BV CTAs), 16 at the least; with occ 2, 32 at the most (shared memory)."""
    for bv in ((64, 32) if occ == 1 else (32,)):
        if n_seq * HV * (DK // bv) >= N_SM * occ:
            return bv
    return 16


def cp_segments(n_seq: int, HV: int, max_chunks: int, DK: int = KERNEL_HEAD_DIM) -> int:
    """Segments per sequence of the segment-parallel (CP) state passing of the rv form, 1 = off: it pays when
    N x HV leaves most SMs idle and the sequences are long (>= CP_MIN_CHUNKS chunks per segment); phase 3 then
    has about N_SM CTAs."""
    ctas = n_seq * HV * (DK // RV_BV)
    if ctas >= 48 or max_chunks < 2 * CP_MIN_CHUNKS:
        return 1
    per = -(-N_SM // ctas)
    return max(1, min(16, per, max_chunks // CP_MIN_CHUNKS))


def ws_cp_segments(n_seq: int, HV: int, max_chunks: int, DK: int = KERNEL_HEAD_DIM) -> int:
    """Segments per sequence of the "ws" form's CP (1 = off) at ``WS_CP_BV`` value columns a CTA: where N x HV x
    DK/WS_CP_BV CTAs leave more than half the SMs idle, enough segments for about ``N_SM`` CTAs, each of at least
    ``CP_MIN_CHUNKS`` chunks, ``MAX_SEGMENTS`` at the most (the most that warm-up starts take)."""
    ctas = n_seq * HV * (DK // WS_CP_BV)
    if 2 * ctas > N_SM or max_chunks < 2 * CP_MIN_CHUNKS:
        return 1
    return max(1, min(MAX_SEGMENTS, -(-N_SM // ctas), max_chunks // CP_MIN_CHUNKS))


@lru_cache(maxsize=1024)
def forward_plan(dtype: str, n_seq: int, HV: int, max_chunks: int, keep_tables: bool = False,
                 DK: int = KERNEL_HEAD_DIM) -> ForwardPlan:
    """The forward's dispatch. At the head dims ``WS_HEAD_DIMS``: the ws form where blocks of at least 32 value
    columns give a CTA per SM (``block_v``; its sequences longest first, ``longest_first``), else the ws form at BV
    ``WS_CP_BV`` per CP segment where ``ws_cp_segments`` > 1 (with warm-up starts, ``warm``), P from the intra
    kernel's tables (``p_table``). At the others, the rv form with CP for at most ``CP_MAX_CTAS`` CTAs over at least
    ``CP_MIN_TOTAL_CHUNKS`` chunks (few heads, long sequences). Else the smem form without CP, two CTAs per SM when
    BV 32 gives two per SM (else one); precision "default"; ``keep_tables`` where the precision computes the
    backward's tables; every kernel built for the call's head dim ``DK`` (K == V), which also sets the CTA counts
    above. Cached per argument tuple (a call's host time)."""
    check_head_dim(DK)
    prec = preset()
    few = n_seq * HV * (DK // RV_BV) <= CP_MAX_CTAS and max_chunks >= CP_MIN_TOTAL_CHUNKS
    keep = keep_tables and keeps_tables(prec)
    if few and DK not in WS_HEAD_DIMS:
        return ForwardPlan(dtype, prec, "rv", RV_BV, 1, cp_segments(n_seq, HV, max_chunks, DK), keep, DK)
    bv = block_v(n_seq, HV, 1, DK)
    if bv >= 32 and DK in WS_HEAD_DIMS:
        return ForwardPlan(dtype, prec, "ws", bv, 1, 1, keep, DK, p_table=True, longest_first=True)
    cp = ws_cp_segments(n_seq, HV, max_chunks, DK) if DK in WS_HEAD_DIMS else 1
    if cp > 1:
        return ForwardPlan(dtype, prec, "ws", WS_CP_BV, 1, cp, keep, DK, p_table=True, warm=True)
    occ = 2 if block_v(n_seq, HV, 2, DK) == 32 else 1
    return ForwardPlan(dtype, prec, "smem", block_v(n_seq, HV, occ, DK), occ, 1, keep, DK)


@dataclass(frozen=True)
class BackwardPlan:
    """The backward kernels of one call.

    ``dh_segments``: the segment plan of the reverse pass (``dh_segmented.PlanTensors``; None = one sequential
    pass); ``dh_single``: dh's single operands (Tinv, dU and F0 dX one input-dtype term each: an A/B alternative,
    for the sequential pass only); else every operand split, Tinv's hi term alone where dh reads the forward's saved
    tables; ``reads_saved_tables``: prep takes Tinv and Ag from the forward when given;
    ``overlap_recompute``: the forward recompute runs on a side stream beside dh; ``recompute_block_v``,
    ``recompute_ctas_per_sm``: the recompute's smem state kernel; ``group``: value heads per q/k head (HV / H);
    ``cluster_group_sum``: dqk sums each group itself in a thread-block cluster (groups of 2, 4, 8), else groups
    of more than one value head are summed by ``gdn_bwd_group_sum``; ``s_single``: the recompute stores S's hi term
    alone and dqk reads it alone (no S lo table: an A/B alternative); ``merge``: prep's block merges where it
    computes Tinv, the forward's ``Precision.merge`` ("fp32", dispatched; "split" and "bf16", the A/B alternatives
    of a forward at that merge); ``lo8``: the lo terms of the S and dS' tables that dqk reads stored as fp8 under
    their hi terms' exponents (``kernels.common.lo8``; the split dh and S only); ``dh_ws_bv``: dh's warp-specialised
    key-first kernel (``backward/dh_ws.py``) at this many value columns a CTA, 0: the value-first register kernel
    (64 columns); ``recompute_cp``: segments per sequence of the recompute (1: one sequential pass; more: the
    forward's exact CP scan and fp64 fix-up on prep's tables give every segment its start state, then the state
    kernel runs per segment, ``recompute_cp_plan``); ``shared_scan`` (with ``dh_segments``): one forward CP scan
    over dh's segments gives dh's transfer maps (its pass B) and the recompute's start states, and the recompute
    runs on dh's segments whatever ``recompute_cp`` says; ``ks_single``: the recompute's K S products take S's hi
    term alone (the A/B alternative of precision "recompute", which splits S there); ``recompute_ws``: the
    recompute's state kernel in the forward's warp-specialised form storing the same tables (``StateConfig.tables``:
    the chain in one warpgroup, the table stores in another; dispatched at the head dims of ``WS_HEAD_DIMS``,
    the smem form the A/B alternative); ``dqk_e_once``: dqk forms the intra terms' ``e^(G_t - G_j)`` once a chunk
    instead of at each of its four uses (the same values; at ``DQK_E_ONCE_HEAD_DIM``); ``DK``: the head dim K == V
    every kernel is built for; ``dqk_exp_mask``: dqk widens its fp8 lo tiles with a masked power of two
    (``lo8_value(masked=True)``: the same values in fewer instructions; at ``DQK_E_ONCE_HEAD_DIM``, where
    ``lo8``); ``one_term``: dh_ws and dqk with every table and operand one input-dtype term (the dS', dY tables hi
    alone, dqk reading S, U, dS', dY hi alone: an A/B alternative; with ``dh_single``, ``s_single``, the sequential
    warp-specialised dh and no fp8 lo tables), kept in range by powers of two: v, dO per GVA group
    (``gdn_bwd_convert``, ``backward.scales``) and dh's F1 dO, F0 dX per chunk; ``io_dtype``: the caller's dtype
    where the kernels' (``dtype``) is another (with ``one_term``: q, k, v, dO converted by ``gdn_bwd_convert``, dv,
    dq, dk stored in it); ``dh_warm`` (read with ``dh_segments``): the segmented pass in one launch, each segment
    from its warm-up chunks after its end or from its sequence's end (``gdn_bwd_dh_warm``), instead of three passes
    and the end-gradient scan; ``recompute_warm`` (read with ``dh_segments``, with ``recompute_ws``, without
    ``shared_scan``): the recompute on dh's segments, each from its warm-up chunks before its start or from its
    sequence's start (``gdn_state_tables_ws_warm``), without a CP scan or fix-up; ``fused`` (with ``one_term`` on
    fp16 operands): dh and dqk as one warp-specialised kernel after the recompute (``backward/fused.py``: dUloc
    from one fp16 term of P, no dS' or dY tables; dispatched where ``dispatches_fused``); ``fused_warm`` (read with
    ``fused``): the fused kernel over the reverse pass's CP segments at one CTA per (value head, segment) where the
    call's layout has them (its warm form ``gdn_bwd_fused_warm``), else one pass per sequence; ``fused_exact`` (read with
    ``fused``, not with ``fused_warm``): the same segments from exact end gradients: the chain form from zero end
    gradients (``gdn_bwd_fused_chain``), the forward CP scan's maps over the segments and the fp64 walk
    (``dh_segmented.end_gradients``), then the one-pass form over the segments; ``fused_segments``: those segments
    (``dh_segmented.PlanTensors``), set by the pipeline for the call's layout where ``fused_warm`` or
    ``fused_exact`` (None: one pass); ``fused_dq16`` (read with ``fused``): the fused kernel stores dq~ and dk~ in
    fp16 under the GVA group scales (half the bytes) and the group sums' scaled form applies the factors, for groups
    of one value head too (dispatched with ``fused``); ``recompute_one`` (read with ``one_term``): the recompute's K S,
    X and F2 U products one term (the emulation's ``RECOMPUTE_ONE``; dispatched with ``fused``); ``prep_converts`` (read
    with ``fused``): prep's converting form does ``gdn_bwd_convert``'s work on the chunks it reads (its ``io``
    config), so that no conversion pass runs (dispatched with ``fused``); ``longest_first`` (read by the fused kernel's
    one pass and by the recompute's ws tables form in one pass): those kernels issue their sequences' CTAs longest
    first (``ForwardInputs.seq_order``), else in index order (dispatched with ``fused``: on a ragged batch the long
    sequences otherwise start last and set the kernel's time); ``split``: on a dispatched fused plan, the
    split plan ``backward_plan`` gives the same call otherwise (the A/B baseline there; it reads the forward's
    tables), else None."""
    dtype: str
    dh_segments: object = field(default=None, compare=False)
    dh_single: bool = False
    reads_saved_tables: bool = True
    overlap_recompute: bool = False
    recompute_block_v: int = 64
    recompute_ctas_per_sm: int = 1
    group: int = 1
    cluster_group_sum: bool = False
    s_single: bool = False
    merge: str = "fp32"
    lo8: bool = False
    dh_ws_bv: int = 0
    DK: int = KERNEL_HEAD_DIM
    recompute_cp: int = 1
    shared_scan: bool = False
    ks_single: bool = False
    recompute_ws: bool = False
    dqk_e_once: bool = False
    dqk_exp_mask: bool = False
    one_term: bool = False
    io_dtype: str = ""
    dh_warm: bool = False
    recompute_warm: bool = False
    fused: bool = False
    fused_warm: bool = False
    fused_exact: bool = False
    fused_dq16: bool = False
    prep_converts: bool = False
    recompute_one: bool = False
    longest_first: bool = False
    fused_segments: object = field(default=None, compare=False)
    split: object = field(default=None, compare=False)

    def __post_init__(self):
        check_head_dim(self.DK)
        if self.recompute_ws and (self.recompute_ctas_per_sm != 1 or self.DK not in WS_HEAD_DIMS
                                  or self.recompute_block_v not in (16, 32, 64)):
            raise ValueError(f"recompute_ws: one CTA per SM, 16, 32 or 64 value columns, at the head dims "
                             f"{WS_HEAD_DIMS}; got recompute_ctas_per_sm={self.recompute_ctas_per_sm}, "
                             f"recompute_block_v={self.recompute_block_v}, DK={self.DK}")
        if not 1 <= self.recompute_cp <= MAX_SEGMENTS:
            raise ValueError(f"recompute_cp counts segments per sequence, 1 to {MAX_SEGMENTS}, got {self.recompute_cp}")
        if self.shared_scan and self.dh_segments is None:
            raise ValueError("shared_scan runs the forward's CP scan over dh's segments: it needs dh_segments")
        if self.dh_ws_bv not in (0, *DH_WS_BLOCKS):
            raise ValueError(f"dh_ws_bv must be 0 or one of {DH_WS_BLOCKS}, got {self.dh_ws_bv}")
        if self.cluster_group_sum and self.group not in CLUSTER_GROUPS:
            raise ValueError(f"cluster group sums need HV / H in {CLUSTER_GROUPS}, got {self.group}")
        if self.dh_segments is not None and self.dh_single:
            raise ValueError("the segmented reverse pass runs every operand split (dh_single False)")
        if (self.dqk_exp_mask or self.dqk_e_once) and self.DK != DQK_E_ONCE_HEAD_DIM:
            raise ValueError(f"dqk_e_once and dqk_exp_mask: forms of dqk at DK={DQK_E_ONCE_HEAD_DIM}; "
                             f"got DK={self.DK}")
        if self.one_term and not (self.dh_single and self.s_single and self.dh_ws_bv and not self.lo8
                                  and self.dh_segments is None and self.DK == DQK_E_ONCE_HEAD_DIM):
            raise ValueError(f"one_term: dh_single, s_single, the sequential dh_ws, no fp8 lo tables, at "
                             f"DK={DQK_E_ONCE_HEAD_DIM}; got {self}")
        if self.fused_warm and self.fused_exact:
            raise ValueError("fused_warm and fused_exact: two forms of the fused kernel's segments, one at a time")
        if self.fused and not (self.one_term and self.dtype == "float16"):
            raise ValueError(f"fused: the one-term backward on fp16 operands (one_term, dtype float16); got {self}")
        if self.io_dtype and not (self.one_term and self.io_dtype != self.dtype):
            raise ValueError(f"io_dtype: the caller's dtype where the one-term kernels' is another; got {self}")
        if self.lo8 and (self.dh_single or self.s_single):
            raise ValueError("lo8 (fp8 lo tables) is a form of the split dh and S tables (dh_single, s_single False)")
        if self.recompute_on_warm_segments and (not self.recompute_ws or self.shared_scan):
            raise ValueError(f"recompute_warm: the recompute's ws tables form from warm-up chunks, not from the shared "
                             f"scan's start states (recompute_ws, shared_scan False); got {self}")
        if self.segmented_warm and self.dh_ws_bv:
            raise ValueError(f"dh_warm: the segmented pass of the register dh (dh_ws_bv 0; dh_warm False runs the "
                             f"three passes); got {self}")

    def recompute_configs(self) -> tuple:
        """(intra, state[, scan, fix-up]) of the forward recompute at precision "recompute" (S and U hi + lo,
        key-first; S hi alone with ``s_single``; U hi alone with ``one_term``, whose kernels read no U lo; K S, X and
        F2 U one term with ``recompute_one``), the S lo tile swizzled where it is only stored (in the input dtype, not
        read by K S; fp8 with ``lo8``); the CP scan and fix-up of ``recompute_cp_plan`` when ``recompute_cp > 1`` or
        ``shared_scan``.  Built once per combination of the fields they depend on (a call's host time)."""
        warm = self.recompute_on_warm_segments
        cp = max(2, self.recompute_cp) if (self.recompute_cp > 1 or self.shared_scan) and not warm else 0
        one = self.recompute_one and self.one_term
        return _recompute_configs(self.dtype, self.DK, self.s_single, self.merge, self.ks_single or one, cp,
                                  self.recompute_ws, self.recompute_block_v, self.recompute_ctas_per_sm, self.lo8,
                                  warm, self.one_term, one)

    def recompute_cp_plan(self) -> ForwardPlan:
        """The forward plan whose scan and fp64 fix-up (exact: ``segment_starts``; they read the state kernel's
        operands Ag hi + lo and the gate table's rows 0-3, as prep stores them) the recompute runs per segment from:
        precision "default", ``recompute_cp`` segments (2 at the least: with ``shared_scan`` the segments are dh's,
        the count unread)."""
        return ForwardPlan(self.dtype, preset(), "rv", RV_BV, 1, max(2, self.recompute_cp), DK=self.DK)

    def prep_config(self, saved: bool) -> BwdConfig:
        """prep's form; ``saved``: on the forward's Tinv and Ag (and then the chunks' bounds for the warm segmented
        pass); computing Tinv: without dUloc^T for the fused kernel, and Tinv's hi term alone for the one-term plans
        (their kernels read no Tinv lo); converting the inputs where ``converts_in_prep``."""
        return BwdConfig("prep", self.dtype, self.DK, saved=saved, merge="bf16" if saved else self.merge,
                         bounds=saved and (self.segmented_warm or self.recompute_on_warm_segments),
                         no_du=self.fused and not saved, tinv_hi=self.one_term and not saved,
                         io=(self.io_dtype or self.dtype) if self.converts_in_prep and not saved else "")

    @property
    def converts_in_prep(self) -> bool:
        """Whether prep's converting form replaces ``gdn_bwd_convert`` (``prep_converts`` on the fused plan)."""
        return self.prep_converts and self.fused

    @property
    def takes_saved_tables(self) -> bool:
        """Whether prep takes Tinv and Ag from the forward where given (``reads_saved_tables``): the sequential pass
        and the warm segmented one; the three passes (``dh_warm`` off) compute them, Tinv's lo term included."""
        return self.reads_saved_tables and (self.dh_segments is None or self.dh_warm)

    def dh_config(self, saved: bool) -> BwdConfig:
        """dh's form; ``saved``: prep took Tinv from the forward (its hi term alone)."""
        return BwdConfig("dh", self.dtype, self.DK, single=self.dh_single, tinv_hi=saved and not self.dh_single,
                         lo8=self.lo8, ws_bv=self.dh_ws_bv, one=self.one_term, io=self.io_dtype,
                         warm=self.segmented_warm)

    @property
    def segmented_warm(self) -> bool:
        """Whether dh runs as the warm segmented pass (``dh_warm`` with ``dh_segments``)."""
        return self.dh_warm and self.dh_segments is not None

    @property
    def recompute_on_warm_segments(self) -> bool:
        """Whether the recompute runs per dh segment from warm-up chunks (``recompute_warm`` with
        ``dh_segments``)."""
        return self.recompute_warm and self.dh_segments is not None

    def dqk_config(self) -> BwdConfig:
        return BwdConfig(f"dqk_g{self.group}" if self.cluster_group_sum else "dqk", self.dtype, self.DK,
                         s_single=self.s_single, lo8=self.lo8, e_once=self.dqk_e_once,
                         exp_mask=self.dqk_exp_mask and self.lo8, one=self.one_term, io=self.io_dtype)

    def fused_config(self, warm: bool | None = None) -> BwdConfig:
        """The fused kernel of dh and dqk (``fused``): fp16 operands, dv in ``io_dtype`` (else fp16); its warm form
        where ``warm`` (default: where the plan has ``fused_segments``)."""
        warm = self.fused_segments is not None and self.fused_warm if warm is None else warm
        return BwdConfig(FUSED_KIND, self.dtype, self.DK, one=True, io=self.io_dtype, warm=warm, dq16=self.fused_dq16)

    def fused_chain_config(self) -> BwdConfig:
        """The fused kernel's chain form (``fused_exact``'s pass A)."""
        return BwdConfig(FUSED_KIND, self.dtype, self.DK, one=True, io=self.io_dtype, chain=True,
                         dq16=self.fused_dq16)

    def convert_config(self) -> BwdConfig | None:
        """``gdn_bwd_convert`` of a one-term plan: v and dO scaled, q, k, v, dO from ``io_dtype`` (if any); None
        where prep does that work (``converts_in_prep``)."""
        return (BwdConfig(CONVERT_KIND, self.dtype, self.DK, io=self.io_dtype or self.dtype)
                if self.one_term and not self.converts_in_prep else None)

    def amax_config(self) -> BwdConfig | None:
        """``gdn_bwd_amax`` of a one-term plan (the inputs' dtype)."""
        return BwdConfig(AMAX_KIND, self.io_dtype or self.dtype, self.DK) if self.one_term else None

    def dgdb_config(self) -> BwdConfig:
        return BwdConfig("dgdb", "float32", self.DK)

    def group_sum_config(self, fp32: bool) -> BwdConfig | None:
        """``gdn_bwd_group_sum`` to fp32 or the input dtype where dqk leaves per-value-head rows of a group (the
        fused kernel's: ``fused_group_sum_config``)."""
        if self.group == 1 or self.cluster_group_sum:
            return None
        return BwdConfig("gsum32" if fp32 else "gsum", self.dtype, self.DK)

    def fused_group_sum_config(self, fp32: bool) -> BwdConfig | None:
        """The fused kernel's GVA group sums (``fused``, groups of more than one value head; every group with
        ``fused_dq16``, their scaled form): to fp32 where the host still chains the L2 norm (``fp32``), else to the
        caller's dtype (``io_dtype``, or the kernels'): the final dq, dk in one pass."""
        if self.group == 1 and not self.fused_dq16:
            return None
        return (BwdConfig("gsum32", self.dtype, self.DK, dq16=self.fused_dq16) if fp32
                else BwdConfig("gsum", self.io_dtype or self.dtype, self.DK, dq16=self.fused_dq16))

    def configs(self, with_saved: bool) -> tuple:
        """Every kernel configuration the call runs (``with_saved``: prep on the forward's tables); with
        ``fused_warm`` or ``fused_exact`` the fused kernel's segmented forms too, since the call's layout decides
        whether they run."""
        out = list(self.recompute_configs()[1:])
        saved = with_saved and self.takes_saved_tables
        fused = ((self.fused_config(False),) + ((self.fused_config(True),) if self.fused_warm else ())
                 + ((self.fused_chain_config(), *self.recompute_cp_plan().configs()[-2:]) if self.fused_exact
                    else ()))
        out += [self.prep_config(saved), *(fused if self.fused else (self.dh_config(saved), self.dqk_config())),
                self.dgdb_config()]
        sums = ((self.fused_group_sum_config(True), self.fused_group_sum_config(False)) if self.fused
                else (self.group_sum_config(True), self.group_sum_config(False)))
        out += [c for c in (*sums, self.convert_config(), self.amax_config()) if c is not None]
        if (self.dh_segments is not None and not self.segmented_warm
                and FixupConfig(self.DK) not in out):                           # the segmented pass's end walk
            out.append(FixupConfig(self.DK))
        return tuple(out)


def dispatches_fused(dtype: str, HV: int, n_seq: int, DK: int) -> bool:
    """Whether ``backward_plan`` gives the fused one-term plan (``ONE_TERM_FIELDS`` with ``fused``): bf16 inputs
    (``dtype``, the inputs' kernel dtype), ``DK == DQK_E_ONCE_HEAD_DIM``, and at least ``FUSED_MIN_CTAS`` (value
    head, sequence) pairs, so that its one pass fills the GPU.  It reads no tables of the forward."""
    return dtype == "bfloat16" and DK == DQK_E_ONCE_HEAD_DIM and n_seq * HV >= FUSED_MIN_CTAS


def backward_plan(dtype: str, H: int, HV: int, n_chunks: int, n_seq: int, dh_segments=None,
                  DK: int = KERNEL_HEAD_DIM, max_chunks: int | None = None) -> BackwardPlan:
    """The backward's dispatch: ``dh_segments`` (``dh_segmented.plan``'s tensors, or None) from the caller, who
    owns the layout cache; dh with every operand split; the sequential pass and the warm segmented one read the
    forward's saved tables (Tinv's hi term alone); the
    recompute beside dh from ``OVERLAP_MIN_CHUNK_HEADS`` (chunk, value head) pairs; its state kernel at the
    forward's ``block_v`` (one CTA per SM), warp-specialised (``recompute_ws``) at the head dims of
    ``WS_HEAD_DIMS``; dqk's gates formed once and its masked widening (``dqk_e_once``, ``dqk_exp_mask``) at
    ``DQK_E_ONCE_HEAD_DIM``; cluster group sums for groups of 2, 4, 8; prep's merges in fp32, as the
    forward's; the S and dS' lo tables in fp8 (``lo8``); the sequential dh warp-specialised at 32 value columns a
    CTA where those CTAs fit one wave (``DH_WS_MAX_CTAS``; at the head dims of ``WS_HEAD_DIMS``, where it was
    measured), else the register kernel; the recompute per segment (``recompute_cp``: ``ws_cp_segments`` of the
    longest sequence's ``max_chunks``, default ``n_chunks / n_seq``, at ``WS_CP_BV`` value columns a CTA) where
    even 16-column blocks of one pass leave SMs idle; with the segmented reverse pass its warm form (``dh_warm``:
    one launch, each segment from its warm-up chunks) and the recompute on dh's segments at ``WS_CP_BV`` columns,
    from its own warm-up chunks at the head dims of ``WS_HEAD_DIMS`` (``recompute_warm``), else from the shared
    scan's start states (``shared_scan``); every kernel built for the call's head dim ``DK`` (K == V).  Where
    ``dispatches_fused``: that plan with ``ONE_TERM_FIELDS``, ``fused`` (dh and dqk in one kernel), ``fused_dq16``
    (dq~, dk~ in fp16; their GVA sums by ``gdn_bwd_group_sum_scaled``: ``cluster_group_sum`` off),
    ``prep_converts`` (no conversion pass), ``recompute_one`` (the recompute's K S, X and F2 U one term) and
    ``longest_first`` (the fused kernel's and its recompute's sequences issued longest first)."""
    check_head_dim(DK)
    seq = dh_segments is None
    group = HV // H
    ws = 32 if seq and DK in WS_HEAD_DIMS and n_seq * HV * (DK // 32) <= DH_WS_MAX_CTAS else 0
    rbv, rcp = block_v(n_seq, HV, 1, DK), 1
    if n_seq * HV * (DK // 16) < N_SM:
        rcp = ws_cp_segments(n_seq, HV, n_chunks // max(n_seq, 1) if max_chunks is None else max_chunks, DK)
    rbv = WS_CP_BV if rcp > 1 or not seq else rbv
    plan = BackwardPlan(dtype, dh_segments, dh_single=False, reads_saved_tables=True, dh_ws_bv=ws,
                        recompute_ws=DK in WS_HEAD_DIMS, dqk_e_once=DK == DQK_E_ONCE_HEAD_DIM,
                        dqk_exp_mask=DK == DQK_E_ONCE_HEAD_DIM,
                        overlap_recompute=n_chunks * HV >= OVERLAP_MIN_CHUNK_HEADS,
                        recompute_block_v=rbv, recompute_ctas_per_sm=1, group=group,
                        cluster_group_sum=group in CLUSTER_GROUPS, lo8=True, DK=DK, recompute_cp=rcp,
                        shared_scan=not seq and DK not in WS_HEAD_DIMS, dh_warm=not seq,
                        recompute_warm=not seq and DK in WS_HEAD_DIMS)
    if dispatches_fused(dtype, HV, n_seq, DK):
        return replace(plan, **ONE_TERM_FIELDS, fused=True, fused_dq16=True, prep_converts=True,
                       recompute_one=True, longest_first=True, cluster_group_sum=False, split=plan)
    return plan
