"""Run single cells in this process and judge them: what the pytest matrix (and ``parity.assert_close``'s callers)
use. It goes through exactly the runner's path (parity.execute) and the verdict rule (parity.verdicts), keeping
the last case's inputs, fp64 reference, rounding floor, same-precision baseline and the cross-check of the two fp64
references (verdicts.cross_check: where the recurrent reference runs, a disagreement makes every cell of the case
INVALID) so that the tests of one case on several backends compute them once."""

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
    check_rows: list[dict]  # the recurrent fp64 reference's rows (empty where it does not run)
    invalid: str | None  # why the case is INVALID (verdicts.cross_check), or None


@dataclass
class CellResult:
    """Rows of one backend on one case and their verdicts (tensor -> Verdict)."""

    rows: list[dict]
    verdicts: dict[str, verdicts.Verdict]

    def failures(self) -> list[verdicts.Verdict]:
        """Verdicts that fail a test: FAIL, ERROR, INVALID and NO-BASELINE (each with its message)."""
        bad = (verdicts.FAIL, verdicts.ERROR, verdicts.INVALID, verdicts.NOREF)
        return [v for v in self.verdicts.values() if v.status in bad]

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
            check_rows, _ = run_backend(case, self.backend(verdicts.CHECK_BACKEND), inputs, ref, self.device,
                                        repeat=False)
            self._state = CaseState(case, inputs, ref, floor, {r["tensor"]: r for r in base_rows}, check_rows,
                                    verdicts.cross_check(check_rows))
        return self._state

    def run(self, case: Case, backend: str, repeat: bool = False) -> CellResult:
        st = self.state(case)
        if backend == verdicts.CHECK_BACKEND and not repeat:
            rows = st.check_rows
        else:
            rows, _ = run_backend(case, self.backend(backend), st.inputs, st.ref, self.device, repeat=repeat)
        judged = {r["tensor"]: verdicts.judge(r, st.base.get(r["tensor"]), st.floor.get(r["tensor"]), st.invalid)
                  for r in rows}
        return CellResult(rows=rows, verdicts=judged)
