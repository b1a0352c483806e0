"""--case takes id globs over --matrix beside exact ids: the selection the engine run uses (scripts/gpu_steps.sh
engines), with an error naming the pattern that matches nothing."""

from __future__ import annotations

import pytest

from cases.matrices import get_matrix
from parity import cli


def _select(*argv):
    return cli.select_cases(cli.build_parser().parse_args(["run", *argv]))


def test_globs_and_exact_ids_give_their_union_from_the_matrix():
    exact = "varlen-one_B1_T20468_H4-HV8_K128-V128_bf16_g-bf16_beta-bf16_h0-none_qwen-gates_s0"
    name, cases = _select("--matrix", "standard", "--case", "dense_B1_T20468_*", "--case", "varlen-*",
                          "--case", exact, "--case", "dense_B1_T20468_*_s0")
    standard = get_matrix("standard").cases()
    want = {c.id for c in standard if c.id.startswith("dense_B1_T20468_") or c.layout.startswith("varlen-")}
    assert name == "standard"
    assert {c.id for c in cases} == want | {exact} and len(cases) == len(want) + 1
    assert {c.dist for c in cases if c.T == 20468 and c.layout == "dense"} == {"qwen-gates", "gauss-l2"}


def test_exact_ids_alone_stay_custom():
    cid = get_matrix("smoke").cases()[0].id
    name, cases = _select("--case", cid)
    assert name == "custom" and [c.id for c in cases] == [cid]


def test_a_glob_matching_nothing_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"--case 'nolayout-\*' matches no case of matrix 'smoke'"):
        _select("--matrix", "smoke", "--case", "nolayout-*")
