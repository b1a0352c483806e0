"""A compile warm-up pass before a sweep: first-use compilation in parallel processes.

On a cold GPU box, compilation dominates a sweep. FLA's Triton autotuning takes 20-60 s per new shape or
dtype, and FlashQLA's and our TileLang JIT about as long. The sweep's worker (one per GPU) would pay these
costs one after another. ``warmup`` first runs every backend once on one representative case per *compile
signature*, in ``procs`` processes that share the GPU and get the next (signature, backend) task as they
finish one. Signatures that differ only in T, B or the sequence lengths form a *family* that mostly shares
compiled kernels: each (family, backend) pair's first task runs before the pair's others are handed out, so
that processes do not compile the same kernels side by side (``Scheduler``). The signature is the case without its seed, with the
distribution reduced to the in-kernel flags it sets, since those are what select kernels. Each process
compiles into the disk caches: Triton's, TileLang's, and Triton's autotuning results, because the runner
sets ``TRITON_CACHE_AUTOTUNING=1``. The sweep's workers then load from those caches.

The warm-up writes no rows. Its errors are only counted: the sweep runs every cell again and records what
happens there. A warm-up process that dies, for example from a poisoned CUDA context, loses only the run it
was doing; the others take the rest. The cost is one extra run of each signature, which is small next to compiling.

Autotuning here runs while the processes share the GPU, so the configuration it picks can differ from the
one a lone process would pick. That changes speed, and possibly the rounding order, but not what is
compared: every backend is judged against fp64 on the same inputs.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import time
import traceback
from dataclasses import dataclass, field

import torch

from cases.case import CONFIG_FIELDS, Case
from cases.distributions import get_distribution


COMPILE_FIELDS = tuple(f for f in CONFIG_FIELDS if f != "dist")  # the distribution counts only by its flags


def _in_kernel_flags(case: Case) -> tuple:
    d = get_distribution(case.dist)
    return (d.qk_l2norm_in_kernel, d.gate_in_kernel, d.beta_sigmoid_in_kernel)


def signature(case: Case) -> tuple:
    """What decides which kernels a case compiles: the case without seed, with the distribution reduced to its
    in-kernel flags (q/k L2 norm, gate, beta sigmoid)."""
    return tuple(getattr(case, f) for f in COMPILE_FIELDS) + (_in_kernel_flags(case),)


def representatives(cases: list[Case]) -> list[Case]:
    """The first case of every compile signature, in order."""
    seen, out = set(), []
    for c in cases:
        s = signature(c)
        if s not in seen:
            seen.add(s)
            out.append(c)
    return out


def family(case: Case) -> tuple:
    """The compile signature without what kernels seldom specialise on (T, B, the sequence lengths): cases of one
    family mostly share compiled kernels and autotuning results, so its first run fills the caches for the rest."""
    from cases.layouts import get_layout

    shape = tuple(getattr(case, f) for f in COMPILE_FIELDS if f not in ("layout", "B", "T"))
    return (get_layout(case.layout).varlen,) + shape + (_in_kernel_flags(case),)


class Scheduler:
    """Hands out (case id, backend) warm-up tasks. The first task of each (family, backend) is a *leader*; the
    others of that pair wait until their leader has ended (done, failed or its process died), so that processes
    do not compile the same kernels side by side. Leaders go out first, in the given order."""

    def __init__(self, reps: list[Case], names: list[str]):
        self.leaders: list[tuple[str, str]] = []
        self.waiting: dict[tuple, list[tuple[str, str]]] = {}
        self.ready: list[tuple[str, str]] = []
        self.key: dict[tuple[str, str], tuple] = {}
        for c in reps:
            for n in names:
                k = (family(c), n)
                task = (c.id, n)
                self.key[task] = k
                if k in self.waiting:
                    self.waiting[k].append(task)
                else:
                    self.waiting[k] = []
                    self.leaders.append(task)
        self.open = len(self.key)  # tasks not yet ended

    def next(self) -> tuple[str, str] | None:
        """The next task to run, or None when every remaining one waits on a running leader (or none is left)."""
        if self.leaders:
            return self.leaders.pop(0)
        return self.ready.pop(0) if self.ready else None

    def ended(self, task: tuple[str, str]) -> None:
        """``task`` finished (in whatever way): the tasks waiting on it become ready if it was a leader."""
        self.open -= 1
        self.ready.extend(self.waiting.pop(self.key[task], []))

    def finished(self) -> bool:
        return self.open == 0


@dataclass
class WarmupSummary:
    procs: int
    signatures: int
    runs: int = 0  # backend runs that completed
    errors: int = 0  # backend runs that raised (the sweep records what happens there)
    died: int = 0  # warm-up processes that exited abnormally (each loses the one run it was doing)
    left: int = 0  # tasks not run when the timeout ended the pass
    seconds: float = 0.0
    busy_s: float = 0.0  # the runs' seconds summed over processes (busy_s / seconds: the parallelism achieved)
    first_errors: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, backend, case id), longest first

    def as_dict(self) -> dict:
        return {"procs": self.procs, "signatures": self.signatures, "runs": self.runs, "errors": self.errors,
                "died": self.died, "left": self.left, "seconds": round(self.seconds, 1), "busy_s": round(self.busy_s, 1),
                "first_errors": self.first_errors[:5],
                "slowest": [[round(t, 1), b, c] for t, b, c in sorted(self.slowest, reverse=True)[:5]]}


def summary_line(w: dict) -> str:
    """One line of a summary's ``as_dict()``: counts, wall and busy time, the three slowest tasks (printed by the
    runner and by pytest)."""
    return (f"{w['signatures']} signatures, {w['runs']} runs, {w['errors']} errors, {w['died']} died, "
            f"{w['seconds']:.0f} s in {w['procs']} processes (busy {w['busy_s']:.0f} s); slowest: "
            + ", ".join(f"{b} {t:.0f} s" for t, b, _ in w["slowest"][:3]))


def _warm_one(case: Case, backend, device: torch.device) -> str | None:
    """Run ``backend`` once on ``case``: None when done, "skip" when it cannot run the case, else the error."""
    from cases.inputs import make_inputs
    from parity.refs import grad_outputs

    if not backend.available()[0] or not backend.supports(case, device)[0]:
        return "skip"
    try:
        inputs = make_inputs(case, device)
        grads = grad_outputs(case, inputs) if case.grad and backend.has_backward else None
        backend.run(inputs, grad_outputs=grads)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - counted; the sweep records it properly
        return f"{backend.name} on {case.id}: {type(e).__name__}: {str(e)[:160]}"
    return None


def _proc_main(conn, specs: list[str], device: str, threads: int) -> None:
    """Receive (case id, backend name) tasks over ``conn`` until ``None``; after each run send back (case id,
    backend, seconds, outcome). A pipe sends at once, so a later crash loses nothing already reported."""
    from parity.backends import resolve

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backends = {b.name: b for b in resolve(specs)}  # a module:Class spec of the baseline: once
    conn.send("ready")
    while (task := conn.recv()) is not None:
        cid, name = task
        t0 = time.perf_counter()
        try:
            outcome = _warm_one(Case.from_id(cid), backends[name], dev)
        except Exception:  # noqa: BLE001 - e.g. inputs that cannot be made; counted
            outcome = traceback.format_exc(limit=2)[-300:]
        conn.send((cid, name, time.perf_counter() - t0, outcome))
    conn.close()


def warmup(cases: list[Case], specs: list[str], devices: list[str], procs: int,
           timeout: float = 1800.0) -> WarmupSummary:
    """Run every backend (``specs``, as ``resolve`` takes them) once on one case per compile signature. Each
    (signature, backend) pair is one task; ``procs`` processes spread over the ``devices`` (round robin) get
    the next task when they finish one, the leaders of ``Scheduler`` first and gradient cases first among
    them, so that one backend's long compile (FLA's autotuning, say) does not hold up the others. Returns
    what happened; never raises for a backend."""
    from parity.backends import resolve

    reps = sorted(representatives(cases), key=lambda c: not c.grad)  # stable: gradient signatures first
    names = list({b.name: None for b in resolve(specs)})
    sched = Scheduler(reps, names)
    procs = max(1, min(procs, sched.open))
    summary = WarmupSummary(procs=procs, signatures=len(reps))
    if sched.finished():
        return summary
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # inherited by the processes and the sweep's workers
    threads = max(1, (os.cpu_count() or 1) // procs)
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    running, conns, doing, idle = [], [], {}, []
    for i in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_proc_main, args=(child, specs, devices[i % len(devices)], threads), daemon=True)
        p.start()
        child.close()
        running.append(p)
        conns.append(parent)

    def hand_out(conn) -> None:
        task = sched.next()
        if task is None and not sched.finished():
            idle.append(conn)  # every open task waits on a running leader
            return
        if task is not None:
            doing[conn] = task
        try:
            conn.send(task)  # None: no task is left, the process ends
        except (BrokenPipeError, OSError):  # it died meanwhile; the EOF branch below sees it
            pass

    def feed_idle() -> None:
        """Give the idle processes what the last ended task made ready (or the end, when none is left)."""
        while idle and (sched.leaders or sched.ready or sched.finished()):
            hand_out(idle.pop(0))

    deadline = t0 + timeout
    live = list(conns)
    while live and time.perf_counter() < deadline:
        for conn in mp.connection.wait(live, timeout=1.0):
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the process ended: died, unless it had been told to stop
                live.remove(conn)
                task = doing.pop(conn, None)
                if task is not None:  # its task ends with it; what waited on it is ready
                    sched.ended(task)
                    feed_idle()
                continue
            if msg != "ready":
                cid, name, secs, outcome = msg
                sched.ended(doing.pop(conn))
                if outcome != "skip":
                    summary.busy_s += secs
                    summary.slowest = sorted(summary.slowest + [(secs, name, cid)], reverse=True)[:5]
                    if outcome is None:
                        summary.runs += 1
                    else:
                        summary.errors += 1
                        summary.first_errors.append(outcome)
                feed_idle()
            hand_out(conn)
    killed = set()
    if live:  # the timeout: stop every process still running at once (a compile can take minutes)
        for p in running:
            if p.is_alive():
                p.kill()
                killed.add(p.pid)
    for conn in conns:
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    for p in running:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(5)
            killed.add(p.pid)
    summary.died = sum(1 for p in running if p.exitcode != 0 and p.pid not in killed)
    summary.left = sched.open  # tasks that never ended: not started, or stopped by the timeout
    summary.seconds = time.perf_counter() - t0
    return summary
