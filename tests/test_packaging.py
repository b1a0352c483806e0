"""pyproject.toml's extras: ``engines`` pins FlashInfer's GDN prefill and what it imports and resolves next to
``gpu``; the engines themselves (vllm, sglang: each pins its own torch) are in no dependency list."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _reqs(extra: str) -> dict[str, Requirement]:
    return {(r := Requirement(text)).name: r for text in EXTRAS[extra]}


def test_engines_pins_flashinfer_and_its_gdn_dependencies():
    eng = _reqs("engines")
    pinned = {"flashinfer-python": "==0.7.2.post1", "nvidia-cutlass-dsl": "==4.8.1", "cuda-tile": "==1.7.0",
              "nvidia-cudnn-frontend": "==1.32.0"}
    for name, spec in pinned.items():
        assert str(eng[name].specifier) == spec, name
    assert eng["nvidia-cutlass-dsl"].extras == {"cu13"}  # the CUDA 13 libraries the H200 runs loaded


def test_engines_tvm_ffi_range_admits_what_tilelang_and_flashinfer_need():
    tvm = _reqs("engines")["apache-tvm-ffi"].specifier
    assert "0.1.12" in tvm  # tilelang 0.1.15 (extra gpu) needs >=0.1.11,<0.1.13
    assert "0.1.15.post2" in tvm  # what the H200 FlashInfer runs used
    assert _reqs("gpu")["tilelang"].specifier == Requirement("tilelang==0.1.15").specifier


def test_no_dependency_list_pulls_an_engine_or_its_torch():
    lists = {"dependencies": PROJECT["dependencies"], **EXTRAS}
    for where, reqs in lists.items():
        names = {Requirement(r).name for r in reqs}
        assert not names & {"vllm", "sglang", "sglang-kernel"}, where
