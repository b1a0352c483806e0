"""The forward benchmark's precision columns on a CPU: each changes only the precision fields it names, and the
dry run's accuracy step (the emulation standing in for the kernels) ranks them as their roundings imply."""

from __future__ import annotations

import dataclasses
import re

import pytest

from benchmarks import bench_kernels_fwd as bench_fwd
from kernels.forward.precision import preset

PAST_INTRA = ("ag", "ks", "x", "u", "upd", "s", "p")


def _change(name, n=1, HV=8, mc=128):
    """The plan fields the benchmark column ``name`` changes on a plan at the dispatched precision."""
    plan = type("P", (), {"precision": preset()})()
    return bench_fwd.VARIANTS[name](plan, n, HV, mc)


def _altered(name):
    """(the dispatched precision, the precision of the benchmark column ``name`` on a plan with it)."""
    return preset(), _change(name)["precision"]


def test_single_makes_every_operand_past_the_intra_kernel_one_term():
    base, single = _altered("single")
    assert all(getattr(base, f) == "split" for f in PAST_INTRA), base
    assert all(getattr(single, f) == "bf16" for f in PAST_INTRA), single
    assert single.merge == base.merge


def test_ks1_changes_k_s_alone():
    base, ks1 = _altered("ks1")
    changed = [f for f in dataclasses.asdict(base) if getattr(base, f) != getattr(ks1, f)]
    assert changed == ["ks"], changed


def test_half_makes_every_operand_past_the_intra_kernel_one_fp16_term_on_the_ws_form():
    change = _change("half", HV=32, mc=512)
    assert all(getattr(change["precision"], f) == "fp16" for f in PAST_INTRA), change
    assert (change["state_form"], change["p_table"]) == ("ws", True), change


def test_half128_is_half_at_one_cta_a_value_head():
    assert _change("half128", HV=32, mc=512) == {**_change("half", HV=32, mc=512), "block_v": 128}


def test_a_ws_plan_takes_128_value_columns_with_fp16_operands_alone():
    import pytest

    from kernels.forward.precision import PRESETS
    from kernels.plan import ForwardPlan

    half = ForwardPlan("bfloat16", PRESETS["half"], "ws", 128, p_table=True)
    assert half.configs()[1].BV == 128
    with pytest.raises(ValueError, match="128 with fp16 operands"):
        ForwardPlan("bfloat16", PRESETS["default"], "ws", 128, p_table=True)


def test_dry_run_check_ranks_split_half_single(capsys, tmp_path):
    """On the accuracy step's inputs: split operands closer to fp64 than half (fp16 operands), half closer than
    single (bf16 operands), in o and the final state."""
    assert bench_fwd.main(["--dry-run", "--variants", "split,half,single", "--shapes", "B1_T8192_H4_HV8", "--rep",
                           "1", "--warmup", "0", "--results", str(tmp_path / "r.md")]) in (0, None)
    out = capsys.readouterr().out
    found = {}
    for name, floor, state in re.findall(r"check (\w+)\s+o \S+ \(([\d.]+)x floor\)\s+state (\S+)", out):
        found.setdefault(name, []).append((float(floor), float(state)))
    assert set(found) == {"split", "half", "single"}, out[-2000:]
    for (fd, sd), (fh, sh), (fs, ss) in zip(found["split"], found["half"], found["single"]):
        assert fd < fh < fs and sd < sh < ss, (found, out[-2000:])


def test_again_is_the_dispatched_plan_through_the_variants_path(capsys, tmp_path):
    """``again`` changes no plan field and is timed beside ``default`` in the paired table (the noise floor)."""
    assert _change("again") == {}
    assert bench_fwd.main(["--dry-run", "--no-check", "--variants", "default,again", "--shapes", "B1_T8192_H4_HV8",
                           "--rounds", "2", "--rep", "1", "--warmup", "0",
                           "--results", str(tmp_path / "r.md")]) in (0, None)
    out = capsys.readouterr().out
    lines = out[out.index("column / default"):].splitlines()
    assert lines[1].split()[:2] == ["shape", "again"] and lines[2].startswith("B1_T8192_H4_HV8"), lines[:3]


def test_variants_take_the_stage_columns_and_name_an_unknown_one(capsys, tmp_path):
    """A stage column in ``--variants`` (timed in every run anyway) is accepted; an unknown name is refused before
    anything runs, by an error naming it and the valid ones."""
    assert bench_fwd.main(["--dry-run", "--no-check", "--variants", "default,intra,state", "--shapes",
                           "B1_T8192_H4_HV8", "--rounds", "1", "--rep", "1", "--warmup", "0",
                           "--results", str(tmp_path / "r.md")]) in (0, None)
    out = capsys.readouterr().out
    header = out[out.index("== summary"):].splitlines()[1].split()
    assert header.count("intra") == 1 and header.count("state") == 1, header
    with pytest.raises(SystemExit):
        bench_fwd.main(["--dry-run", "--variants", "default,nosuch", "--results", str(tmp_path / "r.md")])
    err = capsys.readouterr().err
    assert "unknown variant(s) nosuch" in err and "half128np" in err and "timed in every run" in err, err
