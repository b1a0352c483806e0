"""``benchmarks/experiments/fused_bwd_profile.py`` on a CPU: its marks and its ``--no-store`` patches still find
``kernels/backward/fused.py``'s lines (a GPU run of the script is what times them)."""

from pathlib import Path

import pytest

from tests.script_support import load_script

EXPERIMENTS = Path(__file__).parent.parent / "benchmarks" / "experiments"


@pytest.fixture(scope="module")
def prof():
    return load_script("fused_bwd_profile", EXPERIMENTS)


@pytest.fixture(scope="module")
def source(prof):
    return Path(prof.SOURCE).read_text()


def test_every_warpgroup_is_marked_at_its_loop_and_phases(prof, source):
    text, labels = prof.marked_source(source)
    assert sorted(labels) == [0, 1, 2, 3]
    for w in range(3):          # the consumers arrive at and wait for each of the four phases
        assert labels[w][0] == "loop start", (w, labels[w])
        assert [x for x in labels[w] if x.startswith("arrive ph[")] == [f"arrive ph[{k}]" for k in range(4)], w
        assert [x for x in labels[w] if x.startswith("waited ph[")] == [f"waited ph[{k}]" for k in range(4)], w
    for w, labs in labels.items():      # each label's slot of dh0 is written (the chain form's loops reuse them)
        for k in range(len(labs)):
            assert f"dh0[0, 0, i, {w * prof.SLOTS + k}]" in text, (w, labs[k])
    compile(text, "marked_fused.py", "exec")


@pytest.mark.parametrize("names", [["dv"], ["dq"], ["dk"], ["dv", "dq", "dk"]])
def test_no_store_predicates_each_named_store_off_once(prof, source, names):
    out = prof.without_stores(source, names)
    assert out.count("fac[0] < 0") == len(names)
    assert len(out.splitlines()) == len(source.splitlines())
    changed = [a for a, b in zip(source.splitlines(), out.splitlines()) if a != b]
    assert len(changed) == len(names), changed
    compile(out, "fused_no_store.py", "exec")


def test_no_store_refuses_unknown_outputs_and_missing_stores(prof, source):
    with pytest.raises(SystemExit, match="unknown output 'dx'"):
        prof.without_stores(source, ["dx"])
    with pytest.raises(SystemExit, match="0 copies of its store"):
        prof.without_stores(prof.without_stores(source, ["dq"]), ["dq"])
