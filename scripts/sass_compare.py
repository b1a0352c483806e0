#!/usr/bin/env python3
"""Two kernel configurations' SASS side by side: whether a reordered form computes what the dispatched one does.

    python3 scripts/sass_compare.py 'BwdConfig("dqk_g2", "bfloat16", 128, lo8=True)' \\
        'BwdConfig("dqk_g2", "bfloat16", 128, lo8=True, exp_mask=True)' [--nvdisasm PATH]

Each configuration (a ``kernels.backward.configs`` / ``kernels.forward.configs`` constructor, or
``forward_plan(...).configs()[i]`` / ``BackwardPlan(...).recompute_configs()[i]``) is built by TileLang, compiled to
an sm_90a cubin (``kernels.build.cubin_command``: nvcc, no GPU) and disassembled by ``nvdisasm`` (``--nvdisasm``, else
``$NVDISASM``, else on PATH; the pip wheel ``nvidia-cuda-nvdisasm`` ships one).  Printed: each one's registers,
spills and whether ptxas injected a ``warpgroup.wait`` (C7517), and the count of every opcode, the arithmetic ones
(``ARITHMETIC``) marked where they differ.  A form that only moves instructions keeps every arithmetic count; a
different count (an FFMA that became FMUL + FADD: a product no longer fused with its sum) means different roundings.
Exit status 0 when the arithmetic counts agree, 1 when they differ.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# opcodes whose counts fix what a kernel computes and how it rounds (the rest: moves, addresses, control)
ARITHMETIC = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "F2F", "F2FP", "HADD2", "HMUL2", "HFMA2", "HGMMA", "DFMA",
              "DMUL", "DADD")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def opcodes(sass: str) -> collections.Counter:
    """Opcode counts of an ``nvdisasm -c`` listing (predicated instructions counted by their opcode)."""
    out = collections.Counter()
    for line in sass.splitlines():
        m = _OPCODE.match(line)
        if m:
            out[m.group(1)] += 1
    return out


def ptxas_facts(log: str) -> dict:
    """Registers, spill-store bytes and whether a ``warpgroup.wait`` was injected, from ptxas' verbose output."""
    reg = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(reg.group(1)) if reg else None, "spill_stores": int(spill.group(1)) if spill else None,
            "injected_wait": "C7517" in log}


def differing(a: collections.Counter, b: collections.Counter) -> list:
    """The arithmetic opcodes whose counts differ between two listings' ``opcodes``."""
    return [op for op in ARITHMETIC if a.get(op, 0) != b.get(op, 0)]


def disassemble(cfg, nvdisasm: str, workdir: str, tag: str) -> tuple:
    """(opcode counts, ptxas facts) of one configuration."""
    from kernels.build import cubin_command, get_kernel

    src = os.path.join(workdir, tag + ".cu")
    cubin = os.path.join(workdir, tag + ".cubin")
    with open(src, "w") as f:
        f.write(get_kernel(cfg).get_kernel_source())
    r = subprocess.run(cubin_command(src, cubin), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed for {cfg.name}:\n{(r.stdout + r.stderr)[-2000:]}")
    d = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True)
    return opcodes(d.stdout), ptxas_facts(r.stdout + r.stderr)


def config(expr: str):
    """A configuration from its constructor expression (the configuration classes, the plans and PRESETS in
    scope)."""
    from kernels.backward.configs import BwdConfig
    from kernels.forward.configs import FixupConfig, IntraConfig, OutputConfig, StateConfig
    from kernels.forward.precision import PRESETS
    from kernels.plan import BackwardPlan, ForwardPlan, backward_plan, forward_plan, replace
    scope = dict(BwdConfig=BwdConfig, FixupConfig=FixupConfig, IntraConfig=IntraConfig, OutputConfig=OutputConfig,
                 StateConfig=StateConfig, PRESETS=PRESETS, BackwardPlan=BackwardPlan, ForwardPlan=ForwardPlan,
                 backward_plan=backward_plan, forward_plan=forward_plan, replace=replace)
    return eval(expr, {"__builtins__": {}}, scope)     # noqa: S307  (a developer's own expression)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM") or shutil.which("nvdisasm"))
    args = ap.parse_args(argv)
    if not args.nvdisasm:
        ap.error("no nvdisasm: pass --nvdisasm PATH or set NVDISASM (pip download nvidia-cuda-nvdisasm)")
    cfgs = [config(args.a), config(args.b)]
    with tempfile.TemporaryDirectory() as d:
        (ca, fa), (cb, fb) = (disassemble(c, args.nvdisasm, d, t) for c, t in zip(cfgs, "ab"))
    for c, f in zip(cfgs, (fa, fb)):
        print(f"{c.name}: {f['registers']} registers, {f['spill_stores']} bytes spilled, injected wait "
              f"{'yes' if f['injected_wait'] else 'no'}")
    diff = differing(ca, cb)
    print(f"{'opcode':<14}{'a':>8}{'b':>8}")
    for op in sorted(set(ca) | set(cb), key=lambda o: (o not in ARITHMETIC, -max(ca[o], cb[o]), o)):
        mark = "  differs" if op in diff else ""
        print(f"{op:<14}{ca[op]:>8}{cb[op]:>8}{mark}")
    print(f"total{sum(ca.values()):>17}{sum(cb.values()):>8}")
    print("arithmetic counts: " + ("the same" if not diff else "differ in " + ", ".join(diff)))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
