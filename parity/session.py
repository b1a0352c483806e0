"""Run single cells in this process and judge them: what the pytest matrix (and ``parity.assert_close``'s callers)
use. It goes through exactly the runner's path (parity.execute) and the verdict rule (parity.verdicts), keeping
the last case's inputs, fp64 reference, rounding floor and same-precision baseline so that the tests of one
case on several backends compute them once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cases.case import Case
from cases.inputs import GDNInputs, make_inputs
from parity import verdicts
from parity.backends import BASELINE, get_backend
from parity.execute import floor_rows, run_backend
from parity.refs import RefCache, Reference, get_reference


@dataclass
class CaseState:
    case: Case
    inputs: GDNInputs
    ref: Reference
    floor: dict  # tensor -> row
    base: dict  # tensor -> row


@dataclass
class CellResult:
    """Rows of one backend on one case and their verdicts (tensor -> Verdict)."""

    rows: list[dict]
    verdicts: dict[str, verdicts.Verdict]

    def failures(self) -> list[verdicts.Verdict]:
        return [v for v in self.verdicts.values() if v.status in (verdicts.FAIL, verdicts.ERROR)]

    def skipped(self) -> str | None:
        """The reason when the backend did not run (unavailable / unsupported), else None."""
        if self.verdicts and all(v.status == verdicts.SKIP for v in self.verdicts.values()):
            return next(iter(self.verdicts.values())).message
        return None


class ParitySession:
    def __init__(self, device: str | None = None, cache: RefCache | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cache = cache
        self._state: CaseState | None = None
        self._backends: dict = {}

    def backend(self, spec: str):
        if spec not in self._backends:
            self._backends[spec] = get_backend(spec)
        return self._backends[spec]

    def state(self, case: Case) -> CaseState:
        if self._state is None or self._state.case != case:
            self._state = None
            inputs = make_inputs(case).to(self.device)
            ref = get_reference(case, inputs, self.cache)
            floor = {r["tensor"]: r for r in floor_rows(case, ref, inputs.cu_seqlens)}
            base_rows, _ = run_backend(case, self.backend(BASELINE), inputs, ref, self.device, repeat=False)
            self._state = CaseState(case, inputs, ref, floor, {r["tensor"]: r for r in base_rows})
        return self._state

    def run(self, case: Case, backend: str, repeat: bool = False) -> CellResult:
        st = self.state(case)
        rows, _ = run_backend(case, self.backend(backend), st.inputs, st.ref, self.device, repeat=repeat)
        judged = {r["tensor"]: verdicts.judge(r, st.base.get(r["tensor"]), st.floor.get(r["tensor"])) for r in rows}
        return CellResult(rows=rows, verdicts=judged)
