"""The sweep runner: cases x backends into a result file, in worker processes that can die.

Each worker process owns one device (one per GPU; on a CPU, up to two) and runs whole cases handed
to it by the parent, reporting each cell's rows as soon as it has them. If a worker dies (an illegal
memory access poisons a CUDA context; a segfault; a cell that hangs past ``cell_timeout``), the
parent records an error for the cell in flight, starts a new worker and hands it the rest of that
case: one failing cell never loses the others. ``workers=0`` runs everything in this process
(debuggable, no crash protection). ``resume`` skips the cases whose rows are all in the result file and runs
again every case with a row missing (a cell, a pairwise or an attribution row) or a cell its worker did not
finish; ``shard`` takes every n-th case so that several machines can split a matrix. One run writes a result
file at a time (parity.results.WriteLock).
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import multiprocessing.connection
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cases.case import Case
from parity import environment
from parity.backends import resolve
from parity.execute import ContextPoisoned, availability, run_case, status_rows, versions
from parity.refs import REF_VERSION, RefCache
from parity.results import FLOOR_BACKEND, ResultWriter, WriteLock, latest_rows, load


@dataclass
class RunConfig:
    """What to run and where to write it."""

    cases: list[Case]
    out: Path
    backends: list[str] | None = None  # None: every registered backend
    matrix: str = "custom"
    seeds: int | None = None
    workers: int | None = None  # None: one per GPU, or 2 on a CPU; 0: in this process
    resume: bool = False
    repeat: bool | None = None  # run each backend twice (determinism, warm time); None: only on a GPU
    pairwise: bool = True
    attribution: bool = True  # chunk-state rows (tensor "h") for backends that expose them, dense cases
    cache_dir: str | None = None  # None: the default cache; "" disables it
    cell_timeout: float = 900.0
    progress: bool = True
    shard: tuple[int, int] | None = None  # (k, n): cases k-1, k-1+n, ... (1-based k)
    warmup: int | None = None  # compile warm-up processes (parity/warmup.py); None: auto on a GPU, off on a CPU; 0: off
    extra_meta: dict = field(default_factory=dict)


def shard_cases(cases: list[Case], shard: tuple[int, int] | None) -> list[Case]:
    """Shard k of n (1-based): every n-th case starting at the k-th."""
    if shard is None:
        return cases
    k, n = shard
    if not (n >= 1 and 1 <= k <= n):
        raise ValueError(f"shard must be k/n with 1 <= k <= n, got {k}/{n}")
    return cases[k - 1::n]


def plan(cases: list[Case], backend_names: list[str], done: set[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Tasks (case_id, cells still to run) for the cells not in ``done``; the rounding floor is a cell too
    (FLOOR_BACKEND). A case whose cells are all done is skipped."""
    tasks = []
    for c in cases:
        todo = [b for b in (FLOOR_BACKEND, *backend_names) if (c.id, b) not in done]
        if todo:
            tasks.append((c.id, todo))
    return tasks


def missing_rows(case: Case, backends, rows: dict, pairwise: bool = True, attribution: bool = True,
                 available: set[str] = frozenset()) -> list[str]:
    """What the result rows ``rows`` ({row_key: row}, parity.results.latest_rows) lack for ``case`` run on
    ``backends`` (objects): a cell without a row for every tensor, a cell its worker did not finish (rows marked
    ``interrupted``), a cell recorded ``unavailable`` of a backend in ``available`` (available now), a pairwise row
    between two backends that both ran cleanly, an attribution row of a clean backend that exposes chunk states.
    Empty when the case is complete."""
    from parity.attribution import TENSOR as H, eligible
    from parity.backends.base import Backend
    from parity.refs import tensor_names

    names = tensor_names(case)
    out, clean = [], []
    for b in (FLOOR_BACKEND, *(x.name for x in backends)):
        got = [rows.get((case.id, b, "fp64", t)) for t in names]
        if any(r is None for r in got):
            out.append(f"{b}: rows of {', '.join(t for t, r in zip(names, got) if r is None)}")
        elif any(r.get("interrupted") for r in got):
            why = (got[0].get("reason") or "").partition("\n")[0][:120]
            out.append(f"{b}: did not finish ({why})")
        elif b in available and all(r.get("status") == "unavailable" for r in got):
            out.append(f"{b}: unavailable when the case ran, available now")
        elif b != FLOOR_BACKEND and all(r.get("status") == "ok" for r in got):
            clean.append(b)
    if pairwise:
        pairs = {(r["backend"], r["against"]) for k, r in rows.items() if k[0] == case.id and k[2] != "fp64"}
        out += [f"pairwise {a} vs {b}" for i, a in enumerate(sorted(clean)) for b in sorted(clean)[i + 1:]
                if (a, b) not in pairs]
    if attribution and eligible(case):
        offers = {x.name for x in backends if type(x).chunk_states is not Backend.chunk_states}
        out += [f"attribution {b}" for b in clean if b in offers and (case.id, b, "fp64", H) not in rows]
    return out


def resume_plan(cases: list[Case], backends, rows: list[dict], pairwise: bool = True,
                attribution: bool = True, available: set[str] | None = None) -> list[tuple[str, list[str]]]:
    """Tasks for a resumed run: every case with anything missing (``missing_rows``; a backend that was unavailable
    when the case ran and is available now counts as missing) runs again whole (every
    backend, so that its pairwise and attribution rows are recomputed too; the rounding floor only when its rows
    are missing), its new rows replacing the old; complete cases are skipped."""
    index = latest_rows(rows)
    names = [b.name for b in backends]
    if available is None:  # the backends available now, when the caller has not asked them already
        available = {b.name for b in backends if availability(b)["available"]}
    tasks = []
    for c in cases:
        lack = missing_rows(c, backends, index, pairwise, attribution, available)
        if lack:
            floor = [FLOOR_BACKEND] if any(m.startswith(f"{FLOOR_BACKEND}:") for m in lack) else []
            tasks.append((c.id, floor + names))
    return tasks


def backend_specs(backends) -> list[str]:
    """``module:Class`` of each backend object: how worker and warm-up processes resolve them again."""
    return [f"{type(b).__module__}:{type(b).__qualname__}" for b in backends]


def warmup_procs(requested: int | None, n_tasks: int) -> int:
    """Processes of the compile warm-up pass: ``requested`` when given; by default min(12, CPU cores - 2) on a GPU
    box (where first-use compilation dominates a cold sweep; each process mostly waits on a single-threaded
    compiler) and none on a CPU or for a handful of tasks."""
    if requested is not None:
        return max(0, requested)
    if not torch.cuda.is_available() or n_tasks < 8:
        return 0
    return max(1, min(12, (os.cpu_count() or 3) - 2))


def devices(workers: int | None) -> list[str]:
    """The device of each worker: every GPU once (cycled if more workers are asked for), else CPU slots."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu:
        n = n_gpu if workers is None else max(workers, 1)
        return [f"cuda:{i % n_gpu}" for i in range(n)]
    n = min(2, os.cpu_count() or 1) if workers is None else max(workers, 1)
    return ["cpu"] * n


# ----------------------------------------------------------------------------------------------- worker


def _worker_main(wid: int, device: str, specs: list[str], cache_dir, repeat: bool, pairwise: bool,
                 attribution: bool, threads: int, conn) -> None:
    """A worker: receives (case_id, cells) over ``conn`` and sends back every message synchronously (a pipe, not
    a queue with a feeder thread), so nothing it reported is lost if it dies right after."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backends = {b.name: b for b in resolve(specs)}
    cache = RefCache(cache_dir) if cache_dir != "" else None
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            break
        case_id, names = task
        try:
            case = Case.from_id(case_id)
            ref_s = run_case(case, [backends[n] for n in names if n != FLOOR_BACKEND], dev, cache,
                             lambda name, rows: conn.send(("rows", name, rows)),
                             lambda name: conn.send(("begin", name)),
                             repeat=repeat, pairwise=pairwise, floor=FLOOR_BACKEND in names,
                             attribution=attribution)
            conn.send(("done", ref_s))
        except ContextPoisoned as err:
            conn.send(("poisoned", str(err)))
            os._exit(3)
        except Exception:  # noqa: BLE001 - reported, the worker carries on
            conn.send(("case_error", traceback.format_exc(limit=8)))


@dataclass
class _Worker:
    wid: int
    device: str
    proc: mp.Process
    conn: object
    task: tuple[str, list[str]] | None = None
    emitted: set = field(default_factory=set)
    inflight: str | None = None
    last_seen: float = 0.0
    ready: bool = False


class _Pool:
    def __init__(self, config: RunConfig, specs: list[str], on_rows, on_done):
        self.ctx = mp.get_context("spawn")
        self.config, self.specs = config, specs
        self.on_rows, self.on_done = on_rows, on_done
        devs = devices(config.workers)
        self.threads = max(1, (os.cpu_count() or 1) // len(devs)) if devs[0] == "cpu" else 1
        self.workers = [self._start(i, d) for i, d in enumerate(devs)]
        self.pending: collections.deque = collections.deque()
        self.restarts = 0

    def _start(self, wid: int, device: str) -> _Worker:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, daemon=True, args=(
            wid, device, self.specs, self.config.cache_dir, self.config.repeat, self.config.pairwise,
            self.config.attribution, self.threads, child))
        proc.start()
        child.close()
        return _Worker(wid=wid, device=device, proc=proc, conn=parent, last_seen=time.monotonic())

    def _assign(self) -> None:
        for w in self.workers:
            if w.task is None and w.ready and self.pending:
                w.task = self.pending.popleft()
                w.emitted, w.inflight, w.last_seen = set(), None, time.monotonic()
                w.conn.send(w.task)

    def _handle(self, w: _Worker, msg) -> None:
        kind = msg[0]
        w.last_seen = time.monotonic()
        if kind == "ready":
            w.ready = True
        elif kind == "begin":
            w.inflight = msg[1]
        elif kind == "rows":
            w.emitted.add(msg[1])
            self.on_rows(msg[2])
        elif kind == "done":
            case_id = w.task[0]
            w.task, w.inflight = None, None
            self.on_done(case_id, msg[1])
        elif kind == "case_error":
            self._fail_rest(w, f"the harness failed on this case: {msg[1]}")
            case_id = w.task[0]
            w.task, w.inflight = None, None
            self.on_done(case_id, 0.0)
        elif kind == "poisoned":
            pass  # its rows were sent; the process exits and is replaced

    def _fail_rest(self, w: _Worker, reason: str, only_inflight: bool = False) -> None:
        """Error rows for the cell in flight (or for every cell of the task not yet reported)."""
        case_id, names = w.task
        case = Case.from_id(case_id)
        todo = list(names)
        if only_inflight:
            todo = [w.inflight] if w.inflight and w.inflight not in w.emitted else []
        for name in todo:
            if name not in w.emitted:
                self.on_rows([{**r, "interrupted": True} for r in status_rows(case, name, "error", reason)])
                w.emitted.add(name)

    def _receive(self, w: _Worker) -> bool:
        """Handle one message from ``w``; False when its pipe is closed (the process is gone)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return False
        self._handle(w, msg)
        return True

    def _replace(self, w: _Worker, reason: str) -> None:
        """A worker died or hung: record its cell in flight as an error, requeue the rest of its case."""
        while w.conn.poll(0) and self._receive(w):
            pass
        if not w.ready:
            raise RuntimeError(f"a worker process failed to start on {w.device} ({reason}); run with --workers 0 to "
                               f"see the error in this process")
        if w.task is not None:
            case_id, names = w.task
            if w.inflight == FLOOR_BACKEND or w.inflight is None:
                self._fail_rest(w, f"{reason} while computing the fp64 reference")
                self.on_done(case_id, 0.0)
            else:
                self._fail_rest(w, f"{reason} while running this cell", only_inflight=True)
                rest = [n for n in names if n not in w.emitted and n != FLOOR_BACKEND]
                if rest:
                    self.pending.appendleft((case_id, rest))
                else:
                    self.on_done(case_id, 0.0)
            w.task = None
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=10)
        w.conn.close()
        self.restarts += 1
        self.workers[w.wid] = self._start(w.wid, w.device)

    def run(self, tasks) -> None:
        self.pending.extend(tasks)
        try:
            while self.pending or any(w.task is not None for w in self.workers):
                self._assign()
                ready = mp.connection.wait([w.conn for w in self.workers], timeout=1.0)
                dead = []
                for w in list(self.workers):
                    if w.conn in ready and not self._receive(w):
                        dead.append(w)
                now = time.monotonic()
                for w in list(self.workers):
                    if w in dead or not w.proc.is_alive():
                        w.proc.join(timeout=5)
                        self._replace(w, f"the worker process died (exit code {w.proc.exitcode})")
                    elif w.task is not None and now - w.last_seen > self.config.cell_timeout:
                        self._replace(w, f"the cell timed out after {self.config.cell_timeout:.0f} s")
        except KeyboardInterrupt:  # stop now: a running cell's rows are lost, finished cells are on disk
            for w in self.workers:
                if w.proc.is_alive():
                    w.proc.kill()
            raise
        finally:
            for w in self.workers:
                try:
                    if w.proc.is_alive():
                        w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for w in self.workers:
                w.proc.join(timeout=30)
                if w.proc.is_alive():
                    w.proc.kill()


# ----------------------------------------------------------------------------------------------- driver


def run(config: RunConfig) -> Path:
    """Run the configured sweep, appending to ``config.out``; returns its path. Holds the file's WriteLock
    throughout (parity.results.FileLocked when another run holds it)."""
    cases = shard_cases(config.cases, config.shard)
    backends = resolve(config.backends)
    with WriteLock(config.out) as lock:
        return _run_locked(config, cases, backends, lock)


def _run_locked(config: RunConfig, cases: list[Case], backends, lock: WriteLock) -> Path:
    names = [b.name for b in backends]
    if not config.resume and Path(config.out).exists():
        raise FileExistsError(f"{config.out} exists; pass --resume to continue it or choose another --out")
    avail = {b.name: {**availability(b), "conversion": b.conversion} for b in backends}
    if config.resume and Path(config.out).exists():
        tasks = resume_plan(cases, backends, load(config.out).rows, config.pairwise, config.attribution,
                            {name for name, a in avail.items() if a["available"]})
    else:
        tasks = plan(cases, names, set())
    if config.repeat is None:
        config.repeat = torch.cuda.is_available()
    env = environment.collect()
    header = {
        "run_id": Path(config.out).parent.name, "matrix": config.matrix, "seeds": config.seeds,
        "shard": None if config.shard is None else f"{config.shard[0]}/{config.shard[1]}",
        "backends": names, "availability": avail, "versions": {b.name: versions(b) for b in backends},
        "ref_version": REF_VERSION, "cases": len(cases), "tasks": len(tasks), "env": env, **config.extra_meta,
    }
    writer = ResultWriter(config.out, header, lock=lock)
    totals = {"ref_s": 0.0, "cases": 0}
    bar = _progress(len(tasks), config.progress)

    def on_rows(rows):
        writer.write_cell(rows)

    def on_done(case_id, ref_s):
        totals["ref_s"] += ref_s
        totals["cases"] += 1
        bar.update(1)

    t0 = time.perf_counter()
    restarts = 0
    warm = None
    specs = backend_specs(backends)
    procs = warmup_procs(config.warmup, len(tasks)) if config.workers != 0 else 0
    if procs and tasks:
        from parity.warmup import summary_line, warmup

        todo = {case_id for case_id, _ in tasks}
        bar.set_postfix_str(f"compile warm-up in {procs} processes")
        warm = warmup([c for c in cases if c.id in todo], specs, devices(None), procs).as_dict()
        print(f"compile warm-up: {summary_line(warm)}", file=sys.stderr)
    if config.workers == 0:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cache = RefCache(config.cache_dir) if config.cache_dir != "" else None
        by_name = {b.name: b for b in backends}
        for case_id, todo in tasks:
            case = Case.from_id(case_id)
            bar.set_postfix_str(case_id[:60])
            ref_s = run_case(case, [by_name[n] for n in todo if n != FLOOR_BACKEND], dev, cache,
                             lambda name, rows: on_rows(rows), repeat=config.repeat, pairwise=config.pairwise,
                             floor=FLOOR_BACKEND in todo, attribution=config.attribution)
            on_done(case_id, ref_s)
    elif tasks:
        pool = _Pool(config, specs, on_rows, on_done)
        pool.run(tasks)
        restarts = pool.restarts
    bar.close()
    wall = time.perf_counter() - t0
    writer.finish({"wall_s": wall, "ref_s": totals["ref_s"], "cases_run": totals["cases"],
                   "worker_restarts": restarts, "warmup": warm})
    return Path(config.out)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
