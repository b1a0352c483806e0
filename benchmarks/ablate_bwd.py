"""Where a backward kernel spends its time: the kernel as the API runs it against copies built without one of its
parts, all timed in one run on the same random chunk tables (values do not matter for the time; the ablated
kernels' outputs are wrong).  ``--kernel inter``: ``dqk.build_bwd_dqk_inter(_ablate=...)`` (``dqk.ABLATIONS``);
``--kernel intra``: ``dqk.build_bwd_dqk_intra(_ablate=...)`` (``dqk.INTRA_ABLATIONS``); ``--kernel dh``:
``dh.build_bwd_dh(_ablate=...)`` (``dh.DH_ABLATIONS``); ``--kernel dqk``: the fused kernel,
``dqk_fused.build_bwd_dqk_fused(_ablate=...)`` (``dqk_fused.ABLATIONS``); ``--kernel prep``:
``prep.build_bwd_prep(_ablate=...)`` (``prep.PREP_ABLATIONS``).  Some switches are candidate forms with the API kernel's
results rather than ablations (intra "rmw", dh "st_direct" and "st_wait", inter "sd_scalar": the forms
before): their line is the A/B of the change (sessions 8 and 10).
Session 7 ran it (as ``ablate_bwd_inter.py``, the inter kernel alone) to find the inter kernel's row dots: 7.0 ->
3.2 ms.

    python3 benchmarks/ablate_bwd.py [--kernel inter|intra|dh|dqk|prep] [--shape B1_T32768_H16_HV32] [--rep 20] [--warmup 3]
        [--only st_wait,no_lo]

Prints one line per variant: median ms and the ratio to the API's kernel.  CUDA only (sm_90a).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VARIANTS = {}
VARIANTS["inter"] = {
    "api": (),
    "sd_reduce (session 6)": ("sd_reduce",),
    "no_sd": ("no_sd",),
    "no_yv": ("no_yv",),
    "no_dots": ("no_dots",),
    "no_lo": ("no_lo",),
    "gemms+stores only": ("no_sd", "no_yv", "no_dots"),
    "hi gemms+stores only": ("no_sd", "no_yv", "no_dots", "no_lo"),
    "no_store": ("no_store",),
    "hi gemms only (loads)": ("no_sd", "no_yv", "no_dots", "no_lo", "no_store"),
    "sd_scalar (call 3's S o dS' dots)": ("sd_scalar",),
}
VARIANTS["intra"] = {
    "api": (),
    "no_mlo": ("no_mlo",),
    "no_rect": ("no_rect",),
    "no_db2": ("no_db2",),
    "store (no read-modify-write)": ("store",),
    "all four": ("no_mlo", "no_rect", "no_db2", "store"),
    "rmw (session 7's add)": ("rmw",),
}
VARIANTS["dh"] = {
    "api": (),
    "no_ds_store": ("no_ds_store",),
    "no_dy_store": ("no_dy_store",),
    "no_dv": ("no_dv",),
    "no_lo": ("no_lo",),
    "no stores": ("no_ds_store", "no_dy_store", "no_dv"),
    "no stores, no lo": ("no_ds_store", "no_dy_store", "no_dv", "no_lo"),
    "st_direct (session 7's table stores)": ("st_direct",),
    "st_wait (session 8's table stores, each waited for)": ("st_wait",),
    "dul_plain (dUloc^T and dO tiles unswizzled, session 10)": ("dul_plain",),
}
VARIANTS["dqk"] = {
    "api": (),
    "no_sd": ("no_sd",),
    "no_dots": ("no_dots",),
    "no_lo": ("no_lo",),
    "no_rect": ("no_rect",),
    "no_intra": ("no_intra",),
    "no_inter_gemm": ("no_inter_gemm",),
    "no_store": ("no_store",),
    "loads + folds + stores": ("no_sd", "no_dots", "no_inter_gemm", "no_intra"),
    "loads + folds": ("no_sd", "no_dots", "no_inter_gemm", "no_intra", "no_store"),
    "grid_hc (head-major grid)": ("grid_hc",),
    "dots_whole (row dots over whole rows, batched all-reduces)": ("dots_whole",),
    "dots_b1 (row dots over whole rows, one row at a time)": ("dots_b1",),
    "rect_64 (the dg rectangle walk by 64 threads)": ("rect_64",),
}
VARIANTS["prep"] = {
    "api": (),
    "no_dul": ("no_dul",),
    "no_solve": ("no_solve",),
    "no_tstore": ("no_tstore",),
    "no_dul, no_tstore": ("no_dul", "no_tstore"),
    "gate table + K K^T only": ("no_dul", "no_solve", "no_tstore"),
}
SHAPES = {"B1_T32768_H16_HV32": (1, 32768, 16, 32), "B1_T8192_H4_HV8": (1, 8192, 4, 8)}


@dataclass(frozen=True)
class Variant:
    kernel: str                     # "inter", "intra", "dh", "dqk" or "prep"
    ablate: tuple[str, ...]
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"bwd_{self.kernel}[{'+'.join(self.ablate) or 'api'},{self.dtype}]"


def compile_variant(cfg: Variant):
    """The compiled kernel of one variant (a top-level function: ``precompile``'s processes call it)."""
    import tilelang

    from kernels.gdn_bwd.build import TARGET, pass_configs
    from kernels.gdn_bwd.dh import build_bwd_dh
    from kernels.gdn_bwd.dqk import build_bwd_dqk_inter, build_bwd_dqk_intra
    from kernels.gdn_bwd.dqk_fused import build_bwd_dqk_fused
    from kernels.gdn_bwd.prep import build_bwd_prep
    build = {"inter": build_bwd_dqk_inter, "intra": build_bwd_dqk_intra, "dh": build_bwd_dh,
             "dqk": build_bwd_dqk_fused, "prep": build_bwd_prep}[cfg.kernel]
    return tilelang.compile(build(128, 128, cfg.dtype, _ablate=frozenset(cfg.ablate)),
                            target=TARGET, pass_configs=pass_configs())


def tables(B, T, H, HV, dev, dt=torch.bfloat16, kernel="inter"):
    """Random inputs of the inter (intra, dh) kernel at one shape, in the argument order of its build function."""
    from kernels.gdn_fwd.api import _call_tables
    _, (cu, chunk_indices, chunk_offsets, NC) = _call_tables(B, T, None, dev)
    D, Ttot = 128, B * T
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, s=0.1):
        return (torch.randn(*shape, device=dev, generator=g) * s).to(dt)

    Fb = torch.rand(HV, NC, 8, 64, device=dev, generator=g)
    Fb[:, :, 4] = -torch.cumsum(Fb[:, :, 4] * 0.05, -1)          # G <= 0, decreasing
    f32 = dict(device=dev, dtype=torch.float32)
    if kernel == "prep":
        gg = -0.05 * torch.rand(Ttot, HV, device=dev, generator=g)
        return [r(Ttot, H, D), r(Ttot, H, D), r(Ttot, HV, D), gg, torch.rand(Ttot, HV, device=dev, generator=g),
                cu, chunk_indices] + [torch.empty(HV, NC, 64, 64, device=dev, dtype=dt) for _ in range(4)] + [
                torch.empty(HV, NC, 8, 64, **f32), torch.empty(HV, NC, D, 64, **f32), D ** -0.5, 0]
    if kernel == "dh":
        Fb[:, :, 3] = torch.exp(Fb[:, :, 4, -1:])                 # e^GL: the gradient decays, stays finite
        return [r(Ttot, H, D), r(Ttot, H, D), r(Ttot, HV, D), r(HV, NC, 64, 64), r(HV, NC, 64, 64, s=1e-3), Fb,
                torch.randn(HV, NC, D, 64, generator=g, **f32).mul_(0.1), cu, chunk_offsets,
                torch.zeros(1, HV, D, D, **f32), r(HV, NC, D, D), r(HV, NC, D, D), r(HV, NC, D, 64), r(HV, NC, D, 64),
                r(Ttot, HV, D), torch.zeros(B, HV, D, D, **f32), 0, 1, 0]
    if kernel == "dqk":          # the fused kernel, dq~ / dk~ stored fp32 per value head (the API's path for GVA)
        dq32 = torch.zeros(Ttot, HV, D, **f32)
        return [r(Ttot, H, D), r(Ttot, H, D), r(Ttot, HV, D), r(Ttot, HV, D),
                r(HV, NC, D, D), r(HV, NC, D, D, s=1e-3), r(HV, NC, 64, D), r(HV, NC, 64, D, s=1e-3),
                r(HV, NC, D, D), r(HV, NC, D, D, s=1e-3), r(HV, NC, D, 64), r(HV, NC, D, 64, s=1e-3),
                Fb, cu, chunk_indices, dq32, torch.zeros_like(dq32), r(Ttot, HV, D), r(Ttot, HV, D),
                torch.zeros(2, HV, NC, 64, **f32), torch.zeros(2, HV, NC, 64, **f32), torch.zeros(2, HV, NC, 64, **f32),
                torch.zeros(2, HV, NC, D, **f32), torch.zeros(2, HV, NC, 64, **f32), torch.zeros(HV, NC, 64, **f32),
                torch.zeros(2, HV, NC, 64, **f32), D ** -0.5, 1]
    if kernel == "intra":
        return [r(Ttot, H, D), r(Ttot, H, D), r(Ttot, HV, D), r(HV, NC, 64, D), r(HV, NC, 64, D, s=1e-3),
                r(HV, NC, D, 64), r(HV, NC, D, 64, s=1e-3), Fb, cu, chunk_indices,
                torch.zeros(Ttot, HV, D, **f32), torch.zeros(Ttot, HV, D, **f32),
                torch.zeros(HV, NC, 64, **f32), torch.zeros(HV, NC, 64, **f32), D ** -0.5]
    return [r(Ttot, H, D), r(Ttot, H, D), r(Ttot, HV, D), r(Ttot, HV, D),
            r(HV, NC, D, D), r(HV, NC, D, D, s=1e-3), r(HV, NC, 64, D), r(HV, NC, 64, D, s=1e-3),
            r(HV, NC, D, D), r(HV, NC, D, D, s=1e-3), r(HV, NC, D, 64), r(HV, NC, D, 64, s=1e-3),
            Fb, cu, chunk_indices,
            torch.zeros(Ttot, HV, D, **f32), torch.zeros(Ttot, HV, D, **f32),
            torch.zeros(2, HV, NC, 64, **f32), torch.zeros(2, HV, NC, 64, **f32), torch.zeros(2, HV, NC, 64, **f32),
            torch.zeros(2, HV, NC, D, **f32), torch.zeros(HV, NC, 64, **f32), D ** -0.5]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="inter", choices=list(VARIANTS))
    ap.add_argument("--shape", default="B1_T32768_H16_HV32", choices=list(SHAPES))
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="",
                    help="comma-separated variant labels (or their first word) to time beside 'api'; default: all")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    from triton.testing import do_bench

    from kernels.gdn_fwd.build import precompile
    only = {w for w in args.only.split(",") if w}
    cfgs = {label: Variant(args.kernel, ab) for label, ab in VARIANTS[args.kernel].items()
            if label == "api" or not only or label in only or label.split()[0] in only}
    precompile(list(cfgs.values()), get=compile_variant, log=lambda m: print(m, flush=True))
    dev = torch.device("cuda")
    a = tables(*SHAPES[args.shape], dev, kernel=args.kernel)
    rows = []
    for label, cfg in cfgs.items():
        try:
            kern = compile_variant(cfg)
            ms = do_bench(lambda: kern(*a), warmup=args.warmup, rep=args.rep, return_mode="median")
            rows.append((label, ms))
        except Exception as e:  # one variant failing does not stop the rest
            rows.append((label, float("nan")))
            print(f"{label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    base = rows[0][1]
    name = {"dh": "gdn_bwd_dh", "dqk": "gdn_bwd_dqk", "prep": "gdn_bwd_prep"}.get(args.kernel,
                                                                               f"gdn_bwd_dqk_{args.kernel}")
    print(f"\n== {name} ablation, {args.shape}, {torch.cuda.get_device_name()} (median ms) ==")
    for label, ms in rows:
        print(f"  {label:<30} {ms:8.3f} ms   {ms / base:5.2f}x api")
    return 0


if __name__ == "__main__":
    sys.exit(main())
