"""Write the CUDA source TileLang generates for every kernel configuration of kernels/ (sm_90a), one file each.

Usage: ``python scripts/dump_kernel_cuda.py OUTDIR [--jobs N] [--only SUBSTRING]``.  Each file is
``OUTDIR/<configuration name>.cu``; lowering needs tilelang, no GPU and no nvcc.  Two dumps of two commits
diff file by file (``diff -r``) to show that a change leaves the generated kernels byte-identical.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _configs():
    """[(name, configuration, prim_func builder)] of every kernel configuration the package compiles."""
    try:
        from kernels import build
        return [(c.name, c, build.prim_func) for c in build.all_configs()]
    except ImportError:
        from kernels.gdn_bwd import build as bb
        from kernels.gdn_fwd import build as fb
        return ([(c.name, c, fb.prim_func) for c in fb.all_configs()]
                + [(c.name, c, bb.prim_func) for c in bb.all_configs()])


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.,=+\[\]-]", "_", name)


def _lower_one(item) -> tuple[str, str | None]:
    name, cfg, build = item
    import tilelang
    from tilelang import tvm

    try:
        func = build(cfg)
        pc = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
        with tvm.transform.PassContext(opt_level=3, config=pc), target:
            art = tilelang.lower(func, target=target)
        return name, art.kernel_source
    except Exception as e:  # reported, the other configurations go on
        return name, f"ERROR {type(e).__name__}: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--only", default=None, help="only configurations whose name contains this")
    a = ap.parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    items = [it for it in _configs() if a.only is None or a.only in it[0]]
    bad = 0
    with ProcessPoolExecutor(max(1, a.jobs), mp_context=mp.get_context("spawn")) as ex:
        for name, src in ex.map(_lower_one, items):
            if src.startswith("ERROR "):
                bad += 1
                print(f"FAILED {name}: {src[6:300]}", flush=True)
                continue
            with open(os.path.join(a.outdir, _safe(name) + ".cu"), "w") as f:
                f.write(src)
            print(f"wrote {name}", flush=True)
    print(f"{len(items) - bad} of {len(items)} configurations written to {a.outdir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
