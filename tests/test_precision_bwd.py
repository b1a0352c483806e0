"""``benchmarks/precision_bwd.py`` on the CPU: its ``one16`` form (``BackwardPlan.one_term`` on fp16 kernels) and the
``--do-exp`` range rows."""

from __future__ import annotations

import pytest

from benchmarks import precision_bwd as pb
from cases.case import Case


def test_one16_is_within_the_baseline_at_unit_scale_and_flushes_dh0_under_strong_decay():
    """At unit scale one fp16 term per table is within the FLA-like baseline without an initial state; with one
    under strong decay its dh0 flushes to zero (rel_rmse 1), the range gap the study records."""
    base = dict(T=192, H=1, HV=2, dist="strong-decay", grad=True)
    (_, _, none), (_, _, bad1) = pb.rows(Case(**base), ["one16"])
    assert none == [] and bad1 == [], bad1
    rows = pb.rows(Case(**base, h0_dtype="fp32"), ["one16"])
    name, e, bad = rows[1]
    assert name == "one16" and bad == ["dh0"] and e["dh0"] > 0.99, (bad, e)


def test_do_exp_scales_back_exactly_where_the_form_keeps_its_range():
    """dO and dht times 2^E with the gradients scaled back: the split forms (bf16's exponent range) give the same
    errors at E = 8 as at E = 0; one fp16 term at E = -20 misses the baseline on every gradient."""
    case = Case(T=192, H=1, HV=2, dist="slow-decay", grad=True)
    at0, at8 = pb.rows(case, ["split"], 0)[1][1], pb.rows(case, ["split"], 8)[1][1]
    assert at0 == pytest.approx(at8, rel=1e-12), (at0, at8)
    assert pb.rows(case, ["one16"], -20)[1][2] == ["dq", "dk", "dv", "dg", "dbeta"]


def test_one16_refuses_fp16_inputs():
    with pytest.raises(SystemExit):
        pb.main(["--operands", "one16", "--dtype", "fp16", "--dists", "slow-decay"])
