"""``benchmarks/experiments/prep_convert_time.py`` on a CPU: the refusal without CUDA."""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the no-CUDA path")
def test_prep_convert_time_refuses_without_cuda(capsys):
    """The script (the converting prep against the conversion pass) says why it cannot run on a CPU instead of
    failing inside torch."""
    path = os.path.join(ROOT, "benchmarks", "experiments", "prep_convert_time.py")
    spec = importlib.util.spec_from_file_location("prep_convert_time", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--rounds", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
