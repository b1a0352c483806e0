"""A compile warm-up pass before a sweep: first-use compilation in parallel processes.

On a cold GPU box, compilation dominates a sweep. FLA's Triton autotuning takes 20-60 s per new shape or
dtype, and FlashQLA's and our TileLang JIT about as long. The sweep's worker (one per GPU) would pay these
costs one after another. ``warmup`` first runs every backend once, in ``procs`` processes that share the GPU,
on one representative case per *compile signature*. The signature is the case without its seed, with the
distribution reduced to the in-kernel flags it sets, since those are what select kernels. Each process
compiles into the disk caches: Triton's, TileLang's, and Triton's autotuning results, because the runner
sets ``TRITON_CACHE_AUTOTUNING=1``. The sweep's workers then load from those caches.

The warm-up writes no rows. Its errors are only counted: the sweep runs every cell again and records what
happens there. A warm-up process that dies, for example from a poisoned CUDA context, loses only its own
share. The cost is one extra run of each signature, which is small next to compiling.

Autotuning here runs while the processes share the GPU, so the configuration it picks can differ from the
one a lone process would pick. That changes speed, and possibly the rounding order, but not what is
compared: every backend is judged against fp64 on the same inputs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field

import torch

from cases.case import Case
from cases.distributions import get_distribution


def signature(case: Case) -> tuple:
    """What decides which kernels a case compiles: the case without seed, with the distribution reduced to its
    in-kernel flags (q/k L2 norm, gate, beta sigmoid)."""
    d = get_distribution(case.dist)
    flags = (d.qk_l2norm_in_kernel, d.gate_in_kernel, d.beta_sigmoid_in_kernel)
    return (case.layout, case.B, case.T, case.H, case.HV, case.K, case.V, case.dtype, case.g_dtype,
            case.beta_dtype, case.h0_dtype, case.state_v_first, case.grad, flags)


def representatives(cases: list[Case]) -> list[Case]:
    """The first case of every compile signature, in order."""
    seen, out = set(), []
    for c in cases:
        s = signature(c)
        if s not in seen:
            seen.add(s)
            out.append(c)
    return out


@dataclass
class WarmupSummary:
    procs: int
    signatures: int
    runs: int = 0  # backend runs that completed
    errors: int = 0  # backend runs that raised (the sweep records what happens there)
    died: int = 0  # warm-up processes that exited abnormally
    seconds: float = 0.0
    first_errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"procs": self.procs, "signatures": self.signatures, "runs": self.runs, "errors": self.errors,
                "died": self.died, "seconds": round(self.seconds, 1), "first_errors": self.first_errors[:5]}


def _warm_one(case: Case, backends, device: torch.device) -> tuple[int, int, list[str]]:
    """Run each supporting backend once on ``case``; (completed, raised, messages)."""
    from cases.inputs import make_inputs
    from parity.refs import grad_outputs

    done, failed, msgs = 0, 0, []
    inputs = make_inputs(case, device)
    for b in backends:
        if not b.available()[0] or not b.supports(case, device)[0]:
            continue
        try:
            grads = grad_outputs(case, inputs) if case.grad and b.has_backward else None
            b.run(inputs, grad_outputs=grads)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            done += 1
        except Exception as e:  # noqa: BLE001 - counted; the sweep records it properly
            failed += 1
            msgs.append(f"{b.name} on {case.id}: {type(e).__name__}: {str(e)[:160]}")
    return done, failed, msgs


def _proc_main(case_ids: list[str], specs: list[str], device: str, threads: int, conn) -> None:
    from parity.backends import resolve

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backends = list({b.name: b for b in resolve(specs)}.values())  # a module:Class spec of the baseline: once
    done = failed = 0
    msgs: list[str] = []
    for cid in case_ids:
        try:
            d, f, m = _warm_one(Case.from_id(cid), backends, dev)
        except Exception:  # noqa: BLE001 - e.g. inputs that cannot be made; counted
            d, f, m = 0, 1, [traceback.format_exc(limit=2)[-300:]]
        done, failed = done + d, failed + f
        msgs.extend(m)
    conn.send((done, failed, msgs[:5]))
    conn.close()


def warmup(cases: list[Case], specs: list[str], devices: list[str], procs: int,
           timeout: float = 1800.0) -> WarmupSummary:
    """Run every backend (``specs``, as ``resolve`` takes them) once on one case per compile signature, spread over
    ``procs`` processes and the ``devices`` (round robin). Returns what happened; never raises for a backend."""
    reps = representatives(cases)
    procs = max(1, min(procs, len(reps)))
    summary = WarmupSummary(procs=procs, signatures=len(reps))
    if not reps:
        return summary
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # inherited by the processes and the sweep's workers
    threads = max(1, (os.cpu_count() or 1) // procs)
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    running = []
    for i in range(procs):
        share = [c.id for c in reps[i::procs]]
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_proc_main, args=(share, specs, devices[i % len(devices)], threads, child),
                        daemon=True)
        p.start()
        child.close()
        running.append((p, parent))
    deadline = t0 + timeout
    for p, conn in running:
        got = False
        try:
            if conn.poll(max(0.0, deadline - time.perf_counter())):
                done, failed, msgs = conn.recv()
                summary.runs += done
                summary.errors += failed
                summary.first_errors.extend(msgs)
                got = True
        except (EOFError, OSError):
            pass
        p.join(timeout=max(0.0, deadline - time.perf_counter()) + 5)
        if p.is_alive():
            p.kill()
            p.join(5)
        if not got:
            summary.died += 1
    summary.seconds = time.perf_counter() - t0
    return summary
