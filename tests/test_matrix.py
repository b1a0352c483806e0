"""The parity matrix as tests: one test per (case, backend), asserting the verdict of every tensor.

    pytest tests/test_matrix.py                                  # the smoke matrix (CPU)
    pytest -m gpu --matrix standard                              # on a GPU box
    pytest tests/test_matrix.py --case <id> --backend fla-triton # one cell

Unavailable or unsupported backends skip with their reason; known upstream defects are strict
xfails from tests/known_failures.json.
"""

from __future__ import annotations

import pytest


def test_parity(parity_cell, parity_session):
    case, backend = parity_cell
    result = parity_session.run(case, backend)
    reason = result.skipped()
    if reason is not None:
        pytest.skip(reason)
    failures = result.failures()
    if failures:
        pytest.fail("\n".join(v.message or f"{v.status}" for v in failures), pytrace=False)
    # gradients of a backend without a backward skip; everything that ran passed
    statuses = {t: v.status for t, v in result.verdicts.items()}
    assert "PASS" in statuses.values() and set(statuses.values()) <= {"PASS", "SKIP"}, statuses
