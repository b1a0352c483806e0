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


def test_group_scales_make_one16_independent_of_the_gradient_scale():
    """``one16g`` (dO, dht and v, h0 under a power of two per GVA group, undone on every gradient): the same errors
    at 2^-20 and 2^12 as at unit scale, within the FLA-like baseline where unscaled fp16 misses it or overflows."""
    case = Case(T=192, H=1, HV=2, dist="slow-decay", grad=True)
    at = {E: pb.rows(case, ["one16g"], E)[1] for E in (-20, 0, 12)}
    assert all(at[E][2] == [] for E in at), {E: at[E][2] for E in at}
    assert at[-20][1] == at[0][1] == at[12][1], at


def test_chunk_exponents_keep_dh0_under_strong_decay():
    """``one16gc`` (the group scales and dh's F1 dO, F0 dX under the chunk's power of two from its first gate): dh0
    under strong decay with an initial state within the baseline, where the group scales alone flush it."""
    case = Case(T=192, H=1, HV=2, dist="strong-decay", h0_dtype="fp32", grad=True)
    rows = pb.rows(case, ["one16g", "one16gc"], -20)
    (_, _, bad_g), (_, e, bad_gc) = rows[1], rows[2]
    assert bad_g == ["dh0"] and bad_gc == [] and e["dh0"] < rows[0][1]["dh0"], (bad_g, bad_gc, e)


def test_one_kernel_in_fp16_keeps_the_others_outputs():
    """``dqk16`` changes nothing dh computes (dv and dh0 bitwise the split form's) but dq; ``dh16`` changes dh0, its
    own output; either refuses operands other than "split" for the other kernels."""
    import torch

    from kernels.backward.emulation import chunk_gated_delta_rule_bwd
    from tests import kernel_support as tt

    case = Case(T=192, H=1, HV=2, dist="qwen-gates", h0_dtype="fp32", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    split = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw)
    dqk16 = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dqk_operands="fp16")
    dh16 = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, dh_operands="fp16")
    assert torch.equal(split[2], dqk16[2]) and torch.equal(split[5], dqk16[5])
    assert not torch.equal(split[0], dqk16[0]) and not torch.equal(split[5], dh16[5])
    with pytest.raises(ValueError, match="dqk_operands"):
        chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, operands="bf16", dqk_operands="fp16")


def test_one_kernel_in_fp16_costs_dg_and_dbeta_their_split_accuracy():
    """The study's finding on a short row: one fp16 term in either kernel alone puts dg and dbeta at least 3x
    farther from fp64 than the split forms (dqk16's dq and dk closer), still within the FLA-like baseline."""
    case = Case(T=192, H=1, HV=2, dist="slow-decay", grad=True)
    rows = {name: (e, bad) for name, e, bad in pb.rows(case, ["split", "dh16", "dqk16"])}
    split = rows["split"][0]
    for form in ("dh16", "dqk16"):
        e, bad = rows[form]
        assert bad == [], (form, bad)
        assert e["dg"] > 3 * split["dg"] and e["dbeta"] > 3 * split["dbeta"], (form, e, split)


def test_p_single_local_du_stays_near_one16gc():
    """``one16gcp`` (one16gc with dUloc from one fp16 term of P, the fused backward's form): every gradient within
    the baseline and within 1.25x of one16gc's error at 2^-20, on strong decay with an initial state; its dUloc is
    not the split P's."""
    import torch

    from kernels.backward.emulation import ONE_TERM_FP16, chunk_gated_delta_rule_bwd
    from tests import kernel_support as tt

    case = Case(T=192, H=1, HV=2, dist="strong-decay", h0_dtype="fp32", grad=True)
    rows = {name: (e, bad) for name, e, bad in pb.rows(case, ["one16gc", "one16gcp"], -20)}
    (gc, bad_gc), (gcp, bad_gcp) = rows["one16gc"], rows["one16gcp"]
    assert bad_gc == [] and bad_gcp == [], (bad_gc, bad_gcp)
    assert all(gcp[n] <= 1.25 * gc[n] for n in gc), (gcp, gc)
    xs, kw, do, dht = tt.bwd_args(case)
    split, single = {}, {}
    chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **ONE_TERM_FP16, stages=split)
    chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **ONE_TERM_FP16, p_single=True, stages=single)
    assert not torch.equal(split["dUloc"], single["dUloc"])


def test_recompute_one_term_changes_only_the_gradients_after_the_recompute():
    """``rc16`` (the dispatched fused plan's form, ``FUSED_FP16``: store16 with the recompute's K S, X and F2 U one
    term): dv and dh0, which dh forms without the recomputed states, are bitwise store16's; dq, dk, dg, dbeta move
    and stay within the FLA-like baseline; an unknown recompute field is refused."""
    import torch

    from kernels.backward.emulation import FUSED_FP16, chunk_gated_delta_rule_bwd
    from tests import kernel_support as tt

    split = dict(FUSED_FP16, recompute_one=())
    assert pb._form("rc16") == FUSED_FP16 and dict(pb._form("store16"), recompute_one=()) == split

    case = Case(T=192, H=1, HV=2, dist="slow-decay", h0_dtype="fp32", grad=True)
    xs, kw, do, dht = tt.bwd_args(case)
    a = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **pb._form("store16"))
    b = chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **pb._form("rc16"))
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    same = {n for n, x, y in zip(names, a, b) if torch.equal(x, y)}
    assert {"dv", "dh0"} <= same and not {"dq", "dk", "dg"} & same, same
    assert pb.rows(case, ["rc16"])[1][2] == []
    with pytest.raises(ValueError, match="recompute_one"):
        chunk_gated_delta_rule_bwd(*xs, do, dht, **kw, **pb._form("store16"), recompute_one=("p",))
