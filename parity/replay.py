"""Replay one GDN call captured from a real model through every backend, judged as the sweep judges a case.

Inside an inference engine's GDN layer (e.g. where vLLM or SGLang call ``chunk_gated_delta_rule``), one line
writes the call's arguments to a safetensors file::

    from parity.replay import capture
    capture("layer0.safetensors", q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True, model="Qwen3-Next-80B-A3B", layer=0)

and ``python -m parity replay layer0.safetensors`` runs every backend on exactly those tensors against the fp64
reference, with the sweep's metrics, rounding floor, same-precision baseline, pairwise rows and verdicts, into a
normal result file and report (``reports/replay-<stem>/``).

The file: tensors q, k, v, g, beta (required) and initial_state (or ``h0``), cu_seqlens, A_log, dt_bias
(optional), named and shaped as in FLA's call; metadata strings ``format`` = gdn-parity-capture, ``version``,
the flags use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, state_v_first ("true" /
"false"), ``scale`` (a float; absent: K ** -0.5) and any free-form notes (model, layer, engine, ...).

The captured call is judged as a case-like record, ``CapturedCase``: the fields of ``cases.Case`` (so its rows
have the sweep's columns), layout and dist ``captured``, id ``replay:<file stem>:<sha8>`` where sha8 hashes the
tensors and the flags (the same call captured twice has the same id; other tensors under the same file name get
another id, which ``python -m parity compare`` reports as not comparable rather than as a change). A backend's
``supports`` is asked with the registered ``Case`` nearest to the capture (same shapes and dtypes, a registered
distribution with the same in-kernel transforms), since backends decide support from a case's fields.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import InitVar, dataclass
from pathlib import Path

import torch

from cases.inputs import GDNInputs
from parity.backends.base import Backend
from parity.refs import digest

FORMAT = "gdn-parity-capture"
VERSION = 1
REQUIRED = ("q", "k", "v", "g", "beta")
OPTIONAL = ("initial_state", "cu_seqlens", "A_log", "dt_bias")
ALIASES = {"h0": "initial_state"}
FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "state_v_first")
RESERVED = ("format", "version", "scale", *FLAGS)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


# ----------------------------------------------------------------------------------------------- capture


def capture(path: str | os.PathLike, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, *, initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
            scale: float | None = None, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
            use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
            use_beta_sigmoid_in_kernel: bool = False, state_v_first: bool = False, **notes) -> Path:
    """Write one GDN call's arguments (FLA's names and layouts) to ``path`` for ``python -m parity replay``.

    Call it before the kernel (the kernel or the engine may update the state in place afterwards). Tensors are
    copied to the CPU in their own dtypes; ``notes`` (model=..., layer=...) are kept as metadata strings. Shapes
    are checked here (ValueError naming the tensor); values are not, so a call that already holds NaN is still
    written, and replay says so."""
    from reference.validate import check_inputs

    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, A_log, dt_bias, check_values=False)
    clash = sorted(set(notes) & set(RESERVED))
    if clash:
        raise ValueError(f"capture notes may not use the reserved names {', '.join(clash)}")
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
             "cu_seqlens": cu_seqlens, "A_log": A_log, "dt_bias": dt_bias}
    tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named.items() if t is not None}
    meta = {"format": FORMAT, "version": str(VERSION),
            **{f: "true" if flag else "false" for f, flag in zip(FLAGS, (
                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, state_v_first))},
            **({"scale": repr(float(scale))} if scale is not None else {}),
            **{str(key): str(val) for key, val in notes.items()}}
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------- load


@dataclass(frozen=True, kw_only=True)
class CapturedCase:
    """A captured call as a case: ``cases.Case``'s fields (the columns of every row), with layout and dist
    ``captured`` and no gradients; ``label`` ('<stem>:<sha8>') makes the id ``replay:<stem>:<sha8>``."""

    layout: str = "captured"
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    g_dtype: str
    beta_dtype: str
    h0_dtype: str | None = None
    dist: str = "captured"
    state_v_first: bool = False
    grad: bool = False
    seed: int = 0
    label: InitVar[str] = "capture"

    def __post_init__(self, label: str):
        object.__setattr__(self, "_label", label)

    @property
    def id(self) -> str:
        return f"replay:{self._label}"

    @property
    def group_id(self) -> str:
        """replay:<stem>: captures under one file name share it, so compare pairs them up."""
        return "replay:" + self._label.rsplit(":", 1)[0]

    def __str__(self) -> str:
        return self.id


@dataclass
class Capture:
    """A loaded capture file: the inputs, the case, the sha256 of tensors and flags, the free-form notes."""

    path: Path
    inputs: GDNInputs
    case: CapturedCase
    sha256: str
    notes: dict[str, str]

    @property
    def stem(self) -> str:
        return self.case.group_id.split(":", 1)[1]

    def settings(self) -> dict:
        """The flags and scale the call ran with."""
        return {**{f: getattr(self.inputs, f) for f in FLAGS}, "scale": self.inputs.scale}


def _flag(path: Path, meta: dict, name: str) -> bool:
    text = str(meta.get(name, "false")).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{path}: metadata {name}={meta[name]!r} is not a flag (true/false)")


def _scale(path: Path, meta: dict) -> float | None:
    if meta.get("scale") in (None, "", "None"):
        return None
    try:
        scale = float(meta["scale"])
    except ValueError:
        raise ValueError(f"{path}: metadata scale={meta['scale']!r} is not a number") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{path}: metadata scale={meta['scale']!r} must be a positive finite number")
    return scale


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise ValueError(f"{path}: no such capture file")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as err:  # noqa: BLE001 - any unreadable file is one kind of problem for the user
        raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def load_capture(path: str | os.PathLike) -> Capture:
    """Read and validate a capture file; every problem is a ValueError that names the file and what is wrong."""
    from cases.dtypes import name_of
    from reference.validate import check_inputs

    path = Path(path)
    tensors, meta = _read(path)
    fmt, version = meta.get("format"), meta.get("version", str(VERSION))
    if fmt not in (None, FORMAT):
        raise ValueError(f"{path}: metadata format={fmt!r}, not a {FORMAT} file")
    if not version.isdigit() or int(version) > VERSION:
        raise ValueError(f"{path}: capture version {version!r} is not one this harness reads (<= {VERSION})")
    for alias, name in ALIASES.items():
        if alias in tensors:
            if name in tensors:
                raise ValueError(f"{path}: holds both {alias!r} and {name!r}; keep one initial state")
            tensors[name] = tensors.pop(alias)
    unknown = sorted(set(tensors) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"{path}: unknown tensor(s) {', '.join(unknown)}; a capture holds "
                         f"{', '.join(REQUIRED + OPTIONAL)} (h0 for initial_state)")
    missing = [n for n in REQUIRED if n not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {', '.join(missing)}; every capture needs {', '.join(REQUIRED)}")
    flags = {f: _flag(path, meta, f) for f in FLAGS}
    scale = _scale(path, meta)
    gate_params = [n for n in ("A_log", "dt_bias") if n in tensors]
    if flags["use_gate_in_kernel"] and len(gate_params) < 2:
        raise ValueError(f"{path}: use_gate_in_kernel is true but A_log and dt_bias are not both present")
    if gate_params and not flags["use_gate_in_kernel"]:
        raise ValueError(f"{path}: holds {' and '.join(gate_params)} but use_gate_in_kernel is false (set the flag "
                         f"if the kernel computed the gate, or drop them)")
    t = tensors
    if not (t["q"].dtype == t["k"].dtype == t["v"].dtype):
        raise ValueError(f"{path}: q, k and v must share a dtype, got {t['q'].dtype}, {t['k'].dtype}, {t['v'].dtype}")
    try:
        dims = check_inputs(t["q"], t["k"], t["v"], t["g"], t["beta"], t.get("initial_state"), t.get("cu_seqlens"),
                            flags["state_v_first"], t.get("A_log"), t.get("dt_bias"))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if dims.T == 0:
        raise ValueError(f"{path}: q has no tokens (T=0)")
    cu = t.get("cu_seqlens")
    seq_lens = [b - a for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])] if cu is not None else [dims.T] * dims.B
    inputs = GDNInputs(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], initial_state=t.get("initial_state"),
                       cu_seqlens=cu, scale=scale, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"),
                       seq_lens=seq_lens, **flags)
    settings = {**flags, "scale": scale}
    sha = digest(tensors, settings)
    stem = re.sub(r"[\s:]+", "-", path.name.removesuffix(".safetensors")) or "capture"
    h0 = t.get("initial_state")
    case = CapturedCase(B=dims.B, T=dims.T, H=dims.H, HV=dims.HV, K=dims.K, V=dims.V, dtype=name_of(t["q"].dtype),
                        g_dtype=name_of(t["g"].dtype), beta_dtype=name_of(t["beta"].dtype),
                        h0_dtype=None if h0 is None else name_of(h0.dtype), state_v_first=flags["state_v_first"],
                        label=f"{stem}:{sha[:8]}")
    notes = {key: val for key, val in meta.items() if key not in RESERVED}
    return Capture(path=path, inputs=inputs, case=case, sha256=sha, notes=notes)


# ----------------------------------------------------------------------------------------------- replay


def nearest_case(cap: Capture):
    """The registered ``cases.Case`` a backend's ``supports`` is asked with: the capture's shapes and dtypes, layout
    varlen-one (varlen-padded when ``cu_seqlens[-1] < T``) or dense, and the registered distribution whose in-kernel transforms match the capture's best."""
    from cases.case import Case
    from cases.distributions import DISTRIBUTIONS

    inp, c = cap.inputs, cap.case
    want = (inp.use_gate_in_kernel, inp.use_beta_sigmoid_in_kernel)

    def distance(d):
        return (any(want) != (d.gate_in_kernel or d.beta_sigmoid_in_kernel),
                want != (d.gate_in_kernel, d.beta_sigmoid_in_kernel),
                inp.use_qk_l2norm_in_kernel != d.qk_l2norm_in_kernel)

    dist = min((d for d in DISTRIBUTIONS.values() if not d.needs_h0), key=distance)
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(Case)}
    layout = "dense"
    if inp.cu_seqlens is not None:
        layout = "varlen-padded" if int(inp.cu_seqlens[-1]) < inp.q.shape[1] else "varlen-one"
    return Case(**{**fields, "layout": layout, "dist": dist.name})


class AsCaptured(Backend):
    """``backend`` with its ``supports`` asked about ``proxy`` (the nearest registered Case) instead of the
    CapturedCase; everything else is the backend's own."""

    def __init__(self, backend: Backend, proxy):
        self.backend, self.proxy = backend, proxy
        self.name, self.description = backend.name, backend.description
        self.has_backward, self.needs_gpu = backend.has_backward, backend.needs_gpu

    def available(self):
        return self.backend.available()

    def supports(self, case, device):
        return self.backend.supports(self.proxy, device)

    def run(self, inputs, grad_outputs=None):
        return self.backend.run(inputs, grad_outputs)

    def versions(self):
        return self.backend.versions()

    def chunk_states(self, inputs):
        return self.backend.chunk_states(inputs)


def default_out(path: str | os.PathLike) -> Path:
    from parity.environment import ROOT

    return ROOT / "reports" / f"replay-{Path(path).name.removesuffix('.safetensors')}"


def replay(path: str | os.PathLike, backends: list[str] | None = None, out: str | os.PathLike | None = None,
           repeat: bool | None = None, pairwise: bool = True, device: str | None = None) -> tuple[Path, Path]:
    """Run ``backends`` (default: all; the baseline always) on the captured call; write ``out``/results.jsonl and
    ``out``/report.md (default out: reports/replay-<stem>/). Returns (results, report)."""
    from parity import environment
    from parity.backends import resolve
    from parity.execute import ContextPoisoned, availability, run_case, status_rows, versions
    from parity.refs import REF_VERSION
    from parity.results import FLOOR_BACKEND, ResultWriter, load

    cap = load_capture(path)
    out = Path(out) if out else default_out(path)
    results_path = out / "results.jsonl"
    if results_path.exists():
        raise FileExistsError(f"{results_path} exists; remove it or choose another --out")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeat = dev.type == "cuda" if repeat is None else repeat
    chosen = resolve(backends)
    proxy = nearest_case(cap)
    case = cap.case
    header = {
        "run_id": out.name, "matrix": "replay", "seeds": None, "shard": None, "backends": [b.name for b in chosen],
        "availability": {b.name: availability(b) for b in chosen},
        "versions": {b.name: versions(b) for b in chosen}, "ref_version": REF_VERSION, "cases": 1, "tasks": 1,
        "env": environment.collect(),
        "capture": {"file": str(cap.path), "sha256": cap.sha256, "case_id": case.id, "settings": cap.settings(),
                    "notes": cap.notes, "sequences": len(cap.inputs.seq_lens), "supports_asked_as": proxy.id,
                    "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                                for n, t in cap.inputs._tensors().items() if t is not None}},
    }
    writer = ResultWriter(results_path, header)
    t0 = time.perf_counter()
    emitted, ref_s = set(), 0.0

    def emit(name, rows):
        nonlocal ref_s
        emitted.add(name)
        if name == FLOOR_BACKEND and rows and rows[0].get("ref_s") is not None:
            ref_s = rows[0]["ref_s"]
        writer.write_cell(rows)

    try:
        run_case(case, [AsCaptured(b, proxy) for b in chosen], dev, None, emit, repeat=repeat, pairwise=pairwise,
                 attribution=False, inputs=cap.inputs)
    except ContextPoisoned as err:  # in this process there is no worker to replace: the rest is recorded, not run
        for b in chosen:
            if b.name not in emitted:
                writer.write_cell(status_rows(case, b.name, "error", f"not run: the CUDA context broke ({err})"))
    writer.finish({"wall_s": time.perf_counter() - t0, "ref_s": ref_s, "cases_run": 1, "worker_restarts": 0})
    report_path = out / "report.md"
    report_path.write_text(render_report(load(results_path), cap))
    return results_path, report_path


def section_capture(cap: Capture) -> str:
    """What was captured: file, id, shapes, flags, notes, and how to rerun a backend on it."""
    from parity.markdown import md_rows

    inp = cap.inputs
    rows = [("file", f"`{cap.path}`"), ("case id", f"`{cap.case.id}`"), ("sha256", cap.sha256),
            ("sequences", f"{len(inp.seq_lens)}" + (f" (lengths {', '.join(map(str, inp.seq_lens))})"
                                                    if len(inp.seq_lens) <= 16 else ""))]
    rows += [(n, f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}") for n, t in inp._tensors().items()
             if t is not None]
    rows += [(k, str(v)) for k, v in cap.settings().items()] + [(f"note: {k}", v) for k, v in cap.notes.items()]
    return "\n".join([
        "## Captured inputs", "", md_rows(rows, ["", ""]), "",
        f"Rerun one backend on it: `python -m parity replay {cap.path} --backends <backend> --out <dir>` (the "
        f"`python -m parity run --case ...` commands in failure messages apply to sweep cases, not to replays).", ""])


def render_report(rs, cap: Capture) -> str:
    """The sweep's report of the replay's result file, with the captured inputs before the environment."""
    from parity import report

    text = report.render(rs)
    mark = "## Environment"
    section = section_capture(cap)
    return text.replace(mark, section + "\n\n" + mark, 1) if mark in text else text + "\n" + section
