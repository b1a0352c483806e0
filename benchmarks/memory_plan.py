"""Memory plan of one forward + backward of our TileLang GDN (``kernels.autograd.apply``), traced on the CPU.

    python benchmarks/memory_plan.py [--shapes NAME,...] [--top 30] [--check] [--ab COL] [--record [PATH]] [--launches]

The pipelines' host code runs as on the GPU, every TileLang kernel replaced by a no-op (``kernels.build.get_kernel``
stubbed: outputs stay uninitialised, nothing computes), the sm_90 checks faked and the backward's side stream
replaced by a stand-in so that the launch order (the recompute after dh) is the GPU's.
Inputs as ``benchmarks/bench_kernels_bwd.py`` (bf16 q/k/v/do, fp32 g/beta/dht, no initial state, the final state
returned; ``benchmarks.inputs.SHAPES``), one warm-up call (the layout caches), then one traced call.  A
``TorchDispatchMode`` records every new storage (bytes, shape, dtype, the allocating line in ``kernels/`` and its
variable) and its free (a weak reference to the storage expires); the pipeline stages are wrapped to record the memory
at their ends; every kernel launch and operator records the last use of the storages it takes.  Printed per shape:
the timeline per stage, the tensors alive at the peak (flagged where past their last use), and last a summary
table: peak above the inputs (the benchmark's figure: gradients included), above inputs + gradients, and the
floor of the peak by lifetimes alone (every buffer freed after its last use, in the same order).  ``--check``
also runs the call under ``torch.profiler`` (profile_memory) and prints its peak from the CPU allocator's own
events, which sees every allocation (temporaries inside operators included).  ``--ab COL``: the plans of the
backward benchmark's A/B column COL (``bench_kernels_bwd.AB``) instead of the dispatched ones.  ``--record``: the
summary table is appended to ``benchmarks/RESULTS.md`` (``benchmarks/record.py``; its machine column says "CPU
trace").  ``--launches``: every kernel launch in order with the MiB its tensor arguments span (``span_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import linecache
import os
import re
import sys
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.inputs import D, SHAPES  # noqa: E402

__all__ = ["Allocation", "Launch", "MemoryTrace", "Plan", "gpu_peak", "launch_table", "plan", "span_bytes",
           "stub_kernel_path"]

MiB = 2 ** 20
KERNELS = os.path.join(ROOT, "kernels") + os.sep
# the pipeline stages whose ends the timeline records, by module
STAGES = {"kernels.forward.pipeline": ("prepare", "intra_chunk", "state", "state_segmented", "state_output", "output",
                                     "finish"),
          "kernels.backward.pipeline": ("prepare_backward", "prep", "recompute", "dh", "dqk", "fused",
                                      "dg_dbeta")}
_ASSIGN = re.compile(r"^\s*([A-Za-z_][\w\s,.\[\]()]*?)\s*(?:\+|-|\*)?=(?!=)")


@dataclass
class Allocation:
    """One storage made during the traced call: ``site`` the allocating line (``kernels/...py:N`` where the
    allocation is in ``kernels/``, else the first line of this repository on the stack), ``func`` that line's
    function, ``name`` the variable it is assigned to (the line's left-hand side), ``born`` / ``died`` the event
    indices of its allocation and free (``died`` None: alive at the end)."""
    id: int
    key: int                        # the storage's identity while it is alive
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    site: str
    func: str
    name: str
    op: str
    born: int = 0
    died: int | None = None
    last_use: int = 0               # the last event (a kernel launch or an operator) that took it as an argument

    @property
    def label(self) -> str:
        return f"{self.site} {self.func}: {self.name}"


def span_bytes(tensors) -> int:
    """The bytes ``tensors`` span, each distinct view (storage, offset, shape, strides) counted once: what a kernel
    taking them reads and writes if it touches each element once (an estimate of its traffic, not a measure)."""
    seen = {}
    for t in tensors:
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride())
        seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its config's ``name``, the ``stage`` it ran in (an index into ``MemoryTrace.timeline``:
    the stage whose end is recorded next) and the ``nbytes`` its tensor arguments span (``span_bytes``)."""
    name: str
    stage: int
    nbytes: int


@dataclass
class MemoryTrace:
    """Allocations and frees in event order; ``timeline``: (direction, stage, bytes at its end, peak during it).
    A free is seen at the next allocation or stage end (``poll``: a weak reference to each storage expires), so
    the peak, always reached at an allocation, is exact."""
    allocations: list = field(default_factory=list)
    current: int = 0
    peak: int = 0
    peak_alive: tuple = ()
    peak_event: int = 0
    events: int = 0
    timeline: list = field(default_factory=list)
    launches: list = field(default_factory=list)    # Launch per kernel launch, in launch order
    returned: int = 2 ** 62                         # the event at which the call returned
    _live: dict = field(default_factory=dict)       # storage key -> (StorageWeakRef, Allocation)
    _stage_peak: int = 0

    def tracks(self, key: int) -> bool:
        return key in self._live

    def alloc(self, a: Allocation, storage):
        self.poll()
        self._live[a.key] = (StorageWeakRef(storage), a)
        self.allocations.append(a)
        self.current += a.nbytes
        self.events += 1
        a.born = self.events
        if self.current > self.peak:
            self.peak = self.current
            self.peak_alive = self.alive()
            self.peak_event = self.events
        self._stage_peak = max(self._stage_peak, self.current)

    def poll(self):
        """Record the frees of the tracked storages that died since the last call."""
        for key, (ref, a) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= a.nbytes
                self.events += 1
                a.died = self.events

    def held_by_caller(self, a: Allocation) -> bool:
        """Whether ``a`` outlives the call (an output, a gradient): its lifetime is the caller's."""
        return a.died is None or a.died > self.returned

    def lifetime_floor(self) -> int:
        """The peak if every buffer the call does not return were freed right after its last use, in the same
        order of allocations and launches and on one stream."""
        ends = [(a.born, a.died if self.held_by_caller(a) or a.died is None else max(a.born, a.last_use), a.nbytes)
                for a in self.allocations]
        return max((sum(n for b, e, n in ends if b <= t and (e is None or t <= e)) for t, _, _ in ends), default=0)

    def mark(self, direction: str, stage: str):
        self.poll()
        self.timeline.append((direction, stage, self.current, self._stage_peak))
        self._stage_peak = self.current

    def launch(self, name: str, tensors):
        """A kernel launch of config ``name`` taking ``tensors``: recorded (``Launch``), and their last use."""
        self.launches.append(Launch(name, len(self.timeline), span_bytes(tensors)))
        self.use(tensors)

    def use(self, tensors):
        """One event (a kernel launch, an operator) that takes ``tensors``: their storages' last use."""
        self.events += 1
        for t in tensors:
            hit = self._live.get(t.untyped_storage()._cdata)
            if hit is not None:
                hit[1].last_use = self.events

    def alive(self) -> tuple:
        return tuple(a for _, a in self._live.values())


def _site(stack_skip: int = 3):
    """(site, func, name) of the innermost frame in ``kernels/`` (else in this repository)."""
    f = sys._getframe(stack_skip)
    first_repo = None
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(KERNELS):
            break
        if first_repo is None and fn.startswith(ROOT) and not fn.endswith("memory_plan.py"):
            first_repo = f
        f = f.f_back
    f = f or first_repo
    if f is None:
        return "(autograd engine)", "-", "-"
    fn, line = f.f_code.co_filename, f.f_lineno
    m = _ASSIGN.match(linecache.getline(fn, line))
    func = f.f_code.co_name
    if func in ("<genexpr>", "<listcomp>", "<lambda>") and f.f_back is not None:
        func = f.f_back.f_code.co_name
    return f"{os.path.relpath(fn, ROOT)}:{line}", func, (m.group(1).strip() if m else "(expression)")


class _Tracer(TorchDispatchMode):
    """Records every new storage an operator returns into ``trace``."""

    def __init__(self, trace: MemoryTrace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        given = {t.untyped_storage()._cdata for t in inputs}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s._cdata
                if self.trace.tracks(key) or key in given or s.nbytes() == 0:      # a view, in place, or empty
                    continue
                site, fn, name = _site()
                self.trace.alloc(Allocation(len(self.trace.allocations), key, s.nbytes(), tuple(t.shape), t.dtype,
                                            site, fn, name, str(func), 0), s)
        self.trace.use(inputs + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


class _FakeStream:
    """A pipeline's side stream off a GPU: the same call order, no streams."""

    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def stub_kernel_path(trace: MemoryTrace | None = None):
    """The kernel path on the CPU: no-op kernels, the sm_90 checks faked, the side stream a stand-in; with
    ``trace``, the pipeline stages record their ends into it."""
    import kernels.backward.pipeline as bpipe
    import kernels.build as build
    import kernels.forward.pipeline as fpipe
    from kernels.interface import check_inputs

    def no_op_kernel(cfg):
        if trace is None:
            return lambda *args: None
        return lambda *args: trace.launch(cfg.name, [a for a in args if isinstance(a, torch.Tensor)])

    with contextlib.ExitStack() as st:
        st.enter_context(_patched(build, "get_kernel", no_op_kernel))
        st.enter_context(_patched(fpipe, "check_inputs", functools.partial(check_inputs, require_cuda=False)))
        st.enter_context(_patched(torch.cuda, "get_device_capability", lambda *a: (9, 0)))
        st.enter_context(_patched(bpipe, "_side_stream", lambda dev: _FakeStream()))
        st.enter_context(_patched(fpipe, "side_stream", lambda dev: _FakeStream()))
        st.enter_context(_patched(torch.cuda, "current_stream", lambda *a: _FakeStream()))
        st.enter_context(_patched(torch.cuda, "stream", lambda s: contextlib.nullcontext()))
        st.enter_context(_patched(torch.Tensor, "record_stream", lambda self, s: None))
        if trace is not None:
            for mod, direction in ((fpipe, "forward"), (bpipe, "backward")):
                for stage in STAGES[mod.__name__]:
                    st.enter_context(_patched(mod, stage, _marked(getattr(mod, stage), trace, direction, stage)))
        yield


def _marked(fn, trace, direction, stage):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        out = fn(*a, **kw)
        trace.mark(direction, stage)
        return out
    return wrapper


def inputs(B, T, H, HV, lens, dtype=torch.bfloat16, *, DK=D, h0=False):
    """(leaves q, k, v, g, beta with requires_grad, kwargs, do, dht) of the backward benchmark's call (zeros:
    values do not change what is allocated); K = V = ``DK``, an fp32 initial state where ``h0``."""
    q, k = (torch.zeros(B, T, H, DK, dtype=dtype) for _ in range(2))
    v = torch.zeros(B, T, HV, DK, dtype=dtype)
    g, beta = (torch.zeros(B, T, HV) for _ in range(2))
    cu = None
    if lens:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    N = len(lens) if lens else B
    do = torch.zeros(B, T, HV, DK, dtype=dtype)
    dht = torch.zeros(N, HV, DK, DK)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    kw = dict(output_final_state=True, cu_seqlens=cu)
    if h0:
        kw["initial_state"] = torch.zeros(N, HV, DK, DK)
    return leaves, kw, do, dht


@dataclass
class Plan:
    """One shape's traced forward + backward: ``trace``; ``grads`` the bytes of the gradients' storages (``grad_keys``
their identities); ``profiler_peak`` the CPU allocator's peak (``check``) or None."""
    shape: str
    trace: MemoryTrace
    grads: int
    grad_keys: tuple = ()
    profiler_peak: int | None = None

    @property
    def peak(self) -> int:
        return self.trace.peak

    @property
    def peak_above_grads(self) -> int:
        return self.trace.peak - self.grads


def _fwd_bwd(leaves, kw, do, dht, alter=None):
    from kernels.autograd import apply
    o, ht = apply(*leaves, **kw, alter=alter)
    torch.autograd.backward((o, ht), (do, dht))
    return o, ht


def plan(shape: str, check: bool = False, dtype=torch.bfloat16, alter=None) -> Plan:
    """Trace one forward + backward at ``shape`` (a name of ``SHAPES``, or a tuple (B, T, H, HV, lens)); ``alter``:
    ``kernels.autograd.apply``'s plan function (a benchmark's A/B column, ``bench_kernels_bwd.alter``)."""
    B, T, H, HV, lens = SHAPES[shape] if isinstance(shape, str) else shape
    leaves, kw, do, dht = inputs(B, T, H, HV, lens, dtype)
    with stub_kernel_path():
        _fwd_bwd(leaves, kw, do, dht, alter)            # warm-up: the layout caches, as the benchmark's first call
    for x in leaves:
        x.grad = None
    trace = MemoryTrace()
    with stub_kernel_path(trace), _Tracer(trace):
        o, ht = _fwd_bwd(leaves, kw, do, dht, alter)
    trace.poll()
    trace.returned = trace.events
    del o, ht
    trace.poll()
    stores = {x.grad.untyped_storage()._cdata: x.grad.untyped_storage().nbytes() for x in leaves}
    out = Plan(shape if isinstance(shape, str) else str(shape), trace, sum(stores.values()), tuple(stores))
    if check:
        for x in leaves:
            x.grad = None
        out.profiler_peak = _profiler_peak(leaves, kw, do, dht)
    return out


def gpu_peak(call) -> int:
    """Peak bytes the CUDA allocator holds during ``call()`` above what it held before (synchronised), the figure
    of ``bench_kernels_bwd``; for comparing a traced plan with the GPU."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _profiler_peak(leaves, kw, do, dht) -> int:
    """Peak bytes above the start of one call from the CPU allocator's events (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile
    with stub_kernel_path(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _fwd_bwd(leaves, kw, do, dht)
    ev = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in ev:
        cur += n
        peak = max(peak, cur)
    return peak


def _mib(n) -> str:
    return f"{n / MiB:9.1f}"


def render(p: Plan, top: int = 30) -> list:
    """The per-shape report: the timeline per stage and the tensors alive at the peak, largest first."""
    t = p.trace
    lines = [f"== {p.shape}: timeline (MiB above the inputs at each stage's end; the peak within it)"]
    lines += [f"  {d:<9} {s:<17} {_mib(cur)} {_mib(pk)}" for d, s, cur, pk in t.timeline]
    alive = sorted(t.peak_alive, key=lambda a: -a.nbytes)
    lines += ["", f"== {p.shape}: {len(alive)} tensors alive at the peak ({t.peak / MiB:.1f} MiB), largest first; "
              f"* past its last use, ^ outlives the call"]
    for a in alive[:top]:
        flag = "^" if t.held_by_caller(a) else "*" if a.last_use < t.peak_event else " "
        lines.append(f"  {a.nbytes / MiB:8.1f} {flag} {str(tuple(a.shape)):<24} {str(a.dtype)[6:]:<9} {a.label}")
    rest = alive[top:]
    if rest:
        lines.append(f"  {sum(a.nbytes for a in rest) / MiB:8.1f}  ({len(rest)} more)")
    return lines


def launch_table(p: Plan) -> list:
    """Every kernel launch of the call in order: its stage, its config and the MiB its tensor arguments span
    (``span_bytes``), with each direction's sum."""
    t = p.trace
    lines = [f"== {p.shape}: kernel launches, MiB their tensor arguments span (each view once)"]
    sums = {}
    for ln in t.launches:
        d, s = t.timeline[ln.stage][:2] if ln.stage < len(t.timeline) else ("?", "?")
        sums[d] = sums.get(d, 0) + ln.nbytes
        lines.append(f"  {d:<9} {s:<17} {_mib(ln.nbytes)}  {ln.name}")
    lines += [f"  {d:<9} {'(sum)':<17} {_mib(n)}" for d, n in sums.items()]
    return lines


def summary(plans) -> list:
    """The summary table (MiB)."""
    head = f"{'shape':<26} {'peak':>9} {'peak-grads':>11} {'grads':>8} {'at peak':>8} {'floor':>8}"
    head += " profiler" if any(p.profiler_peak is not None for p in plans) else ""
    lines = ["peak memory of one fwd+bwd above its inputs, MiB (CPU trace, no-op kernels); floor: the peak with every",
             "buffer freed after its last use (same order, one stream)", head]
    for p in plans:
        row = (f"{p.shape:<26} {p.peak / MiB:9.1f} {p.peak_above_grads / MiB:11.1f} {p.grads / MiB:8.1f} "
               f"{len(p.trace.peak_alive):8d} {p.trace.lifetime_floor() / MiB:8.1f}")
        if p.profiler_peak is not None:
            row += f" {p.profiler_peak / MiB:8.1f}"
        lines.append(row)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="B1_T32768_H16_HV32",
                    help=f"comma-separated names of {', '.join(SHAPES)}")
    ap.add_argument("--top", type=int, default=30, help="tensors listed at the peak")
    ap.add_argument("--check", action="store_true", help="also the CPU allocator's peak (torch.profiler)")
    ap.add_argument("--launches", action="store_true",
                    help="also every kernel launch with the MiB its tensor arguments span (a traffic estimate)")
    ap.add_argument("--ab", default=None, metavar="COL",
                    help="the plans of benchmarks/bench_kernels_bwd.py's A/B column COL, not the dispatched ones")
    ap.add_argument("--record", default=None, metavar="PATH", nargs="?", const="",
                    help="append the summary table to PATH (no PATH: benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    bad = [s for s in names if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown shape(s) {', '.join(bad)} (known: {', '.join(SHAPES)})")
    alter = None
    if args.ab is not None:
        from benchmarks.bench_kernels_bwd import AB, alter as ab_alter
        if args.ab not in AB:
            ap.error(f"--ab: unknown column {args.ab!r} (known: {', '.join(AB)})")
        alter = ab_alter(args.ab)
    plans = []
    for name in names:
        try:
            p = plan(name, check=args.check, alter=alter)
        except Exception as e:  # noqa: BLE001 - one shape failing does not stop the others
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        plans.append(p)
        print("\n".join(render(p, args.top)) + "\n", flush=True)
        if args.launches:
            print("\n".join(launch_table(p)) + "\n", flush=True)
    table = summary(plans)
    print("\n".join(table))
    if args.record is not None:
        from benchmarks import record
        print("appended as:", record.append("benchmarks/memory_plan.py", table, gpu="CPU trace (no-op kernels)",
                                            **({"path": args.record} if args.record else {})))
    return 0 if len(plans) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
