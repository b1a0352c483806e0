"""Bad input gets a clear error naming it, and damaged result files lose nothing readable: every CLI argument is
validated (argparse types), ``report``, ``merge`` and ``compare`` work on partial or damaged files and name what
they skipped, and ``compare`` fails closed when B lacks cells that A has."""

from __future__ import annotations

import json

import pytest

from cases import Case
from parity import recommend, results, runner
from parity.cli import main as cli_main

CASE = Case(T=64, H=1, HV=2, K=8, V=8, dtype="bf16", dist="qwen-gates")
RUN = ["run", "--case", CASE.id, "--backends", "torch-emulated", "--workers", "0", "--cache", "none",
       "--no-progress", "--no-report"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A complete result file of one small case (torch-emulated and ref-recurrent)."""
    out = tmp_path_factory.mktemp("good") / "results.jsonl"
    cfg = runner.RunConfig(cases=[CASE], out=out, backends=["torch-emulated", "ref-recurrent"], progress=False,
                           cache_dir="", workers=0)
    return runner.run(cfg)


def _lines(path):
    return path.read_text().splitlines()


def _damage(good, kind):
    lines = _lines(good)
    rows = [i for i, line in enumerate(lines) if '"record": "row"' in line and '"backend": "ref-recurrent"' in line
            and '"against": "fp64"' in line]
    if kind == "truncated":
        return lines[:-1] + [lines[-1][: len(lines[-1]) // 2]], "torn last line"
    if kind == "garbage":
        return lines[:3] + ["<<< not json >>>", "[1, 2]"] + lines[3:], ":4: not a JSON record"
    if kind == "missing-fields":
        out = list(lines)
        for i, drop in ((rows[0], "tensor"), (rows[1], "status")):
            rec = json.loads(out[i])
            rec.pop(drop)
            out[i] = json.dumps(rec)
        other = next(i for i, line in enumerate(lines) if '"backend": "torch-emulated"' in line)
        rec = json.loads(out[other])
        for k in ("dtype", "T", "h0_dtype", "group_id"):  # case fields are not keys: the row is kept
            rec.pop(k)
        out[other] = json.dumps(rec)
        return out, f":{rows[0] + 1}: row without tensor"
    if kind == "duplicated":
        return lines + [line for line in lines if '"record": "row"' in line], "written twice in part 0"
    if kind == "empty":
        return [], "empty file"
    raise AssertionError(kind)


DAMAGE = ["truncated", "garbage", "missing-fields", "duplicated", "empty"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_report_merge_and_compare_work_on_a_damaged_file_and_name_the_damage(good, tmp_path, capsys, kind):
    lines, named = _damage(good, kind)
    bad = tmp_path / "bad" / "results.jsonl"
    bad.parent.mkdir()
    bad.write_text("\n".join(lines) + ("\n" if lines and kind != "truncated" else ""))
    rs = results.load(bad)
    assert any(named in p for p in rs.problems), rs.problems
    assert all(str(bad) in p for p in rs.problems)  # each problem names the file (and the line)
    assert cli_main(["report", str(bad)]) == 0
    text = (bad.parent / "report.md").read_text()
    if kind != "empty":
        assert "## Damaged or partial result file" in text and named in text and "## Summary" in text
    merged = tmp_path / "merged.jsonl"
    assert cli_main(["merge", str(good), str(bad), "--out", str(merged), "--no-report"]) == 0
    assert named in capsys.readouterr().err
    assert {results.row_key(r) for r in results.load(merged).rows} == {results.row_key(r)
                                                                         for r in results.load(good).rows}
    lost = kind in ("missing-fields", "empty")  # B lacks cells of A: the gate fails closed
    assert cli_main(["compare", str(good), str(bad), "--out", str(tmp_path / "cmp.md")]) == (1 if lost else 0)
    err = capsys.readouterr().err
    assert ("have no row in" in err) == lost
    assert cli_main(["compare", str(good), str(bad), "--allow-missing", "--out", str(tmp_path / "c2.md")]) == 0
    assert cli_main(["compare", str(bad), str(good), "--out", str(tmp_path / "c3.md")]) == 0


def test_compare_against_an_empty_run_fails_closed(good, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["compare", str(good), str(empty)]) == 1
    out, err = capsys.readouterr()
    assert "cell(s) of A missing in B" in out and "--allow-missing" in err
    assert cli_main(["compare", str(good), str(empty), "--allow-missing"]) == 0
    assert cli_main(["compare", str(good), str(good)]) == 0


BAD_ARGS = [
    (["--limit", "0"], "--limit"), (["--limit", "-1"], "--limit"), (["--limit", "x"], "--limit"),
    (["--cell-timeout", "-1"], "--cell-timeout"), (["--cell-timeout", "0"], "--cell-timeout"),
    (["--cell-timeout", "nan"], "--cell-timeout"), (["--shard", "a/b"], "--shard"), (["--shard", "0/2"], "--shard"),
    (["--shard", "3/2"], "--shard"), (["--shard", "1"], "--shard"), (["--seeds", "0"], "--seeds"),
    (["--workers", "-1"], "--workers"), (["--warmup", "-2"], "--warmup"), (["--T", "0"], "--T"),
    (["--T", "64,abc"], "--T"), (["--dist", "qwen-gates,nope"], "--dist"), (["--layout", "nope"], "--layout"),
    (["--dtype", "fp8"], "--dtype"), (["--g-dtype", "half"], "--g-dtype"), (["--case", "not-a-case"], "--case"),
    (["--backends", "nope"], "--backends: unknown backend 'nope'"),
    (["--backends", "tests.fake_backends:Nope"], "--backends: cannot load backend"), (["--matrix", "nope"], "nope"),
]


@pytest.mark.parametrize("extra,named", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_every_bad_run_argument_is_refused_naming_it(tmp_path, capsys, extra, named):
    out = tmp_path / "r" / "results.jsonl"
    args = [*RUN, *extra, "--out", str(out)]  # one small case: where the old CLI ran anyway, it did so quickly
    if extra[0] in ("--matrix", "--case"):
        args = ["run", *extra, "--workers", "0", "--cache", "none", "--out", str(out), "--no-progress"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not out.exists()  # refused before anything ran


def test_bad_arguments_of_the_other_commands_are_refused_naming_them(good, tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    for args, named in ((["report", missing], "missing.jsonl"), (["merge", missing, "--out", str(tmp_path / "m")],
                                                                  "missing.jsonl"),
                        (["compare", str(good), missing], "missing.jsonl"),
                        (["compare", str(good), str(good), "--factor", "1"], "--factor"),
                        (["warmup", "--procs", "0"], "--procs"), (["warmup", "--timeout", "-5"], "--timeout"),
                        (["replay", missing], "missing.jsonl"), ([*RUN, "--out", str(tmp_path)], "is a folder")):
        assert cli_main(args) == 2, args
        assert named in capsys.readouterr().err, args


def test_a_result_file_that_is_not_one_is_refused_naming_it(tmp_path, capsys):
    other = tmp_path / "x.jsonl"
    other.write_text(json.dumps({"record": "run", "format": "something-else", "version": 1}) + "\n")
    assert cli_main(["report", str(other)]) == 2
    assert str(other) in capsys.readouterr().err


@pytest.mark.parametrize("text,named", [('{"format": "gdn-parity-tolerances", "version": 1, "entr', "not valid JSON"),
                                        ("", "not valid JSON"), ("[1, 2]", "not a gdn-parity-tolerances document"),
                                        ('{"format": "gdn-parity-tolerances", "version": "x"}', "version 'x'")])
def test_a_damaged_tolerances_file_is_refused_naming_the_file(tmp_path, text, named):
    path = tmp_path / "tolerances.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=named) as err:
        recommend.load_tolerances(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="cannot read the tolerances file"):
        recommend.load_tolerances(tmp_path / "absent.json")
