"""One-shot GPU check of our TileLang GDN forward: ``python -m kernels.check`` (from the repo root).

1. compiles every dispatchable kernel (prints the time of each);
2. stage check on a small varlen case: the v2 intra-chunk kernel's outputs
   (Ag = Ah + Al, the row factors F) and the end-to-end result
   against the torch emulation of the same tiling (``kernels.gdn_fwd.emulation``,
   run in fp64 on the GPU) - if something is wrong this says which kernel;
3. correctness table over ``kernels.gdn_fwd.testing.GPU_CASES`` against the fp64
   reference (``reference.chunk``): rel_rmse of o and of the final state, max
   |diff| of o, NaN/Inf count, pass/fail of the test bounds, and the same
   numbers for FLA Triton (``FLA_FLASH_QLA=0 FLA_TILELANG=0``) on the same inputs;
4. prints the short summary table last.

Options: ``--fla {some,all,none}`` (default ``some``: FLA on the D=128 cases whose
(H, HV) is (4, 8) or (2, 4), which bounds FLA's first-call autotuning time),
``--cases NAME[,NAME...]``.  Runs in well under 4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback


def _fmt(x, spec=".2e"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.check")
    ap.add_argument("--fla", choices=["some", "all", "none"], default="some")
    ap.add_argument("--cases", default="")
    args = ap.parse_args(argv)

    import torch

    from kernels.gdn_fwd import emulation as E
    from kernels.gdn_fwd import testing as tt

    t_start = time.time()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}")
    try:
        import tilelang
        print(f"tilelang {getattr(tilelang, '__version__', '?')}")
    except Exception as e:
        print(f"tilelang import failed: {e}")
        return 2
    fla = tt.fla_triton_fn() if args.fla != "none" else None
    print(f"FLA Triton: {'available' if fla else 'not used'}")
    ref_fn = tt.reference_fn()
    print(f"reference: {ref_fn.__module__}.{ref_fn.__name__}")

    # ---- 1. compile (parallel processes fill TileLang's disk cache, then load here) ----
    from kernels.gdn_fwd.build import all_configs, get_kernel, precompile
    precompile(all_configs(), log=lambda m: print(m, flush=True))
    failed_compile = []
    for cfg in all_configs():
        t = time.time()
        try:
            get_kernel(cfg)
            print(f"loaded {cfg.name:<55} {time.time() - t:6.1f} s")
        except Exception:
            failed_compile.append(cfg.name)
            print(f"COMPILE FAILED {cfg.name}:\n{traceback.format_exc(limit=3)}")
    if failed_compile:
        print("compile failures, stopping")
        return 1

    import kernels
    from kernels.gdn_fwd.api import intra2_stage

    stage_check(dev, intra2_stage, kernels.chunk_gated_delta_rule)
    wanted = {c for c in args.cases.split(",") if c}
    cases = [c for c in tt.GPU_CASES if not wanted or c.name in wanted]
    rows = correctness_table(dev, kernels.chunk_gated_delta_rule, fla, ref_fn, cases, args.fla)
    return summarize(rows, time.time() - t_start)


def stage_check(dev, intra_fn, impl):
    """Intra-kernel outputs and the end-to-end result vs the emulation of the same tiling."""
    import torch

    from kernels.gdn_fwd import emulation as E
    from kernels.gdn_fwd import testing as tt

    print("\n== stage check vs emulation (varlen lens 1,63,64,65,130; H=2 HV=4; bf16; h0; l2) ==")
    try:
        case = tt.Case("stage", 1, 0, 2, 4, lens=[1, 63, 64, 65, 130], h0=1.0, l2=True)
        (q, k, v, g, b), kw = case.inputs(dev)
        Ah, Al, F = intra_fn(q, k, g, b, use_qk_l2norm_in_kernel=True, cu_seqlens=kw["cu_seqlens"])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        cu = [int(x) for x in kw["cu_seqlens"].tolist()]
        T_ = q.shape[1]
        from kernels.gdn_fwd.build import precision_v2
        eAh, eAl, eF = E.intra_v2(q.reshape(T_, 2, 128), k.reshape(T_, 2, 128), g.reshape(T_, 4).float(),
                                  b.reshape(T_, 4).float(), cu, 128 ** -0.5, True, torch.bfloat16, precision_v2(None))
        ag, eag = Ah.double() + Al.double(), eAh + eAl
        print(f"  Ag = Tinv diag(beta): max|kernel - emu| {tt.max_diff(ag, eag):.2e}   max|emu| "
              f"{eag.abs().max():.2e}   rel_rmse {tt.rel_rmse(ag, eag):.2e}")
        for i, nm in enumerate(["F0=e^G rk", "F1=scale e^G rq", "F2=e^(GL-G) rk", "F3=e^GL", "F4=G", "F5=scale rq",
                                "F6=rk"]):
            print(f"  {nm:<16} max|diff| {tt.max_diff(F[:, :, i], eF[:, :, i]):.2e}  "
                  f"rel_rmse {tt.rel_rmse(F[:, :, i], eF[:, :, i]):.2e}")
        o, ht = impl(q, k, v, g, b, **kw)
        eo, eht = E.chunk_gated_delta_rule(q, k, v, g, b, **kw)
        print(f"  end-to-end vs emulation: o rel_rmse {tt.rel_rmse(o, eo):.2e}  max|diff| {tt.max_diff(o, eo):.2e}"
              f"   state rel_rmse {tt.rel_rmse(ht, eht):.2e}")
        return True
    except Exception:
        print(f"STAGE CHECK FAILED:\n{traceback.format_exc(limit=6)}")
        return False


def correctness_table(dev, impl, fla, ref_fn, cases, fla_mode="some"):
    """One row per case: ours and FLA's errors against the fp64 reference on the same inputs."""
    import torch

    from kernels.gdn_fwd import testing as tt

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    print("\n== correctness vs fp64 reference ==")
    rows = []
    for case in cases:
        row = {"case": case.name}
        t = time.time()
        try:
            a, kw = case.inputs(dev)
            o_ref, ht_ref = ref_fn(*a, **kw)
            floor = tt.rel_rmse(o_ref.to(case.dtype), o_ref)
            b_o, b_s = tt.bounds(case, floor)
            row["floor"] = floor
            try:
                o, ht = impl(*a, **kw)
                sync()
                row.update(o=tt.rel_rmse(o, o_ref), s=tt.rel_rmse(ht, ht_ref), md=tt.max_diff(o, o_ref),
                           nan=tt.nonfinite(o) + tt.nonfinite(ht))
                row["ok"] = row["o"] <= b_o and row["s"] <= b_s and row["nan"] == 0
            except Exception as e:
                row["err"] = f"{type(e).__name__}: {e}"[:200]
                row["ok"] = False
                print(traceback.format_exc(limit=4))
            use_fla = fla is not None and (fla_mode == "all" or (
                fla_mode == "some" and case.D == 128 and (case.H, case.HV) in ((4, 8), (2, 4))))
            if use_fla:
                try:
                    o_f, ht_f = fla(*a, **kw)
                    sync()
                    row.update(fo=tt.rel_rmse(o_f, o_ref), fs=tt.rel_rmse(ht_f, ht_ref),
                               fmd=tt.max_diff(o_f, o_ref), fnan=tt.nonfinite(o_f) + tt.nonfinite(ht_f))
                except Exception as e:
                    row["ferr"] = f"{type(e).__name__}: {e}"[:120]
        except Exception as e:
            row["err"] = f"{type(e).__name__}: {e}"[:200]
            row["ok"] = False
            print(traceback.format_exc(limit=4))
        row["sec"] = time.time() - t
        rows.append(row)
        print(f"{case.name:<28} ours o {_fmt(row.get('o'))} S {_fmt(row.get('s'))} "
              f"| FLA o {_fmt(row.get('fo'))} S {_fmt(row.get('fs'))} | floor {_fmt(row.get('floor'))} "
              f"| {'PASS' if row.get('ok') else 'FAIL'} {row.get('err', '')}{row.get('ferr', '')} ({row['sec']:.1f} s)",
              flush=True)
    return rows


def summarize(rows, seconds) -> int:
    print(f"\n== summary ({seconds:.0f} s total) ==")
    hdr = (f"{'case':<28} {'o_ours':>9} {'o_FLA':>9} {'floor':>9} {'S_ours':>9} {'S_FLA':>9} "
           f"{'maxd_ours':>9} {'maxd_FLA':>9} {'nan':>4} {'ok':>4}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        nan = r.get("nan", 0) + r.get("fnan", 0)
        print(f"{r['case']:<28} {_fmt(r.get('o')):>9} {_fmt(r.get('fo')):>9} {_fmt(r.get('floor')):>9} "
              f"{_fmt(r.get('s')):>9} {_fmt(r.get('fs')):>9} {_fmt(r.get('md')):>9} {_fmt(r.get('fmd')):>9} "
              f"{nan:>4} {('yes' if r.get('ok') else 'NO'):>4}")
    n_bad = sum(not r.get("ok") for r in rows)
    worse = [r["case"] for r in rows if "fo" in r and "o" in r and (r["o"] > r["fo"] or r["s"] > r["fs"])]
    print(f"{len(rows) - n_bad}/{len(rows)} cases within bounds; worse than FLA on: {worse or 'none'}")
    return 0 if n_bad == 0 else 1




if __name__ == "__main__":
    sys.exit(main())
