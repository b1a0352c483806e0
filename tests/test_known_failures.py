"""The known-failures data file and the helpers that turn it into strict xfails (conftest.py)."""

from __future__ import annotations

import conftest
from cases.matrices import get_matrix
from parity.backends import BACKENDS


def test_every_entry_is_complete_and_names_real_cells():
    known = conftest.load_known_failures()
    standard = {c.id for c in get_matrix("standard").cases()}
    assert known
    for e in known:
        assert e["backend"] in BACKENDS, e["backend"]
        assert e["link"].startswith("https://") and len(e["reason"]) > 40
        assert e["case"], f"entry {e['backend']} {e.get('scope')} lists no cell"
        for c in e["case"]:
            assert c in standard, f"{c} is not a case of the standard matrix"
    assert conftest.stale_known_failures(known, set()) == []


def test_known_failure_matches_exact_ids_and_globs_per_backend():
    known = [{"backend": "flash-qla", "case": ["a_s0", "b_*"], "reason": "r", "link": "l"},
             {"backend": "fla-dispatch", "case": ["a_s0"], "reason": "r", "link": "l"}]
    assert conftest.known_failure(known, "a_s0", "flash-qla") == 0
    assert conftest.known_failure(known, "b_anything", "flash-qla") == 0
    assert conftest.known_failure(known, "a_s0", "fla-dispatch") == 1
    assert conftest.known_failure(known, "a_s1", "flash-qla") is None
    assert conftest.known_failure(known, "a_s0", "fla-triton") is None


def test_stale_entries_are_reported_unless_collected():
    case = get_matrix("smoke").cases()[0].id
    known = [{"backend": "flash-qla", "case": ["no-such-case_s0"], "reason": "gone", "link": "l"},
             {"backend": "flash-qla", "case": [case], "reason": "still there", "link": "l"}]
    stale = conftest.stale_known_failures(known, set())
    assert len(stale) == 1 and "gone" in stale[0]
    assert conftest.stale_known_failures(known, {0}) == []


def test_backend_option_selects_the_property_tests_too():
    """``--backend`` keeps the backend-parametrized tests of the chosen backends only (so that a GPU run can be
    split across GPUs by backend)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--collect-only", "tests/test_properties.py", "--backend", "torch-emulated"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and all(line.endswith("[torch-emulated]") for line in ids)
    assert "deselected" in out.stdout
