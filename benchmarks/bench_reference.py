"""How much faster the chunked fp64 reference is than the token-by-token fp64 recurrence (measured here).

    python benchmarks/bench_reference.py [--T 20468] [--H 4] [--HV 8] [--device cpu|cuda]

Prints both wall times (median of --repeats runs, after a warm-up), their ratio and the agreement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference  # noqa: E402
from cases import Case, make_inputs  # noqa: E402
from parity.metrics import compare  # noqa: E402


def timed(fn, repeats: int, device: str) -> tuple[float, tuple]:
    times, out = [], None
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=20468)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--HV", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    x = make_inputs(Case(T=args.T, H=args.H, HV=args.HV, dtype="fp32", dist="qwen-gates")).to(args.device)
    kw = x.kwargs()
    reference.chunk_gated_delta_rule(**{**kw, "q": kw["q"][:, :64], "k": kw["k"][:, :64], "v": kw["v"][:, :64],
                                        "g": kw["g"][:, :64], "beta": kw["beta"][:, :64]})  # warm-up
    t_chunk, (o_c, s_c) = timed(lambda: reference.chunk_gated_delta_rule(**kw), args.repeats, args.device)
    t_rec, (o_r, s_r) = timed(lambda: reference.fused_recurrent_gated_delta_rule(**kw), args.repeats, args.device)
    print(f"T={args.T} H={args.H} HV={args.HV} K=V=128 fp64 on {args.device}")
    print(f"recurrent {t_rec:.3f} s | chunked {t_chunk:.3f} s | chunked is {t_rec / t_chunk:.1f}x faster")
    print(f"agreement: o rel_rmse {compare(o_c, o_r).rel_rmse:.2e}, final state rel_rmse "
          f"{compare(s_c, s_r, kind='state').rel_rmse:.2e}")


if __name__ == "__main__":
    main()
