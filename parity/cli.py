"""Command line: ``python -m parity {run,list,report,merge}``.

    python -m parity run --matrix standard [--backends fla-triton,flash-qla] [--T 8192,20468] [--dist qwen-gates]
    python -m parity list
    python -m parity warmup --matrix standard [--backends ...] [--procs 12]   # compile only, no results
    python -m parity report reports/<run>/results.jsonl
    python -m parity merge shard1.jsonl shard2.jsonl --out reports/<run>/results.jsonl
    python -m parity compare reports/<run-a> reports/<run-b> [--factor 1.5] [--out compare.md] [--allow-missing]
    python -m parity replay layer0.safetensors [--backends fla-triton,flash-qla] [--out reports/replay-layer0]
    python -m parity engines [reports/<run>/results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import sys
from pathlib import Path

from cases.case import Case
from cases.distributions import DISTRIBUTIONS
from cases.dtypes import DTYPES
from cases.layouts import LAYOUTS
from cases.matrices import MATRICES, get_matrix
from parity.results import FileLocked

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def _csv(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


# argparse ``type=`` validators: each names what it wants (argparse adds the argument's name to the message)


def _number(kind: type, low, strict: bool = False):
    """A finite ``kind`` (int or float) >= ``low`` (> ``low`` when ``strict``)."""
    bound = f"{'>' if strict else '>='} {low:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} {bound}, got {text!r}") from None
        if not (value > low if strict else value >= low) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} {bound}, got {text}")
        return value
    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


def _shard(text: str) -> tuple[int, int]:
    """'k/n' with 1 <= k <= n, or 'auto' (parity.scheduler: from a Slurm array's or an Indexed Job's environment)."""
    if text == "auto":
        return _shard_auto()
    parts = text.split("/")
    try:
        k, n = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected k/n with integers 1 <= k <= n, e.g. 1/4, or auto; got {text!r}") \
            from None
    if not (n >= 1 and 1 <= k <= n):
        raise argparse.ArgumentTypeError(f"expected k/n with 1 <= k <= n (shards are 1-based), got {text!r}")
    return k, n


def _shard_auto() -> tuple[int, int]:
    """--shard auto: (k, n) from the Slurm array task's or Kubernetes Indexed Job pod's environment."""
    import os

    from parity.scheduler import shard_from_env

    try:
        return shard_from_env(os.environ)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--shard auto: ")) from None


def _names(known, what: str):
    """Comma-separated names, each one of ``known``."""
    def parse(text: str) -> str:
        names = _csv(text) or []
        if not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} names, got {text!r}")
        bad = [n for n in names if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; known: {', '.join(known)}")
        return text
    parse.__name__ = f"{what} names"
    return parse


def _t_list(text: str) -> str:
    """Comma-separated positive integers."""
    names = _csv(text) or []
    try:
        values = [int(t) for t in names]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return text


def _existing(text: str) -> str:
    """A path that exists."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or folder: {text!r}")
    return text


def _matrix_name(args) -> str:
    if args.matrix != "auto":
        return args.matrix
    import torch

    return "standard" if torch.cuda.is_available() else "smoke"


def _case_args(args) -> tuple[str, list[Case]]:
    """--case values: exact ids, and glob patterns (``*``, ``?``, ``[``) that pick cases of --matrix by id."""
    exact = [c for c in args.case if not any(ch in c for ch in "*?[")]
    globs = [c for c in args.case if c not in exact]
    cases = []
    for c in exact:
        try:
            cases.append(Case.from_id(c))
        except (ValueError, KeyError) as err:
            raise ValueError(f"--case {c!r}: {err}") from None
    name = "custom"
    if globs:
        name = _matrix_name(args)
        pool = get_matrix(name).cases(args.seeds)
        for pattern in globs:
            hits = [c for c in pool if fnmatch.fnmatchcase(c.id, pattern)]
            if not hits:
                raise ValueError(f"--case {pattern!r} matches no case of matrix {name!r}")
            cases += hits
    return name, list({c.id: c for c in cases}.values())


def select_cases(args) -> tuple[str, list[Case]]:
    """The matrix's cases (or --case ids and id globs) filtered by --T/--dist/--layout/--dtype/--g-dtype."""
    if args.case:
        return _case_args(args)
    name = _matrix_name(args)
    cases = get_matrix(name).cases(args.seeds)
    filters = {"T": [int(t) for t in _csv(args.T) or []], "dist": _csv(args.dist), "layout": _csv(args.layout),
               "dtype": _csv(args.dtype), "g_dtype": _csv(args.g_dtype)}
    for field, allowed in filters.items():
        if allowed:
            cases = [c for c in cases if getattr(c, field) in allowed]
    if args.limit is not None:
        cases = cases[: args.limit]
    return name, cases


def cmd_run(args) -> int:
    from parity import environment, report, runner

    matrix, cases = select_cases(args)
    if not cases:
        print("no case matches the filters", file=sys.stderr)
        return 2
    _check_backends(args.backends)
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder; give the result file, e.g. {out / 'results.jsonl'}")
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        tag = environment.machine_tag(environment.gpu_info())
        out = REPORTS / f"{stamp}-{matrix}-{tag}" / "results.jsonl"
    cfg = runner.RunConfig(
        cases=cases, out=out, backends=_csv(args.backends), matrix=matrix, seeds=args.seeds, workers=args.workers,
        resume=args.resume, attribution=not args.no_attribution, pairwise=not args.no_pairwise,
        repeat=False if args.no_repeat else (True if args.repeat else None),
        cache_dir=("" if args.cache == "none" else args.cache), cell_timeout=args.cell_timeout,
        progress=not args.no_progress, shard=args.shard, warmup=args.warmup)
    print(f"running {len(runner.shard_cases(cases, cfg.shard))} cases of matrix {matrix!r} -> {out}", file=sys.stderr)
    try:
        path = runner.run(cfg)
    except KeyboardInterrupt:  # every finished cell is already on disk (one flushed write per cell)
        print(f"interrupted: the finished cells are in {out}; continue with the same command and --resume",
              file=sys.stderr)
        return 130
    print(f"results: {path}")
    if not args.no_report:
        rep = report.write_report([path])
        print(f"report:  {rep}")
    return 0


def _check_backends(text: str | None) -> None:
    """ValueError naming --backends when a spec does not resolve to a backend."""
    from parity.backends import resolve

    try:
        resolve(_csv(text))
    except ValueError as err:
        raise ValueError(f"--backends: {err}") from None


def cmd_warmup(args) -> int:
    """Compile what a sweep of the selected cases would compile (parity/warmup.py), write nothing but the caches."""
    import json

    from parity import runner
    from parity.backends import resolve
    from parity.warmup import warmup

    matrix, cases = select_cases(args)
    if not cases:
        print("no case matches the filters", file=sys.stderr)
        return 2
    _check_backends(args.backends)
    backends = resolve(_csv(args.backends))
    specs = runner.backend_specs(backends)
    procs = runner.warmup_procs(args.procs, len(cases)) or max(1, args.procs or 1)
    print(f"compile warm-up of {len(cases)} cases of matrix {matrix!r}, {len(backends)} backends, {procs} processes",
          file=sys.stderr)
    w = warmup(cases, specs, runner.devices(None), procs, timeout=args.timeout).as_dict()
    print(json.dumps(w, indent=1))
    return 0 if not w["died"] else 1


def cmd_list(args) -> int:
    from tabulate import tabulate

    from parity.backends import all_backends, plugins
    from parity.execute import availability

    print("Matrices:")
    rows = []
    for m in MATRICES.values():
        cs = m.cases()
        rows.append((m.name, len({c.group_id for c in cs}), m.seeds, len(cs), m.description))
    print(tabulate(rows, headers=["matrix", "configs", "seeds", "cases", "what"], tablefmt="simple"))
    print("\nDistributions:")
    print(tabulate([(d.name, d.rationale) for d in DISTRIBUTIONS.values()], tablefmt="plain"))
    print("\nLayouts:")
    print(tabulate([(lay.name, lay.rationale) for lay in LAYOUTS.values()], tablefmt="plain"))
    print("\nBackends:")
    rows = []
    for name, cls in all_backends().items():
        a = availability(cls())
        rows.append((name, "yes" if a["available"] else "no", a["reason"], cls.description))
    print(tabulate(rows, headers=["backend", "available", "reason / note", "what"], tablefmt="simple"))
    for problem in plugins().problems:
        print(f"warning: {problem}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from parity import report

    out = report.write_report(args.results, args.out)
    print(f"report: {out}")
    return 0


def cmd_merge(args) -> int:
    from parity import report, results

    rs = results.merge(args.results, args.out)
    print(f"merged {len(args.results)} files: {len(rs.rows)} rows -> {args.out}")
    for problem in rs.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not args.no_report:
        print(f"report: {report.write_report([args.out])}")
    return 0


def cmd_compare(args) -> int:
    from parity import compare

    cmp = compare.compare_files(args.a, args.b, args.factor, allow_missing=args.allow_missing)
    text = compare.render(cmp)
    lost = len(cmp.missing_in_b())
    if lost:
        print(f"{'warning' if args.allow_missing else 'error'}: {lost} cell(s) of {args.a} have no row in {args.b}"
              + ("" if args.allow_missing else " (exit code 1; --allow-missing accepts that)"), file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        counts = cmp.table["state"].value_counts()
        print(", ".join(f"{counts.get(s, 0)} {s}" for s in compare.STATES) + f" -> {args.out}")
    else:
        print(text)
    return cmp.exit_code


def cmd_replay(args) -> int:
    from parity import replay, results
    from parity.verdicts import judge_frame

    res, rep = replay.replay(args.file, backends=_csv(args.backends), out=args.out, pairwise=not args.no_pairwise,
                             repeat=False if args.no_repeat else (True if args.repeat else None))
    judged = judge_frame(results.load(res).frame())
    for r in judged.to_dict("records"):
        value = f"rel_rmse {r['rel_rmse']:.3e}" if r["status"] == "ok" else r["status"]
        note = r["v_message"].splitlines()[0][:160] if r["verdict"] != "PASS" and r["v_message"] else ""
        print(f"{r['backend']:>16} {r['tensor']:>3} {r['verdict']:<11} {value:<19} {note}".rstrip())
    print(f"results: {res}\nreport:  {rep}")
    return 0


def cmd_engines(args) -> int:
    from parity import engines

    if not args.results:
        print(engines.machine_view())
        return 0
    from parity import report, results

    missing = [p for p in args.results if not Path(p).is_file()]
    if missing:
        raise ValueError(f"engines: no result file at {', '.join(missing)}")
    rs = results.load(*args.results)
    df = report.frame(rs)
    print(engines.section(rs, df))
    return 0


def _add_selection(r: argparse.ArgumentParser) -> None:
    """The case and backend selection that ``run`` and ``warmup`` share."""
    r.add_argument("--matrix", default="auto", help="smoke | standard | long | full | auto (standard with a GPU, "
                   "else smoke)")
    r.add_argument("--case", action="append", help="run exactly this case id, or the cases of --matrix whose ids match "
                   "this glob (e.g. 'varlen-*'); repeatable, the union is run; the other filters do not apply")
    r.add_argument("--backends", help="comma-separated backend names or module:Class (default: all)")
    r.add_argument("--T", type=_t_list, help="only these T (comma-separated)")
    r.add_argument("--dist", type=_names(DISTRIBUTIONS, "distribution"), help="only these distributions")
    r.add_argument("--layout", type=_names(LAYOUTS, "layout"), help="only these layouts")
    r.add_argument("--dtype", type=_names(DTYPES, "dtype"), help="only these q/k/v dtypes")
    r.add_argument("--g-dtype", type=_names(DTYPES, "dtype"), help="only these gate dtypes")
    r.add_argument("--limit", type=_number(int, 1), help="only the first N cases (N >= 1)")
    r.add_argument("--seeds", type=_number(int, 1), help="seeds per configuration (default: the matrix's)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity", description="GDN kernels against an fp64 reference")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a matrix and write results + report")
    _add_selection(r)
    r.add_argument("--out", help="result file (default: reports/<date>-<matrix>-<machine>/results.jsonl)")
    r.add_argument("--resume", action="store_true", help="continue an existing result file, skipping finished cells")
    r.add_argument("--shard", type=_shard, help="k/n: run every n-th case starting at the k-th (1-based); auto: k and "
                   "n from a Slurm job array or a Kubernetes Indexed Job (parity/scheduler.py)")
    r.add_argument("--workers", type=_number(int, 0),
                   help="worker processes (default: one per GPU, 2 on a CPU; 0: in-process)")
    r.add_argument("--warmup", type=_number(int, 0),
                   help="processes of the compile warm-up pass before the sweep (default: on a "
                   "GPU min(12, CPU cores - 2); 0: off; see parity/warmup.py)")
    r.add_argument("--repeat", action="store_true", help="run each backend twice: determinism and warm time (the "
                   "default on a GPU)")
    r.add_argument("--no-repeat", action="store_true", help="run each backend once (the default on a CPU)")
    r.add_argument("--no-pairwise", action="store_true", help="skip the backend-vs-backend comparisons")
    r.add_argument("--no-attribution", action="store_true", help="skip the per-chunk state comparison (tensor h)")
    r.add_argument("--cache", help="fp64 reference cache folder, or 'none' (default: ~/.cache/gdn-parity/ref)")
    r.add_argument("--cell-timeout", type=_number(float, 0, strict=True), default=900.0,
                   help="seconds a cell may run before its worker is "
                   "replaced")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-report", action="store_true")
    r.set_defaults(fn=cmd_run)

    w = sub.add_parser("warmup", help="compile what a run of these cases would compile (fills the caches; no results)",
                       description="The run's compile warm-up pass alone (parity/warmup.py): every backend once per "
                       "compile signature, in parallel processes; prints its summary (time, busy time, slowest tasks) "
                       "as JSON. Exit status 1 when a warm-up process died.")
    _add_selection(w)
    w.add_argument("--procs", type=_number(int, 1),
                   help="processes (default: on a GPU min(12, CPU cores - 2), else 1)")
    w.add_argument("--timeout", type=_number(float, 0, strict=True), default=1800.0,
                   help="seconds after which the processes are stopped "
                   "and the summary of what finished is printed (default 1800)")
    w.set_defaults(fn=cmd_warmup)

    sub.add_parser("list", help="matrices, distributions, layouts, backends").set_defaults(fn=cmd_list)

    rp = sub.add_parser("report", help="render report.md from result files")
    rp.add_argument("results", nargs="+", type=_existing)
    rp.add_argument("--out", help="report path (default: report.md next to the first file)")
    rp.set_defaults(fn=cmd_report)

    m = sub.add_parser("merge", help="join result files (shards) into one and render its report")
    m.add_argument("results", nargs="+", type=_existing)
    m.add_argument("--out", required=True)
    m.add_argument("--no-report", action="store_true")
    m.set_defaults(fn=cmd_merge)

    c = sub.add_parser(
        "compare", help="compare two result sets cell by cell (exit code 1 on a new failure)",
        description="Compare two result sets (two GPUs, two library versions, two commits) cell by cell: each "
        "(case id, backend, tensor) against fp64, judged on each side by the verdict rule. States: new failure "
        "(PASS in A, FAIL/ERROR in B), fixed (the reverse), worse/better (both pass, rel_rmse B/A beyond --factor), "
        "same, not comparable (missing on one side, skipped on either, or not the same inputs); NaN appearing or "
        "going away is flagged on every cell. Cases and backends match by id and name; environments may differ.",
        epilog="exit status: 1 when any cell is a new failure or B lacks cells of A (unless --allow-missing), so CI "
        "can gate on it; 0 otherwise; 2 when an argument is wrong or a file cannot be read.")
    c.add_argument("a", metavar="RUN_A", type=_existing,
                   help="the result file (or run folder) compared against: the old one")
    c.add_argument("b", metavar="RUN_B", type=_existing,
                   help="the result file (or run folder) being checked: the new one")
    c.add_argument("--factor", type=_number(float, 1, strict=True), default=1.5,
                   help="rel_rmse ratio B/A beyond which a passing cell is "
                   "worse (or, below 1/factor, better); default 1.5")
    c.add_argument("--out", help="write the markdown summary here (default: print it)")
    c.add_argument("--allow-missing", action="store_true", help="exit 0 although B lacks cells that A has (by "
                   "default that fails: a run that crashed or did nothing must not pass a CI gate)")
    c.set_defaults(fn=cmd_compare)

    rr = sub.add_parser(
        "replay", help="run every backend on a GDN call captured from a model (parity.replay.capture)",
        description="Run every backend on inputs captured from a real model (a safetensors file written by "
        "parity.replay.capture: q, k, v, g, beta and optionally initial_state, cu_seqlens, A_log, dt_bias, with "
        "scale and flags as metadata) against the fp64 reference; writes results.jsonl and report.md.")
    rr.add_argument("file", type=_existing, help="the capture (.safetensors)")
    rr.add_argument("--backends", help="comma-separated backend names or module:Class (default: all)")
    rr.add_argument("--out", help="output folder (default: reports/replay-<file stem>/)")
    rr.add_argument("--repeat", action="store_true", help="run each backend twice (the default on a GPU)")
    rr.add_argument("--no-repeat", action="store_true", help="run each backend once (the default on a CPU)")
    rr.add_argument("--no-pairwise", action="store_true", help="skip the backend-vs-backend comparisons")
    rr.set_defaults(fn=cmd_replay)
    e = sub.add_parser("engines", help="which GDN prefill kernel vLLM and SGLang run here, and its verdicts",
                       description="For this machine (or the machine of the result files), which GDN prefill kernel "
                       "vLLM and SGLang would run by their documented rules (parity/engines.py), how they convert g "
                       "and beta, and the verdicts of that backend over the run's cases.")
    e.add_argument("results", nargs="*", help="result files of a run (default: this machine, no verdicts)")
    e.set_defaults(fn=cmd_engines)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 2 for a wrong argument (argparse's message names it) or an unreadable file."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse has printed the usage and the argument's error (or --help)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return args.fn(args)
    except (ValueError, FileExistsError, FileLocked) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
