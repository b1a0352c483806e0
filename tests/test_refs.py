"""The fp64 reference cache: entries are keyed and verified by the exact inputs, flags and reference version; a
stale, foreign or damaged entry is recomputed, never trusted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases import Case
from cases.inputs import make_inputs
from parity import refs
from parity.refs import RefCache, get_reference

CASE = Case(T=40, H=1, HV=2, K=8, V=8, dtype="bf16", dist="gauss-l2")
GRAD = dataclasses.replace(CASE, grad=True, h0_dtype="fp32")


def _entries(cache: RefCache) -> list:
    return sorted(cache.root.rglob("*.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", [CASE, GRAD], ids=["fwd", "grad"])
def test_an_entry_is_reused_for_the_same_inputs(tmp_path, case):
    cache = RefCache(tmp_path)
    inputs = make_inputs(case)
    first = get_reference(case, inputs, cache)
    again = get_reference(case, make_inputs(case), cache)
    assert (first.source, again.source) == ("computed", "cache") and len(_entries(cache)) == 1
    assert _same(first.tensors, again.tensors)


def _perturbed(inputs):
    q = inputs.q.clone()
    q[0, 5, 0, 3] = -q[0, 5, 0, 3] - 0.5
    return dataclasses.replace(inputs, q=q)


@pytest.mark.parametrize("change", [
    _perturbed,
    lambda i: dataclasses.replace(i, scale=0.123),
    lambda i: dataclasses.replace(i, use_qk_l2norm_in_kernel=not i.use_qk_l2norm_in_kernel),
    lambda i: dataclasses.replace(i, initial_state=torch.ones(1, 2, 8, 8)),
    lambda i: dataclasses.replace(i, q=i.q.float(), k=i.k.float(), v=i.v.float()),
], ids=["one-element", "scale", "l2norm", "initial-state", "dtype"])
def test_other_inputs_under_the_same_case_id_are_never_served_the_old_entry(tmp_path, change):
    """Keyed by case id alone, the entry of the first inputs was served for the second (and the cross-check of the
    recurrent reference then passed at rel_rmse ~1)."""
    cache = RefCache(tmp_path)
    get_reference(CASE, make_inputs(CASE), cache)
    other = change(make_inputs(CASE))
    got = get_reference(CASE, other, cache)
    assert got.source != "cache"
    assert _same(got.tensors, refs.compute(CASE, other))


def test_a_foreign_entry_at_the_path_is_recomputed_and_says_why(tmp_path):
    cache = RefCache(tmp_path)
    a, b = make_inputs(CASE), _perturbed(make_inputs(CASE))
    get_reference(CASE, a, cache)
    get_reference(CASE, b, cache)
    pa, pb = (cache.path(CASE, refs.input_key(CASE, x)) for x in (a, b))
    pb.write_bytes(pa.read_bytes())  # a copied / renamed file: the name says b, the content is a's
    got = get_reference(CASE, b, cache)
    assert got.source.startswith("recomputed: ") and "other inputs" in got.source
    assert _same(got.tensors, refs.compute(CASE, b))
    assert get_reference(CASE, b, cache).source == "cache"  # the recomputed entry replaced it


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "unreadable entry"),
    (lambda p: p.write_bytes(b""), "unreadable entry"),
    (lambda p: p.write_bytes(p.read_bytes()[:-8] + b"\x00" * 8), "checksum"),
], ids=["truncated", "empty", "flipped-bytes"])
def test_a_damaged_entry_is_recomputed_never_trusted(tmp_path, damage, words):
    cache = RefCache(tmp_path)
    inputs = make_inputs(CASE)
    want = get_reference(CASE, inputs, cache).tensors
    damage(_entries(cache)[0])
    got = get_reference(CASE, inputs, cache)
    assert got.source.startswith("recomputed: ") and words in got.source, got.source
    assert _same(got.tensors, want)


def test_an_entry_of_another_reference_version_is_recomputed(tmp_path, monkeypatch):
    cache = RefCache(tmp_path)
    inputs = make_inputs(CASE)
    get_reference(CASE, inputs, cache)
    path, version = _entries(cache)[0], refs.REF_VERSION
    monkeypatch.setattr(refs, "REF_VERSION", version + "-next")
    key = refs.input_key(CASE, inputs)
    target = cache.path(CASE, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())  # the old entry where the other version looks
    got = get_reference(CASE, inputs, cache)
    assert got.source.startswith("recomputed: ") and f"reference version {version!r}" in got.source, got.source


def test_the_key_covers_tensors_flags_and_version(monkeypatch):
    inputs = make_inputs(GRAD)
    key = refs.input_key(GRAD, inputs)
    assert key == refs.input_key(GRAD, make_inputs(GRAD))
    others = [refs.input_key(GRAD, dataclasses.replace(inputs, state_v_first=True)),
              refs.input_key(GRAD, dataclasses.replace(inputs, cu_seqlens=torch.tensor([0, 40]))),
              refs.input_key(dataclasses.replace(GRAD, grad=False), inputs),
              refs.input_key(GRAD, dataclasses.replace(inputs, initial_state=None))]
    monkeypatch.setattr(refs, "REF_VERSION", "another")
    others.append(refs.input_key(GRAD, inputs))
    assert len({key, *others}) == 6


def test_no_cache_computes(tmp_path):
    got = get_reference(CASE, make_inputs(CASE), None)
    assert got.source == "computed" and set(got.tensors) == {"o", "ht"}
    assert RefCache(tmp_path, max_entry_bytes=16).store(CASE, make_inputs(CASE), got.tensors) is False
