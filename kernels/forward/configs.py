"""Configurations of the forward kernels (sm_90a) and their TileLang functions; compiled by ``kernels.build``.

Everything here imports tilelang lazily, so importing this module is cheap and works without tilelang / CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)          # K == V: each kernel is built for the call's head dim (its configuration's DK)
KERNEL_HEAD_DIM = 128          # the configurations' default DK
OUT_CPB = 8                    # chunks per CTA of the output kernel (pipelined TMA loads)
RV_BV = 64                     # value columns per warpgroup of the register-operand state kernel (wgmma M)
SCAN_BV = 128                  # rows of [Z^T; M^T] per CTA of the CP scan (at most DK): two warpgroups, one load
NUM_STAGES = 2                 # software pipelining depth of the sequential kernels' chunk loads
STATE_FORMS = ("rv", "smem", "ws")   # register-operand (value-first tables) / shared-memory-operand (key-first) state
#                                      / the latter's products with o, warp-specialised (no chunk tables)


@dataclass(frozen=True)
class IntraConfig:
    """``gdn_intra`` (intra_chunk.py): ``merge`` "fp32" (CUDA cores), "bf16" or "split" (wgmma operands);
    ``th``: it also stores Tinv in the input dtype for the backward; ``pt``: the gated scores P (hi + lo; one fp16 term
    with ``ag="fp16"``) for the fused state-output kernel."""
    dtype: str
    merge: str = "bf16"
    ag: str = "bf16"
    DK: int = KERNEL_HEAD_DIM
    th: bool = False
    pt: bool = False

    @property
    def name(self) -> str:
        th = ",th" if self.th else ""
        pt = ",pt" if self.pt else ""
        return f"intra[DK={self.DK},merge={self.merge},ag={self.ag}{th}{pt},{self.dtype}]"


@dataclass(frozen=True)
class StateConfig:
    """The sequential state kernel (or, with ``scan``, the CP phase-1 scan): ``form`` "rv" (state_registers.py, BV
    64 / 128), "ws" (state_output_ws.py, o computed beside the chain) or "smem" (state_smem.py, ``ctas_per_sm`` 1
    or 2, ``sl_swizzle``: the S lo staging tile swizzled, the backward recompute's form; ``lo8``: S's lo term
    stored as fp8 (``kernels.common.lo8``), the backward recompute's form; ``pt``: the "ws" form reading P from
    the intra kernel's tables instead of computing it; ``warm``: the "ws" form per CP segment and the CP scan with
    the warm-up starts of ``cp_warm``; ``tables``: the "ws" form storing the smem form's chunk tables instead of o,
    with the smem form's arguments, the backward recompute's form, ``lo8`` allowed; with ``warm``, per segment of
    the segmented reverse pass from warm-up chunks or its sequence's start, on prep's chunk bounds); ``split``:
    "warm" / "exact", the "ws" form's two kernels of ``ForwardPlan.split_heads`` (``state_output_ws``), "" none)."""
    dtype: str
    BV: int
    prec: object                   # precision.Precision (frozen, hashable)
    scan: bool = False
    form: str = "rv"
    DK: int = KERNEL_HEAD_DIM
    num_stages: int = NUM_STAGES
    ctas_per_sm: int = 1
    sl_swizzle: bool = False
    lo8: bool = False
    pt: bool = False
    warm: bool = False
    tables: bool = False
    split: str = ""

    @property
    def name(self) -> str:
        kind = ("scan" if self.scan else "state") + "_" + self.form
        occ = f",occ{self.ctas_per_sm}" if self.ctas_per_sm != 1 else ""
        slz = ",slz" if self.sl_swizzle else ""
        lo8 = ",lo8" if self.lo8 else ""
        pt = ",pt" if self.pt else ""
        warm = ",warm" if self.warm else ""
        tables = ",tables" if self.tables else ""
        split = f",split={self.split}" if self.split else ""
        return (f"{kind}[DK=DV={self.DK},BV={self.BV},{self.prec.tag()},stages={self.num_stages}{occ}{slz}{lo8}{pt}"
                f"{warm}{tables}{split},{self.dtype}]")


@dataclass(frozen=True)
class OutputConfig:
    """``gdn_output`` (output.py): ``cpb`` chunks per CTA in a pipelined loop; ``vt``: value-first tables
    (from the "rv" state kernel)."""
    dtype: str
    prec: object
    BV: int = KERNEL_HEAD_DIM
    vt: bool = True
    DK: int = KERNEL_HEAD_DIM
    cpb: int = OUT_CPB

    @property
    def name(self) -> str:
        return (f"output[DK=DV={self.DK},BV={self.BV},{self.prec.tag()},{'vt' if self.vt else 'kt'},cpb={self.cpb},"
                f"{self.dtype}]")


@dataclass(frozen=True)
class FixupConfig:
    """``gdn_cp_fixup`` (cp_fixup.py): the CP segment start states in fp64, after the rv scan (no dtype: fp32
    in and out); ``warm``: only those that the warm-up starts of ``cp_warm`` leave."""
    DK: int = KERNEL_HEAD_DIM
    warm: bool = False

    @property
    def name(self) -> str:
        return f"cp_fixup[DK=DV={self.DK}{',warm' if self.warm else ''}]"


def output_block_v(prec, DK: int = KERNEL_HEAD_DIM) -> int:
    """Value columns per CTA of the output kernel: all ``DK``, or at most 64 when the chunk-start state is split
    (at DK 128, two 32 KB state tiles per stage would not fit twice in shared memory)."""
    return min(64, DK) if prec.s == "split" else DK


def prim_func(cfg):
    """The TileLang function of ``cfg``."""
    if isinstance(cfg, IntraConfig):
        from .intra_chunk import build_intra_chunk
        return build_intra_chunk(cfg.DK, cfg.dtype, cfg.merge, cfg.ag, cfg.th, cfg.pt)
    if isinstance(cfg, StateConfig):
        if cfg.split and cfg.form != "ws":
            raise ValueError(f"split (ForwardPlan.split_heads) is a form of the ws kernel: {cfg!r}")
        if cfg.tables and (cfg.form != "ws" or cfg.scan or cfg.pt or cfg.split):
            raise ValueError(f"tables (the chunk tables instead of o) is a form of the ws kernel without P tables or "
                             f"split heads: {cfg!r}")
        if cfg.form == "rv":
            if cfg.sl_swizzle or cfg.lo8 or cfg.pt or (cfg.warm and not cfg.scan):
                raise ValueError(f"sl_swizzle and lo8 are forms of the smem state kernel, P tables of the ws form, "
                                 f"warm-up starts of the ws form and the scan, not of the rv form: {cfg!r}")
            from .state_registers import build_state_registers
            return build_state_registers(cfg.DK, cfg.DK, cfg.dtype, cfg.prec, cfg.num_stages, cfg.scan, cfg.BV,
                                         cfg.warm)
        if cfg.scan:
            raise ValueError(f"the CP scan is a form of the rv state kernel, not of the smem form: {cfg!r}")
        if cfg.form == "ws":
            if cfg.sl_swizzle or (cfg.lo8 and not cfg.tables) or cfg.ctas_per_sm != 1:
                raise ValueError(f"sl_swizzle, two CTAs per SM and (but with tables) lo8 are forms of the smem state "
                                 f"kernel: {cfg!r}")
            from .state_output_ws import build_state_output_ws
            return build_state_output_ws(cfg.DK, cfg.DK, cfg.BV, cfg.dtype, cfg.prec, cfg.pt, cfg.warm, cfg.tables,
                                         cfg.lo8, cfg.split)
        if cfg.pt or cfg.warm:
            raise ValueError(f"P tables and warm-up starts are forms of the ws kernel alone: {cfg!r}")
        from .state_smem import build_state_smem
        return build_state_smem(cfg.DK, cfg.DK, cfg.BV, cfg.dtype, cfg.prec, cfg.num_stages, cfg.ctas_per_sm,
                                cfg.sl_swizzle, cfg.lo8)
    if isinstance(cfg, FixupConfig):
        from .cp_fixup import build_cp_fixup
        return build_cp_fixup(cfg.DK, cfg.warm)
    if isinstance(cfg, OutputConfig):
        from .output import build_output
        return build_output(cfg.DK, cfg.DK, cfg.dtype, cfg.prec, cfg.BV, cfg.vt, cfg.cpb, NUM_STAGES)
    raise TypeError(f"not a forward kernel configuration: {cfg!r}")
