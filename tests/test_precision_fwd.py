"""``benchmarks/precision_fwd.py`` on the CPU: its rows and its argument check."""

from __future__ import annotations

import pytest

from benchmarks import precision_fwd as pf
from cases.case import Case


def test_rows_put_the_baseline_first_and_compare_states_with_the_first_precision():
    rows = pf.rows(Case(T=256, H=1, HV=2, dist="slow-decay"), ["default", "pu16", "half"])
    assert [r[0] for r in rows] == ["fla-like", "default", "pu16", "half"]
    assert [r[3] for r in rows] == [None, None, True, False]
    fla, default = rows[0], rows[1]
    assert default[1] < fla[1] and default[2] < fla[2], rows


def test_unknown_precision_is_refused():
    with pytest.raises(SystemExit):
        pf.main(["--precisions", "default,nope", "--dists", "slow-decay", "--T", "64"])
