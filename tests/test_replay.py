"""python -m parity replay: capture a GDN call, replay it through backends, judge it like a sweep case."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import reference
from parity import compare, replay, results
from parity.cli import main as cli_main
from parity.results import FLOOR_BACKEND
from parity.verdicts import PASS, judge_frame

T, H, HV, K, V = 40, 1, 2, 16, 16
CU = [0, 7, 19, 40]  # three sequences of 7, 12 and 21 tokens
SCALE = 0.3


def _call(seed=0):
    """A varlen call with an initial state, raw q/k normalised in the kernel, and a non-default scale."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(1, T, H, K, generator=gen).bfloat16(), k=torch.randn(1, T, H, K, generator=gen).bfloat16(),
        v=torch.randn(1, T, HV, V, generator=gen).bfloat16(),
        g=torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen)),
        beta=torch.rand(1, T, HV, generator=gen), initial_state=torch.randn(len(CU) - 1, HV, K, V, generator=gen),
        cu_seqlens=torch.tensor(CU, dtype=torch.int32))


def _capture(path, seed=0, **flags):
    flags = {"use_qk_l2norm_in_kernel": True, "scale": SCALE, **flags}
    return replay.capture(path, **_call(seed), **flags, model="toy", layer=3)


def _rows(rs, **match):
    return [r for r in rs.rows if all(r.get(k) == v for k, v in match.items())]


def test_capture_round_trip(tmp_path):
    call = _call()
    path = _capture(tmp_path / "layer3.safetensors")
    cap = replay.load_capture(path)
    for name, t in call.items():
        got = getattr(cap.inputs, name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert cap.inputs.seq_lens == [7, 12, 21] and cap.notes == {"model": "toy", "layer": "3"}
    assert cap.settings() == {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": False,
                              "use_beta_sigmoid_in_kernel": False, "state_v_first": False, "scale": SCALE}
    assert cap.case.id == f"replay:layer3:{cap.sha256[:8]}" and cap.case.group_id == "replay:layer3"
    assert (cap.case.layout, cap.case.T, cap.case.dtype, cap.case.h0_dtype) == ("captured", T, "bf16", "fp32")
    # the id follows the tensors and the flags, not the notes
    again = replay.load_capture(replay.capture(tmp_path / "again" / "layer3.safetensors", **call,
                                               use_qk_l2norm_in_kernel=True, scale=SCALE, note="other"))
    flipped = replay.load_capture(_capture(tmp_path / "flip" / "layer3.safetensors", use_qk_l2norm_in_kernel=False))
    assert again.case.id == cap.case.id and flipped.case.id != cap.case.id
    # backends decide support from the nearest registered case: same shapes and dtypes, varlen
    near = replay.nearest_case(cap)
    assert (near.layout, near.T, near.HV, near.K, near.dtype, near.h0_dtype) == ("varlen-one", T, HV, K, "bf16", "fp32")


def test_a_captured_case_has_the_fields_of_a_case():
    """Replay rows carry the same case columns as sweep rows (cases.case.CONFIG_FIELDS, then the seed)."""
    from dataclasses import fields

    from cases import Case
    from cases.case import CONFIG_FIELDS

    names = [f.name for f in fields(replay.CapturedCase)]
    assert names == [f.name for f in fields(Case)] == [*CONFIG_FIELDS, "seed"]
    cap = replay.CapturedCase(B=1, T=8, H=1, HV=2, K=8, V=8, dtype="bf16", g_dtype="fp32", beta_dtype="fp32")
    assert list(results.case_fields(cap)) == list(CONFIG_FIELDS)


def test_replay_judges_the_captured_call_like_a_case(tmp_path):
    path = _capture(tmp_path / "layer3.safetensors")
    cap = replay.load_capture(path)
    res, rep = replay.replay(path, backends=["torch-emulated", "ref-recurrent"], out=tmp_path / "out")
    rs = results.load(res)
    assert rs.runs[0]["matrix"] == "replay" and rs.runs[0]["capture"]["sha256"] == cap.sha256 and len(rs.ends) == 1
    assert {r["case_id"] for r in rs.rows} == {cap.case.id}
    for backend in (FLOOR_BACKEND, "torch-emulated", "ref-recurrent"):
        for tensor in ("o", "ht"):
            (row,) = _rows(rs, backend=backend, tensor=tensor, against="fp64")
            assert row["status"] == "ok" and row["layout"] == "captured" and row["T"] == T, (backend, tensor)
    floor_o = _rows(rs, backend=FLOOR_BACKEND, tensor="o")[0]["rel_rmse"]
    assert _rows(rs, backend="ref-recurrent", tensor="o", against="fp64")[0]["rel_rmse"] < 1e-12
    assert floor_o < _rows(rs, backend="torch-emulated", tensor="o", against="fp64")[0]["rel_rmse"] < 10 * floor_o
    assert _rows(rs, backend="ref-recurrent", against="torch-emulated", tensor="o")  # the pairwise view
    judged = judge_frame(rs.frame())
    assert set(zip(judged["backend"], judged["tensor"], judged["verdict"])) == {("ref-recurrent", "o", PASS),
                                                                                ("ref-recurrent", "ht", PASS)}
    # the reference honoured the captured flags, scale, state and sequences: its RMS is the one of the fp64
    # reference called directly on the tensors with them, not the one without the in-kernel L2 norm
    call = _call()
    kw = dict(initial_state=call["initial_state"], cu_seqlens=call["cu_seqlens"], scale=SCALE, output_final_state=True)
    args = [call[n] for n in ("q", "k", "v", "g", "beta")]
    o_ref, _ = reference.chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kw)
    o_raw, _ = reference.chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=False, **kw)
    rms = _rows(rs, backend=FLOOR_BACKEND, tensor="o")[0]["rms_ref"]
    assert rms == pytest.approx(float(o_ref.double().pow(2).mean().sqrt()), rel=1e-12)
    assert rms != pytest.approx(float(o_raw.double().pow(2).mean().sqrt()), rel=1e-3)
    text = rep.read_text()
    assert "## Captured inputs" in text and cap.sha256 in text and "## Verdicts" in text and "note: model" in text


def test_cli_replay_and_compare_of_replays(tmp_path, capsys):
    path = _capture(tmp_path / "a" / "layer3.safetensors")
    out_a, out_b = tmp_path / "ra", tmp_path / "rb"
    args = ["--backends", "ref-recurrent", "--no-repeat"]
    assert cli_main(["replay", str(path), *args, "--out", str(out_a)]) == 0
    printed = capsys.readouterr().out
    assert "ref-recurrent   o PASS" in printed and "report:" in printed
    assert cli_main(["replay", str(path), *args, "--out", str(out_a)]) == 2  # never overwrites a result file
    assert cli_main(["replay", str(path), *args, "--out", str(out_b)]) == 0
    same = compare.compare_files(out_a, out_b)  # the same capture replayed twice
    assert set(same.table["state"]) == {compare.SAME} and len(same.table) == 2
    other = _capture(tmp_path / "b" / "layer3.safetensors", seed=1)  # same file name, other tensors
    assert cli_main(["replay", str(other), *args, "--out", str(tmp_path / "rc")]) == 0
    cmp = compare.compare_files(out_a, tmp_path / "rc")
    assert set(cmp.table["state"]) == {compare.NOT_COMPARABLE}
    assert cmp.table["why"].str.contains("ran the same configuration on other inputs").all()


def _tensors(**changes):
    t = {n: x for n, x in _call().items()}
    t.update(changes)
    return {n: x for n, x in t.items() if x is not None}


BAD = [
    ("missing tensor", _tensors(beta=None), {}, r"missing tensor\(s\) beta"),
    ("wrong shape", _tensors(g=torch.zeros(1, T, H)), {}, r"g must be \[B, T, HV\] = \(1, 40, 2\), got \(1, 40, 1\)"),
    ("NaN", _tensors(v=_call()["v"].index_fill(1, torch.tensor([5]), float("nan"))), {}, r"v contains 32 NaN"),
    ("cu_seqlens", _tensors(cu_seqlens=torch.tensor([0, 7, 41])), {}, r"cu_seqlens must end at most at T=40 .*got 41"),
    ("state", _tensors(initial_state=torch.zeros(2, HV, K, V)), {}, r"initial_state must be \[N, HV, K, V\]"),
    ("dtypes", _tensors(k=_call()["k"].float()), {}, r"q, k and v must share a dtype"),
    ("unknown", _tensors(o=torch.zeros(1)), {}, r"unknown tensor\(s\) o"),
    ("flag", _tensors(), {"use_qk_l2norm_in_kernel": "maybe"}, r"use_qk_l2norm_in_kernel='maybe' is not a flag"),
    ("scale", _tensors(), {"scale": "-1"}, r"scale='-1' must be a positive finite number"),
    ("gate", _tensors(A_log=torch.zeros(HV)), {}, r"holds A_log but use_gate_in_kernel is false"),
    ("format", _tensors(), {"format": "something-else"}, r"not a gdn-parity-capture file"),
]


@pytest.mark.parametrize("tensors, meta, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_capture_files_name_the_problem(tmp_path, tensors, meta, match):
    path = tmp_path / "bad.safetensors"
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=meta or None)
    with pytest.raises(ValueError, match=match) as err:
        replay.load_capture(path)
    assert str(path) in str(err.value)


def test_unreadable_files_and_bad_capture_calls(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        replay.load_capture(junk)
    with pytest.raises(ValueError, match="no such capture file"):
        replay.load_capture(tmp_path / "absent.safetensors")
    call = _call()
    with pytest.raises(ValueError, match=r"beta must be \[B, T, HV\]"):
        replay.capture(tmp_path / "x.safetensors", **{**call, "beta": call["beta"][..., :1]})
    with pytest.raises(ValueError, match="reserved names version"):
        replay.capture(tmp_path / "x.safetensors", **call, version="2")
    assert not (tmp_path / "x.safetensors").exists()


def test_an_fp64_capture_is_judged_by_the_fp64_rule(tmp_path):
    """fp64 tensors: the floor is 0 (fp64 rounded to fp64) and bounded the recurrent reference at 0: a false FAIL."""
    call = {n: (t.double() if t.is_floating_point() else t) for n, t in _call().items()}
    path = replay.capture(tmp_path / "fp64.safetensors", **call, use_qk_l2norm_in_kernel=True, scale=SCALE)
    res, _ = replay.replay(path, backends=["ref-recurrent"], out=tmp_path / "out")
    judged = judge_frame(results.load(res).frame())
    assert set(zip(judged["tensor"], judged["verdict"])) == {("o", PASS), ("ht", PASS)}, judged["v_message"].tolist()


def test_a_backend_whose_available_raises_costs_only_its_own_rows(tmp_path):
    """The replay's run header asks each backend whether it is available: one that raises is recorded unavailable
    with the error, its rows say so, and the other backends are judged."""
    path = _capture(tmp_path / "layer3.safetensors")
    res, _ = replay.replay(path, backends=["torch-emulated", "tests.fake_backends:RaisingAvailable"],
                           out=tmp_path / "out")
    res = results.load(res)
    run = res.runs[0]
    assert run["availability"]["fake-raising-available"]["available"] is False
    assert "available() raised" in run["availability"]["fake-raising-available"]["reason"]
    mine = [r for r in res.rows if r["backend"] == "fake-raising-available"]
    assert mine and {r["status"] for r in mine} <= {"error", "unavailable"}
    assert any(r["backend"] == "torch-emulated" and r["status"] == "ok" for r in res.rows)
