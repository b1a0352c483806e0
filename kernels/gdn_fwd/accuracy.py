"""CPU accuracy study of the v2 precision knobs (emulation vs the fp64 reference).

    python -m kernels.gdn_fwd.accuracy [--T 2048] [--dists a,b] [--variants name,...] [--cp 1,4]

For each named distribution of ``cases.distributions`` (B=1, H=2, HV=4, K=V=128, bf16) prints
rel_rmse of o and of the final state against ``reference.chunk`` (fp64) for: an FLA-like bf16
scheme (``reference.emulated``) and each v2 variant (``emulation.chunk_gated_delta_rule_v2``), with
its MMA units and intermediate bytes per (chunk, head) from ``variants.PrecisionV2``.  (The removed
"split" path's "high" / "fast" columns of kernels/NOTES.md came from commit 830262b; the v2
variant "all-split" splits the same operands as its "high".)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

class _AutoVariants(dict):
    """Named presets, plus any "sp[f1+f2+...]" (those fields split, the rest bf16)."""

    def __missing__(self, key):
        from .variants import PrecisionV2
        if key.startswith("sp[") and key.endswith("]"):
            return PrecisionV2(**{f: "split" for f in key[3:-1].split("+") if f})
        raise KeyError(key)

    def __contains__(self, key):
        return dict.__contains__(self, key) or (isinstance(key, str) and key.startswith("sp["))


DEFAULT_DISTS = "gauss-l2,strong-decay,large-h0,beta-edges,heavy-tail-v,slow-decay,raw-qk-l2"


def variant_table():
    from .variants import PRECISIONS_V2, PrecisionV2
    V = _AutoVariants(PRECISIONS_V2)
    V.update({
        "all-split": PrecisionV2(merge="split", ag="split", ks="split", x="split", u="split", upd="split", s="split",
                                 p="split"),
        "sp[upd]": PrecisionV2(upd="split"),
        "sp[ag]": PrecisionV2(ag="split"),
        "sp[u+p]": PrecisionV2(u="split", p="split"),
        "sp[s]": PrecisionV2(s="split"),
        "sp[x]": PrecisionV2(x="split"),
        "sp[ks]": PrecisionV2(ks="split"),
        "merge-split": PrecisionV2(merge="split"),
        "merge-fp32": PrecisionV2(merge="fp32"),
    })
    return V


def load_case(dist, T, H=2, HV=4, seed=0, h0=None):
    from cases.case import Case
    from cases.distributions import get_distribution
    from cases.inputs import make_inputs
    d = get_distribution(dist)
    h0_dtype = "fp32" if (d.needs_h0 or h0) else None
    case = Case(B=1, T=T, H=H, HV=HV, dist=dist, h0_dtype=h0_dtype, seed=seed)
    return make_inputs(case)


def run(dists, T, variants, cps, out=print):
    from reference.chunk import chunk_gated_delta_rule as ref
    from reference.emulated import chunk_gated_delta_rule as fla_like

    from . import emulation as E
    from .testing import rel_rmse
    V = variant_table()
    rows = []
    for dist in dists:
        inp = load_case(dist, T)
        if inp.use_gate_in_kernel or inp.use_beta_sigmoid_in_kernel:
            out(f"{dist}: skipped (in-kernel gate transform)")
            continue
        kw = dict(initial_state=inp.initial_state, output_final_state=True,
                  use_qk_l2norm_in_kernel=inp.use_qk_l2norm_in_kernel)
        a = (inp.q, inp.k, inp.v, inp.g, inp.beta)
        o_ref, s_ref = ref(*a, **kw)
        floor = rel_rmse(o_ref.to(inp.q.dtype), o_ref)
        out(f"\n{dist} (T={T}, H=2, HV=4, bf16{', h0' if inp.initial_state is not None else ''}): "
            f"o floor {floor:.3e}")
        res = {}
        t = time.time()
        res["fla-like"] = fla_like(*a, **kw)
        for name in variants:
            for cp in cps:
                key = name if cp == 1 else f"{name}@cp{cp}"
                res[key] = E.chunk_gated_delta_rule_v2(*a, **kw, prec=V[name], cp_segments_n=cp)
        for key, (o, s) in res.items():
            eo, es = rel_rmse(o, o_ref), rel_rmse(s, s_ref)
            nan = int((~torch.isfinite(o.double())).sum() + (~torch.isfinite(s.double())).sum())
            base = key.split("@")[0]
            extra = ""
            if base in V:
                u = V[base].mma_units()
                extra = (f"  units intra/state/out {u['intra']}/{u['state']}/{u['output']}  "
                         f"bytes {V[base].bytes_per_chunk()['total'] // 1024} KiB")
            out(f"  {key:<22} o {eo:.3e} ({eo / floor:.2f}x)  state {es:.3e}  nan {nan}{extra}")
            rows.append((dist, key, eo, es, floor, nan))
        out(f"  [{time.time() - t:.0f} s]")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--dists", default=DEFAULT_DISTS)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--cp", default="1")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run([d for d in args.dists.split(",") if d], args.T, [v for v in args.variants.split(",") if v],
        [int(x) for x in args.cp.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
