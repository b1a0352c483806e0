"""Write the CUDA source TileLang generates for every kernel configuration of kernels/ (sm_90a), one file each,
and compare two such dumps.

Usage: ``python scripts/dump_kernel_cuda.py OUTDIR [--jobs N] [--only SUBSTRING]``: each file is
``OUTDIR/<configuration name>.cu``; lowering needs tilelang, no GPU and no nvcc.
``python scripts/dump_kernel_cuda.py --compare BEFORE AFTER [--rename "OLD->NEW" ...]``: each configuration of BEFORE
(its name after the renames, substring replacements applied in order) against AFTER's file of that name, byte for
byte, and else after ``normalise``; prints one line per configuration (identical / identical after normalising /
DIFFERENT / missing) and exits 1 if any differs.
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
        from kernels.backward import build as bb
        from kernels.forward import build as fb
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


_SMEM_PTR = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")


def normalise(src: str) -> str:
    """``src`` with every pointer into the dynamic shared memory named by its byte offset (``smem@OFFSET``):
    TileLang numbers those pointers (``v_3``, ``v_4``, ...) in an order that can change while the offsets, and
    so every access, stay the same."""
    names = dict(_SMEM_PTR.findall(src))
    if not names:
        return src
    pat = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
    return pat.sub(lambda m: f"smem@{names[m.group(1)]}", src)


def compare(before: str, after: str, renames: list[str]) -> int:
    """Compare the dumps (module docstring); returns the number of configurations that differ or are missing."""
    pairs = [r.split("->", 1) for r in renames]
    bad = 0
    for f in sorted(os.listdir(before)):
        new = f
        for old, rep in pairs:
            new = new.replace(old, rep)
        b = os.path.join(before, f)
        a = os.path.join(after, new)
        if not os.path.exists(a):
            print(f"missing      {f} (as {new})")
            bad += 1
            continue
        sb, sa = open(b).read(), open(a).read()
        if sb == sa:
            print(f"identical    {new}")
        elif normalise(sb) == normalise(sa):
            print(f"normalised   {new} (shared-memory pointer names only)")
        else:
            print(f"DIFFERENT    {new}")
            bad += 1
    extra = set(os.listdir(after)) - {_rename(f, pairs) for f in os.listdir(before)}
    for f in sorted(extra):
        print(f"new          {f}")
    return bad


def _rename(f, pairs):
    for old, rep in pairs:
        f = f.replace(old, rep)
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rename", action="append", default=[], metavar="OLD->NEW")
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--only", default=None, help="only configurations whose name contains this")
    a = ap.parse_args(argv)
    if a.compare:
        return 1 if compare(*a.compare, a.rename) else 0
    if not a.outdir:
        ap.error("give OUTDIR or --compare BEFORE AFTER")
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
