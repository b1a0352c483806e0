"""Planted mutations of the yardsticks: each must turn at least one test red.

A row is (id, file, edits, reason, tests): the edits (old text -> new text, each old text found exactly once) are
applied to a temporary copy of the package (never to the working tree), and ``tests`` (pytest arguments) run on that
copy in a subprocess; the mutation is caught when they fail (exit status 1). The same tests must pass on the
unmutated copy, or "caught" would mean nothing.

Mutation-testing tools were considered: mutmut and cosmic-ray generate hundreds of mutants over reference/ and
parity/{metrics,verdicts,refs}.py and run the selected tests per mutant in a fresh process (~10 s each on 2 shared
cores here), hours per run; this table of hand-planted mutations of the same files runs in a minute or two.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("parity", "reference", "cases", "tests", "conftest.py", "pyproject.toml")
LINKED = ("kernels", "scripts")
SMOKE_CELL = ("tests/test_matrix.py::test_parity[dense_B1_T65_H2-HV4_K32-V32_fp32_g-fp32_beta-fp32_h0-none_qwen-"
              "gates_s0-ref-recurrent]")
REFS_AGREE = "tests/test_verdicts.py::test_the_fp64_references_agree_and_the_baseline_is_sane_on_smoke_cases"
VERDICTS = "tests/test_verdicts.py::"
SANE_BASELINE = VERDICTS + "test_a_sane_baseline_bounds_and_a_missing_one_falls_back_to_the_floor"
FP64_RULE = VERDICTS + "test_a_tensor_returned_in_fp64_is_held_to_the_fp64_rule"
INVALID_CASE = VERDICTS + "test_references_that_disagree_make_the_case_invalid_and_withhold_every_verdict"
DAMAGED = "tests/test_refs.py::test_a_damaged_entry_is_recomputed_never_trusted"
NOTHING = "tests/test_assert_close.py::test_nothing_to_compare_is_an_error_naming_it_never_a_pass"


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    edits: tuple[tuple[str, str], ...]
    reason: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("chunk-sign-flip", "reference/chunk.py", (("U = U_tilde[c] - W[c] @ S", "U = U_tilde[c] + W[c] @ S"),),
             "the chunked fp64 reference subtracts the state's prediction with the wrong sign",
             (SMOKE_CELL,)),
    Mutation("chunk-no-decay", "reference/chunk.py",
             (("G = blocks(g[..., None])[..., 0].cumsum(-1)", "G = 0 * blocks(g[..., None])[..., 0].cumsum(-1)"),),
             "the chunked fp64 reference drops the decay", (REFS_AGREE,)),
    Mutation("recurrent-skips-last-token", "reference/recurrent.py",
             (("S = S + k[:, t, :, :, None] * u[:, :, None, :]",
               "S = S + (t < q.shape[1] - 1) * k[:, t, :, :, None] * u[:, :, None, :]"),),
             "the recurrent fp64 reference skips the last token's update", (SMOKE_CELL,)),
    Mutation("baseline-no-decay", "reference/emulated.py", (("G = g.cumsum(-1)", "G = 0 * g.cumsum(-1)"),),
             "the same-precision baseline drops the decay", (REFS_AGREE,)),
    Mutation("metrics-rel-rmse-no-sqrt", "parity/metrics.py",
             (("rel_rmse = math.sqrt(s_d2 / s_r2) if", "rel_rmse = (s_d2 / s_r2) if"),),
             "rel_rmse without the square root", ("tests/test_metrics.py",)),
    Mutation("metrics-max-diff-is-mean", "parity/metrics.py",
             (("max_diff, arg = float(d[j]), i + j", "max_diff, arg = float(d.mean()), i + j"),),
             "max_diff computed as the mean difference", ("tests/test_metrics.py",)),
    Mutation("rule-comparison-flipped", "parity/verdicts.py",
             (("        if not value <= b[metric]:\n            basis",
               "        if not value >= b[metric]:\n            basis"),),
             "the bound comparison of the verdict rule turned around", (SANE_BASELINE,)),
    Mutation("rule-base-factor-100x", "parity/tolerances.py",
             (("base_rel_rmse: float = 2.0", "base_rel_rmse: float = 200.0"),),
             "the baseline factor 100x", (SANE_BASELINE,)),
    Mutation("fp64-rule-flipped", "parity/verdicts.py",
             (("        if not value <= b[metric]:\n            return metric", "        if not value >= b[metric]:\n"
               "            return metric"),),
             "the fp64 rule's comparison turned around", (FP64_RULE,)),
    Mutation("fp64-rule-100x", "parity/tolerances.py", (("FP64_RTOL = 1e-10", "FP64_RTOL = 1e-8"),),
             "the fp64 rule 100x looser", (FP64_RULE,)),
    Mutation("rule-no-baseline-check", "parity/verdicts.py",
             (("        if problem is not None:\n            return Verdict(NOREF",
               "        if problem is None and False:\n            return Verdict(NOREF"),),
             "the baseline's sanity check skipped", (VERDICTS + "test_an_insane_baseline_is_no_bound",)),
    Mutation("rule-no-invalid", "parity/verdicts.py",
             (("    if invalid:\n        return Verdict(INVALID", "    if False:\n        return Verdict(INVALID"),),
             "a disagreement of the fp64 references withholds nothing", (INVALID_CASE,)),
    Mutation("rule-any-status", "parity/verdicts.py", (("if status not in STATUSES:", "if False:"),),
             "an unknown status judged as data", (VERDICTS + "test_an_unknown_status_is_refused_naming_it",)),
    Mutation("cache-keyed-by-case-id", "parity/refs.py",
             (('f"{case.id[:150]}-{key[:24]}.safetensors"', 'f"{case.id[:150]}.safetensors"'),
              ('if meta.get("input_key") != key:', "if False:")),
             "the reference cache keyed by case id alone", ("tests/test_refs.py",)),
    Mutation("cache-no-checksum", "parity/refs.py",
             (('if meta.get("tensors_sha256") != digest(tensors, {}):', "if False:"),),
             "a damaged cache entry trusted", (DAMAGED,)),
    Mutation("assert-close-zero-ref", "parity/assert_close.py", (("if not bool((ref != 0).any()):", "if False:"),),
             "assert_close passes an all-zero reference", (NOTHING,)),
]


def test_every_planted_edit_applies_exactly_once():
    for m in MUTATIONS:
        text = (ROOT / m.file).read_text()
        for old, new in m.edits:
            assert text.count(old) == 1, f"{m.id}: {old!r} occurs {text.count(old)} times in {m.file}"
            assert old != new, m.id
    assert len({m.id for m in MUTATIONS}) == len(MUTATIONS)


def _copy(dest: Path, mutation: Mutation | None) -> Path:
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))
    for name in LINKED:
        if (ROOT / name).exists():
            (dest / name).symlink_to(ROOT / name)
    if mutation is not None:
        path = dest / mutation.file
        text = path.read_text()
        for old, new in mutation.edits:
            text = text.replace(old, new, 1)
        path.write_text(text)
    return dest


def _run(tree: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "GDN_PARITY_CACHE": str(tree / ".ref-cache"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-n", "0", "--warmup", "0", *args]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_planted_mutation_is_caught(tmp_path):
    """The tests of every row pass on the unmutated copy and fail (exit status 1) on the mutated one."""
    every = tuple(dict.fromkeys(t for m in MUTATIONS for t in m.tests))

    def run(m: Mutation | None):
        return m, (_run(_copy(tmp_path / m.id, m), m.tests) if m else _run(_copy(tmp_path / "control", None), every))

    with ThreadPoolExecutor(max_workers=2) as pool:
        (_, control), *mutants = list(pool.map(run, [None, *MUTATIONS]))
    assert control.returncode == 0, f"the table's tests fail on the unmutated copy:\n{control.stdout[-3000:]}"
    caught = [m.id for m, p in mutants if p.returncode == 1]
    print(f"\nplanted mutations: {len(mutants)}, caught: {len(caught)}")
    survivors = [f"{m.id} ({m.reason}; {m.file}): `pytest {' '.join(m.tests)}` exit {p.returncode}\n"
                 f"{p.stdout[-800:]}{p.stderr[-800:]}" for m, p in mutants if p.returncode != 1]
    assert not survivors, "planted mutations not caught:\n" + "\n".join(survivors)
