"""Where a chunk of ``gdn_bwd_fused`` goes: a copy of ``kernels/backward/fused.py`` with ``clock64`` marks, timed
per warpgroup and phase.

    python3 benchmarks/experiments/fused_bwd_profile.py [--shape B,T,H,HV] [--first 4] [--last 60] [--source F]
        [--no-store dv,dq,dk] [--dq32] [--compile-only]

The copy marks, in each warpgroup's chunk loop, the loop's start, every ``T.barrier_wait`` (after it) and every
arrival at a phase barrier (before it): thread 0 of each warpgroup of CTA (0, 0) stores the low 32 bits of
``clock64`` for chunks below 128 into the otherwise unwritten ``dh0`` (no initial state).  Prints, per warpgroup,
each mark's median cycles since the warpgroup's previous mark and its offset from the chain warpgroup's loop start
(chunks ``first`` to ``last``), and the medians of the chunk period; before them, the marked and the plain kernel's
time in the pipeline's fused stage (``triton.testing.do_bench``; the dispatched backward plan, q and k L2-normalised)
and each output's largest difference from the tree's kernel's.  ``--source``: another copy of ``fused.py`` (e.g. an
earlier commit's, for an A/B in one run); ``--no-store``: those outputs' global stores predicated off (the factor
``fac`` of each is a positive power of two, so ``fac < 0`` never holds, and the work that forms them is still
compiled and run): what the stores cost.  The kernel is the dispatched plan's form, dq~ and dk~ stored in fp16
(``dq16``); ``--dq32``: its fp32 form (the tree's for the comparison is then the same plan's without
``fused_dq16``); ``--compile-only``: build both kernels (no GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

SLOTS = 32          # marks per warpgroup
MARK = ("if (hv == 0) & (n == 0) & (tx % WG == 0) & (i < 128):\n"
        "{ind}    dh0[0, 0, i, {slot}] = T.reinterpret(T.cast(T.call_extern(\"int64\", \"clock64\"), \"int32\"), f32)")
WG_BRANCH = re.compile(r"^\s*(if tx < WG:|elif tx < 2 \* WG:|elif tx < 3 \* WG:|else:)\s*$")


def marked_source(src: str):
    """(source, labels): ``fused.py``'s text with the marks, and each warpgroup's mark labels by slot (of its last
    chunk loop: the chain form's loops, not built here, take the same slots)."""
    lines = src.splitlines()
    out, labels = [], {w: [] for w in range(4)}
    w, loop_ind, start = -1, None, False

    def mark(ind, label):
        slot = len(labels[w])
        assert slot < SLOTS, f"warpgroup {w}: more than {SLOTS} marks"
        labels[w].append(label)
        out.append(" " * ind + MARK.format(ind=" " * ind, slot=w * SLOTS + slot))

    for idx, ln in enumerate(lines):
        ind, s = len(ln) - len(ln.lstrip()), ln.strip()
        if WG_BRANCH.match(ln) and idx + 1 < len(lines) and lines[idx + 1].strip().startswith("# WG"):
            w, loop_ind = w + 1, None
        if loop_ind is not None and s and ind <= loop_ind:
            loop_ind = None                     # left the chunk loop
        if start and s:
            mark(ind, "loop start")
            start = False
        if loop_ind is not None and s.startswith("T.barrier_arrive(ph["):
            mark(ind, "arrive " + s[len("T.barrier_arrive("):-1])
        out.append(ln)
        if loop_ind is not None and s.startswith("T.barrier_wait("):
            mark(ind, "waited " + s[len("T.barrier_wait("):].split(",")[0])
        if w >= 0 and s == "for i in T.serial(ntot):":
            loop_ind, start, labels[w] = ind, True, []
    return "\n".join(out) + "\n", labels


SOURCE = os.path.join(ROOT, "kernels", "backward", "fused.py")
# --no-store: each output's store in fused.py, and the same store predicated off
NO_STORE = {
    "dv": ("if t0 + t < eos:\n", "if (t0 + t < eos) & (fac[0] < 0):\n"),
    "dq": ("store_rows(dq_f, dq32, t0, hv, nv, fac[0])",
           "store_rows(dq_f, dq32, t0, hv, T.if_then_else(fac[0] < 0, nv, 0), fac[0])"),
    "dk": ("store_rows(dk_f, dk32, t0, hv, nv, fac[0])",
           "store_rows(dk_f, dk32, t0, hv, T.if_then_else(fac[0] < 0, nv, 0), fac[0])"),
}


def without_stores(src: str, names) -> str:
    """``src`` with the global stores of the outputs ``names`` (keys of ``NO_STORE``) predicated off."""
    for name in names:
        if name not in NO_STORE:
            raise SystemExit(f"--no-store: unknown output {name!r}; known: {', '.join(NO_STORE)}")
        old, new = NO_STORE[name]
        if src.count(old) != 1:
            raise SystemExit(f"--no-store {name}: the source has {src.count(old)} copies of its store "
                             f"{old.strip()!r}, not one (fused.py changed: update NO_STORE)")
        src = src.replace(old, new)
    return src


def module_of(text: str, name: str):
    """A module of ``kernels.backward`` (its relative imports resolve there) from the source ``text``."""
    path = os.path.join(tempfile.mkdtemp(), name + ".py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("kernels.backward." + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernels_of(source: str, no_store=(), dq16: bool = True):
    """(plain kernel, marked kernel, labels) of the ``fused.py`` copy ``source`` (one-pass form, bf16 dv; its
    ``dq16`` form where asked), the stores of the outputs ``no_store`` predicated off."""
    import tilelang

    from kernels.build import TARGET, pass_configs
    src = without_stores(open(source).read(), no_store)
    text, labels = marked_source(src)
    plain, marked = module_of(src, "_fused_plain"), module_of(text, "_fused_marked")
    build = lambda m: tilelang.compile(m.build_bwd_fused(dq16=dq16), target=TARGET,  # noqa: E731
                                       pass_configs=pass_configs())
    return build(plain), build(marked), labels


def dispatched_fused_stage(q, k, v, g, beta, do, dht, dq16: bool = True):
    """A function running the dispatched backward plan's fused kernel (``pipeline.fused``, no initial state) on the
    stages before it, run once here; it returns the kernel's (state gradients, chunk terms); ``dh0`` is unwritten by
    the plain kernel.  ``dq16``: the plan with ``fused_dq16`` (the dispatched one), else without."""
    from kernels.backward import pipeline as bp
    b = bp.prepare_backward(q, k, v, g, beta, do, dht, None, None, True, False, None)      # q, k L2-normalised
    plan = dataclasses.replace(bp.with_fused_segments(bp.plan_for(b), b), fused_dq16=dq16)
    assert plan.fused and plan.fused_segments is None, f"not the one-pass fused plan at this shape: {plan}"
    b, f, tables = bp.scaled_prep(b=b, plan=plan, saved=None)
    states = bp.recompute(x=b.x, plan=plan, tables=tables, side=None, maps=None)
    return lambda: bp.fused(b=b, plan=plan, tables=tables, states=states, factors=f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8,4096,16,32")
    ap.add_argument("--first", type=int, default=4)
    ap.add_argument("--last", type=int, default=60)
    ap.add_argument("--source", default=SOURCE)
    ap.add_argument("--no-store", default="", help="outputs whose stores are predicated off: dv,dq,dk")
    ap.add_argument("--dq32", action="store_true", help="the kernel's fp32 form (dq~, dk~ stored in fp32)")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args(argv)
    no_store = [x for x in a.no_store.split(",") if x]
    plain_kern, kern, labels = kernels_of(a.source, no_store, not a.dq32)
    if a.compile_only:
        for w in range(4):
            print(f"WG{w}: {len(labels[w])} marks: {', '.join(labels[w])}")
        return
    from unittest import mock

    import torch
    import triton

    import kernels.build as build
    from fused_bwd_check import make_inputs
    from kernels.backward.configs import FUSED_KIND
    B, T, H, HV = (int(s) for s in a.shape.split(","))
    stage = dispatched_fused_stage(*make_inputs(B, T, H, HV, False, False, "cuda")[:7], dq16=not a.dq32)
    get = build.get_kernel

    def using(kern):
        """The pipeline's fused stage on ``kern`` (every other kernel as built)."""
        kern = build.direct_launch(kern)
        return mock.patch.object(build, "get_kernel", lambda cfg: kern if cfg.kind == FUSED_KIND else get(cfg))
    tree_out = stage()
    with using(plain_kern):
        t_plain = triton.testing.do_bench(stage, warmup=5, rep=50)
        out = stage()
    torch.cuda.synchronize()
    diffs = {}
    for part, ref in zip(out, tree_out):
        for name in ("dv", "dqv", "dkv", "qz", "kw", "kr", "yv2", "db22", "sd", "rect"):
            x, y = getattr(part, name, None), getattr(ref, name, None)
            if x is not None and y is not None:
                x, y = x.double(), y.double()
                diffs[name] = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
    with using(kern):
        t_marked = triton.testing.do_bench(stage, warmup=5, rep=50)
        grads = stage()[0]
    torch.cuda.synchronize()
    clk = grads.dh0[0, 0].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF     # [chunk, slot]
    nch = min(a.last, T // 64 - 1, 127)
    rows = list(range(a.first, nch))
    base = clk[:, 0]

    def cyc(x):
        """Cycles between two marks' low 32 bits, signed (a warpgroup's mark may precede WG0's)."""
        return ((x + (1 << 31)) % (1 << 32) - (1 << 31)).double()
    print(os.path.relpath(a.source, ROOT) + (f" (no {', '.join(no_store)} stores)" if no_store else ""),
          torch.cuda.get_device_name(), f"B{B} T{T} H{H} HV{HV}, chunks "
          f"{a.first}..{nch - 1}: fused stage "
          f"{t_plain:.3f} ms, marked {t_marked:.3f} ms")
    print("max |source - tree| / max |tree|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    period = cyc(base[a.first + 1:nch + 1] - base[a.first:nch]).median().item()
    print(f"chunk period (WG0's loop start to the next): {period:.0f} cycles")
    for w in range(4):
        print(f"WG{w}        since previous mark   offset from WG0's loop start   mark")
        prev = None
        for k, lab in enumerate(labels[w]):
            col = clk[rows, w * SLOTS + k]
            off = cyc(col - base[rows]).median().item()
            if prev is None:        # from the previous chunk's last mark
                last = clk[[r - 1 for r in rows], w * SLOTS + len(labels[w]) - 1]
                d = cyc(col - last).median().item()
            else:
                d = cyc(col - prev).median().item()
            prev = col
            print(f"    {d:12.0f} {off:30.0f}               {lab}")


if __name__ == "__main__":
    main()
