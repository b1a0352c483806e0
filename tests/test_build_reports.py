"""The compile tests' ptxas reports (``kernels.build``) without a second compile: parsed from TileLang's own nvcc
run when it compiles, kept beside TileLang's cache for a kernel it loads, and only otherwise compiled again."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from kernels import build

LOG = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
       "ptxas info    : Function properties for k\n"
       "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
       "ptxas info    : Used 168 registers, used 1 barriers\n")


def test_a_saved_report_is_read_without_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))

    def no_nvcc(*a, **k):
        raise AssertionError("nvcc ran for a source whose report was saved")
    build._save_ptxas("__global__ void k() {}", LOG)
    monkeypatch.setattr(subprocess, "run", no_nvcc)
    r = build.ptxas_report("__global__ void k() {}")
    assert (r["returncode"], r["registers"], r["stack"], r["spill_stores"], r["spill_loads"]) == (0, 168, 8, 4, 4)
    assert build._ptxas_saved("__global__ void k2() {}") is None         # keyed by the source
    assert build.ptxas_report("other", log=LOG)["registers"] == 168       # a given log wins, and is kept
    assert build._ptxas_saved("other") is not None


def test_tilelang_ptxas_output_is_captured_and_the_environment_restored(monkeypatch):
    tilelang = pytest.importorskip("tilelang")
    monkeypatch.delenv("TILELANG_VERBOSE", raising=False)
    logs: list = []
    with build._tilelang_ptxas_log(logs):
        assert os.environ["TILELANG_VERBOSE"] == "1"
        tilelang.logger.info("PTXAS verbose output:\n%s", LOG)
        tilelang.logger.info("NVCC compilation command: %s", "nvcc ...")
    assert logs == ["PTXAS verbose output:\n" + LOG] and "TILELANG_VERBOSE" not in os.environ
    tilelang.logger.info("PTXAS verbose output:\n%s", LOG)                  # the handler is gone
    assert len(logs) == 1 and not any(isinstance(h, logging.Handler) and type(h).__name__ == "Grab"
                                      for h in tilelang.logger.handlers)


class _Adapter:
    def __init__(self, result_idx, callee_alloc=False):
        self.result_idx, self._ffi_callee_allocated_output_abi = result_idx, callee_alloc
        self.executable = object()

    def get_exportable_executable(self):
        return self.executable


class _Kernel:
    def __init__(self, backend, adapter):
        self.execution_backend, self.adapter, self.torch_function = backend, adapter, "wrapper"


@pytest.mark.parametrize("backend, result_idx, callee_alloc, direct", [
    ("tvm_ffi", [], False, True),           # every tensor passed in: the executable itself
    ("tvm_ffi", [2], False, False),         # the wrapper allocates an output
    ("tvm_ffi", [], True, False),           # TVM-FFI allocates outputs
    ("cython", [], False, False),           # another backend's wrapper
])
def test_direct_launch_only_where_the_wrapper_does_nothing_but_forward(backend, result_idx, callee_alloc, direct):
    kern = _Kernel(backend, _Adapter(result_idx, callee_alloc))
    assert build.direct_launch(kern) is kern
    assert (kern.torch_function is kern.adapter.executable) == direct
    assert build.launches_directly(kern) == direct
    assert kern.torch_function == ("wrapper" if not direct else kern.adapter.executable)
