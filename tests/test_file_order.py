"""The CPU cells of FLA's Triton backends run the same way whatever order the test files run in: triton reads
TRITON_INTERPRET once, at its first import, and the root conftest sets it before any test module can import it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CASE = "dense_B1_T1_H2-HV4_K32-V32_fp32_g-fp32_beta-fp32_h0-none_qwen-gates_s0"
FIRST_IMPORTS_FLA = "tests/test_backend_backward.py"  # imports fla (and so triton) in its tests


def _outcome(files: list[str]) -> str:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rs", *files,
           "--case", CASE, "-k", "fla-triton or triton_backward_switches", "--warmup", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    done = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    return done.stdout.strip().splitlines()[-1] + "\n" + done.stdout[-1500:]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is the CPU path; with a GPU FLA "
                    "compiles its kernels whatever the order")
def test_fla_triton_cpu_cells_run_in_either_file_order():
    for files in ([FIRST_IMPORTS_FLA, "tests/test_matrix.py"], ["tests/test_matrix.py", FIRST_IMPORTS_FLA]):
        summary = _outcome(files)
        assert summary.startswith("2 passed") and "skipped" not in summary.splitlines()[0], (files, summary)
