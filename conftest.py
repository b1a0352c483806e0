"""pytest configuration: hypothesis profiles and the parametrized parity matrix.

The matrix is built from the named matrices in ``cases/``: one test per (case, backend) with the id
``<case id>-<backend>``. Options: ``--matrix`` (default: smoke; standard on a GPU box is
``pytest -m gpu --matrix standard``), ``--backend`` (repeatable), ``--case`` (repeatable), ``--seeds``.
Markers: ``gpu`` (the cell runs a GPU backend), ``slow``, and one per backend (``backend_fla_triton``...).
Known upstream defects are strict expected failures listed in ``tests/known_failures.json``.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings

import pytest
import torch  # does not import triton
from hypothesis import HealthCheck, settings

# Without a GPU, FLA's Triton kernels run under the Triton interpreter, which triton reads once, at its first import.
# Set it here, before any test module can import triton (directly or through fla), so that the CPU cells of
# fla-triton and fla-recurrent run the same way whatever order the test files are collected and run in.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread per xdist worker: the workers already fill the cores
    torch.set_num_threads(1)

from parity import known_failures  # noqa: E402 - after TRITON_INTERPRET; imports neither torch nor triton

REFERENCE_BACKENDS = {"ref-recurrent", "torch-emulated"}


def marker_name(backend: str) -> str:
    return "backend_" + backend.replace("-", "_").replace(":", "_").replace(".", "_")


def pytest_addoption(parser):
    group = parser.getgroup("gdn-parity")
    group.addoption("--matrix", default="smoke", help="named matrix for tests/test_matrix.py (default: smoke)")
    group.addoption("--backend", action="append", default=None, help="only this backend (repeatable): the matrix "
                    "cells and the property tests of the other backends are not collected")
    group.addoption("--case", action="append", default=None, help="only this case id (repeatable)")
    group.addoption("--seeds", type=int, default=None, help="seeds per configuration (default: the matrix's)")
    group.addoption("--warmup", type=int, default=None, help="processes of the compile warm-up pass over the "
                    "collected parity cells before the tests (default: on a GPU min(12, cores - 2), off under pytest-xdist; "
                    "0: off)")


def pytest_configure(config):
    from parity.backends import BACKENDS

    for name in BACKENDS:
        config.addinivalue_line("markers", f"{marker_name(name)}: cells of backend {name}")


def load_known_failures() -> list[dict]:
    """The entries of tests/known_failures.json (parity.known_failures.load)."""
    return known_failures.load()


known_failure = known_failures.match  # index of the first entry matching (case id, backend), or None


def matrix_cells(config):
    """(case, backend name) pairs for the options given."""
    from cases.case import Case
    from cases.matrices import get_matrix
    from parity.backends import BACKENDS

    if config.getoption("--case"):
        cases = [Case.from_id(c) for c in config.getoption("--case")]
    else:
        cases = get_matrix(config.getoption("--matrix")).cases(config.getoption("--seeds"))
    backends = config.getoption("--backend") or [b for b in BACKENDS if b != "torch-emulated"]
    return [(c, b) for c in cases for b in backends]


def pytest_generate_tests(metafunc):
    if "parity_cell" not in metafunc.fixturenames:
        return
    import torch

    from parity.backends import get_backend

    known = load_known_failures()
    metafunc.config._parity_known = known
    metafunc.config._parity_matched = set()
    cuda = torch.cuda.is_available()
    params = []
    for case, backend in matrix_cells(metafunc.config):
        marks = [getattr(pytest.mark, marker_name(backend))]
        b = get_backend(backend)
        if b.needs_gpu or (cuda and backend not in REFERENCE_BACKENDS):
            marks.append(pytest.mark.gpu)
        if case.B * case.T > 4096:
            marks.append(pytest.mark.slow)
        i = known_failure(known, case.id, backend)
        if i is not None:
            e = known[i]
            metafunc.config._parity_matched.add(i)
            # strict unless the entry says the defect shows on some runs only ("strict": false, with why)
            marks.append(pytest.mark.xfail(reason=f"{e['reason']} ({e['link']})", strict=e.get("strict", True)))
        params.append(pytest.param((case, backend), id=f"{case.id}-{backend}", marks=marks))
    metafunc.parametrize("parity_cell", params)


def pytest_collection_modifyitems(config, items):
    """``--backend``: deselect the backend-parametrized tests of other backends (the property tests take the
    backend as their ``name`` parameter; the matrix cells are generated for the chosen backends only)."""
    chosen = config.getoption("--backend")
    if not chosen:
        return
    from parity.backends import BACKENDS

    keep, drop = [], []
    for item in items:
        name = getattr(item, "callspec", None) and item.callspec.params.get("name")
        (drop if isinstance(name, str) and name in BACKENDS and name not in chosen else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def stale_known_failures(known: list[dict], matched: set[int]) -> list[str]:
    """Entries that match no collected test and no case of any named matrix (renamed or removed cases:
    the data file has rotted), each as a one-line description."""
    from cases.matrices import MATRICES

    ids = {c.id for m in MATRICES.values() for c in m.cases(None)}
    out = []
    for i, e in enumerate(known):
        if i in matched or any(fnmatch.fnmatchcase(c, pat) for pat in e["case"] for c in ids):
            continue
        out.append(f"backend {e['backend']}, case {e.get('scope') or e['case'][:3]} ({e['reason'][:80]})")
    return out


def pytest_collection_finish(session):
    known = getattr(session.config, "_parity_known", None)
    if known is None:
        return
    for line in stale_known_failures(known, session.config._parity_matched):
        warnings.warn(f"tests/known_failures.json: stale entry matches no collected test and no matrix case: {line}",
                      stacklevel=1)
    _warmup(session)


def _warmup(session) -> None:
    """The runner's compile warm-up (parity/warmup.py) over the parity cells selected to run, in parallel processes,
    before the first test: on a cold GPU box first-use compilation would otherwise run cell by cell."""
    from parity import runner

    cells = [item.callspec.params["parity_cell"] for item in session.items
             if hasattr(item, "callspec") and "parity_cell" in item.callspec.params
             and not item.get_closest_marker("skip")]
    requested = session.config.getoption("--warmup")
    if requested is None and os.environ.get("PYTEST_XDIST_WORKER"):
        # under pytest-xdist (-n N) the workers already compile in parallel, and a warm-up in every worker would
        # compile everything N times: off unless --warmup asks for it
        return
    procs = runner.warmup_procs(requested, len(cells))
    if not cells or not procs:
        return
    from parity.warmup import summary_line, warmup

    cases = list({c.id: c for c, _ in cells}.values())
    backends = list(dict.fromkeys(b for _, b in cells))
    w = warmup(cases, backends, runner.devices(None), procs).as_dict()
    session.config._parity_warmup = w
    print(f"\ngdn-parity compile warm-up: {summary_line(w)}")


@pytest.fixture(scope="session")
def parity_session():
    from parity.session import ParitySession

    return ParitySession()
