"""The engine view: which GDN prefill kernel each serving engine would run on a machine, how it converts g and
beta, and the verdicts of that exact backend over a run's cases.

The selection rules are data (``ENGINES``), one function per engine, each citing the engine source it follows:
- vLLM (0.33; ``_resolve_gdn_prefill_backend`` in vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py):
  with ``gdn_prefill_backend=auto`` FlashInfer on SM90, and on SM10.x when K = 128 (CUDA 13 and an intact
  nvidia-cutlass-dsl-libs-cu13 install); otherwise its FLA copy.
- SGLang (0.5.23's documented rule): FlashInfer when the state pool is fp32, K = V = 128 and a chunked prefill is
  at most 32768 tokens; otherwise its FLA copy. The kernel is picked in python/sglang/srt/layers/attention/linear/
  (gdn_kernel_dispatcher.py); kernels/gdn_flashinfer.py makes the call (l2norm_fwd on Q/K, alpha = exp(g) fp32,
  beta fp32, fp32 K-last state) and runs the prefill on SM90 only (it raises on SM100+). The state pool is taken as
  fp32 (the Qwen3-Next/3.5 checkpoints' ``mamba_ssm_dtype``) and a case's B*T tokens as one chunked prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from cases.case import Case

SGLANG_MAX_PREFILL = 32768
FLASHINFER_GATES = "g -> alpha = exp(g) fp32, beta -> fp32 (FlashInfer takes linear-space gates)"
FLA_COPY_GATES = "g log-space and beta as the layer computes them (fused_gdn_gating: g fp32{beta})"


@dataclass(frozen=True)
class EngineRule:
    """engine: its name; package: the distribution whose version is shown; documented: the version the rule was
    read from; source: the file; picks: (compute capability or None, case) -> (backend name, why); gates: backend
    name -> how the engine converts g and beta for it."""

    engine: str
    package: str
    documented: str
    source: str
    picks: Callable[[tuple[int, int] | None, Case], tuple[str, str]]
    gates: dict[str, str]


def _vllm(cap, case: Case) -> tuple[str, str]:
    if cap is None:
        return "vllm-fla", "no CUDA GPU: Triton/FLA"
    if cap == (9, 0):
        return "flashinfer", "SM90 with gdn_prefill_backend=auto"
    if cap[0] == 10 and case.K == 128:
        return "flashinfer", "SM10.x with K=128 (CUDA 13, intact nvidia-cutlass-dsl-libs-cu13)"
    return "vllm-fla", f"sm_{cap[0]}{cap[1]} with K={case.K}: not SM90 nor SM10.x with K=128"


def _sglang(cap, case: Case) -> tuple[str, str]:
    if cap is None:
        return "sglang-fla", "no CUDA GPU"
    if cap != (9, 0):
        return "sglang-fla", f"sm_{cap[0]}{cap[1]}: SGLang runs FlashInfer's GDN prefill on SM90 only"
    if case.K != 128 or case.V != 128:
        return "sglang-fla", f"K={case.K}, V={case.V}: FlashInfer needs K=V=128"
    if case.B * case.T > SGLANG_MAX_PREFILL:
        return "sglang-fla", f"a prefill of more than {SGLANG_MAX_PREFILL} tokens"
    return "flashinfer", f"fp32 state pool, K=V=128, a prefill of at most {SGLANG_MAX_PREFILL} tokens"


ENGINES: tuple[EngineRule, ...] = (
    EngineRule("vLLM", "vllm", "0.33", "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", _vllm,
               {"flashinfer": FLASHINFER_GATES + "; Q/K L2-normalised by vLLM's l2norm_fwd first",
                "vllm-fla": FLA_COPY_GATES.format(beta="")}),
    EngineRule("SGLang", "sglang", "0.5.23", "python/sglang/srt/layers/attention/linear/gdn_kernel_dispatcher.py",
               _sglang, {"flashinfer": FLASHINFER_GATES + "; Q/K L2-normalised by SGLang's l2norm_fwd first",
                         "sglang-fla": FLA_COPY_GATES.format(beta=", beta = sigmoid(b) in b's dtype (bf16)")}),
)


def capability(sm: str | None) -> tuple[int, int] | None:
    """'90' -> (9, 0), '100' -> (10, 0), '121' -> (12, 1); None stays None."""
    if not sm:
        return None
    sm = str(sm)
    return int(sm[:-1]), int(sm[-1])


def _cases(df: pd.DataFrame) -> list[Case]:
    out = []
    for cid in sorted(df["case_id"].unique()):
        try:
            out.append(Case.from_id(cid))
        except ValueError:  # captured inputs (replay:...) have no case to apply a rule to
            continue
    return out


def view(df: pd.DataFrame | None, sm: str | None, versions: dict[str, str]) -> pd.DataFrame:
    """One row per engine and backend it would pick: installed version, the cases (of the run; the default case
    without one), why, the g/beta conversion and that backend's verdicts over those cases (o and final state)."""
    from parity import verdicts

    cap = capability(sm)
    cases = _cases(df) if df is not None and not df.empty else []
    if not cases:  # no run, or only captured inputs: the rule for the default case, no verdicts
        cases, df = [Case()], None
    judged = verdicts.judge_frame(df) if df is not None else pd.DataFrame()
    rows = []
    for rule in ENGINES:
        picked: dict[str, list] = {}
        for case in cases:
            backend, why = rule.picks(cap, case)
            picked.setdefault(backend, []).append((case, why))
        version = versions.get(rule.package) or "missing"
        for backend, items in picked.items():
            rows.append({
                "engine": rule.engine,
                "installed": (f"{rule.package} {version}" if version != "missing"
                              else f"not installed (rule of {rule.package} {rule.documented})"),
                "runs": backend, "cases": len(items) if df is not None else "-",
                "why": "; ".join(dict.fromkeys(w for _, w in items)), "g, beta": rule.gates.get(backend, ""),
                "verdicts": _verdicts(judged, backend, [c.group_id for c, _ in items]) if df is not None else "-",
            })
    return pd.DataFrame(rows)


def _verdicts(judged: pd.DataFrame, backend: str, groups: list[str]) -> str:
    if judged.empty:
        return "no rows"
    sub = judged[(judged["backend"] == backend) & judged["group_id"].isin(groups)
                 & judged["tensor"].isin(["o", "ht"])]
    if sub.empty:
        return f"{backend} not in this run"
    counts = sub["verdict"].value_counts()
    return ", ".join(f"{n} {v}" for v, n in counts.items()) + " (rows of o and final state)"


def run_context(rs) -> tuple[str | None, dict[str, str]]:
    """(sm, package versions) of a result set's first session."""
    run = rs.runs[0] if rs.runs else {}
    env = run.get("env", {}) or {}
    versions = dict(env.get("packages", {}) or {})
    for vs in (run.get("versions", {}) or {}).values():
        versions.update(vs)
    return env.get("sm"), versions


def section(rs, df: pd.DataFrame) -> str:
    """The report's engine view."""
    from parity.markdown import md_table

    sm, versions = run_context(rs)
    tab = view(df, sm, versions)
    return "\n".join([
        "## Engine view: what vLLM and SGLang run here", "",
        f"On sm_{sm or '-'} with the run's packages: the GDN prefill kernel each engine would pick (its documented "
        "rule, `parity/engines.py`), how it converts g and beta, and the verdicts of that backend over the run's "
        "cases.", "", md_table(tab), ""])


def summary_lines(rs, df: pd.DataFrame) -> list[str]:
    """One line per engine for the findings: what it runs and that backend's verdicts."""
    sm, versions = run_context(rs)
    tab = view(df, sm, versions)
    return [f"- {r['engine']} ({r['installed']}) runs `{r['runs']}` on {r['cases']} case(s): {r['verdicts']}."
            for r in tab.to_dict("records")]


def machine_view() -> str:
    """The engine view for this machine without results: installed versions and the pick for the default case."""
    import torch

    from parity.backends.base import package_version
    from parity.markdown import md_table

    sm = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        sm = f"{major}{minor}"
    versions = {rule.package: package_version(rule.package) for rule in ENGINES}
    tab = view(None, sm, versions).drop(columns=["cases", "verdicts"])
    return "\n".join([f"Engine view for this machine (sm_{sm or '-'}; the default case {Case().id}):", "",
                      md_table(tab), ""])
