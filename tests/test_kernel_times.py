"""``benchmarks/kernel_times.py`` on a CPU: kernel names without template arguments, the refusal without CUDA, and
its A/B columns (bench_kernels_bwd.py's) as implementations."""

import pytest
import torch

from benchmarks import kernel_times


def test_kernel_names_drop_templates_arguments_and_void():
    assert kernel_times.kernel_name("void gdn_bwd_dqk_kernel<(cute::Tile<int>)>(float*, int)") == "gdn_bwd_dqk_kernel"
    assert kernel_times.kernel_name("at::native::vectorized_elementwise_kernel<4, Op<float>>(int, Op<float>)") == \
        "at::native::vectorized_elementwise_kernel"
    assert kernel_times.kernel_name("fused_fwd_kernel") == "fused_fwd_kernel"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the no-CUDA path")
def test_refuses_without_cuda_and_bad_impls(capsys):
    assert kernel_times.main(["--shape", "B1_T8192_H4_HV8"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        kernel_times.main(["--impls", "ours,nope"])
    assert e.value.code == 2


def test_ab_columns_are_ours_with_their_plans(monkeypatch):
    """An A/B column of ``bench_kernels_bwd.AB`` runs ours through ``kernels.autograd.apply`` with that column's
    ``alter``; ``ours`` with none."""
    from benchmarks import bench_kernels_bwd as bench
    from kernels import autograd
    from kernels.plan import backward_plan

    seen = []
    monkeypatch.setattr(autograd, "apply", lambda *a, **k: seen.append((k["impl"], k["alter"])))
    for name in ("ours", "ours-convert-pass"):
        fn, _, why = kernel_times.implementation(name)
        assert why is None
        fn()
    (impl0, f0), (impl1, f1) = seen
    assert impl0 == impl1 == "tilelang" and f0 is None
    fused = backward_plan("bfloat16", 16, 32, 512, 8)
    assert fused.prep_converts and f1(fused) == bench.alter("ours-convert-pass")(fused) and not f1(fused).prep_converts


def test_kernel_symbol_is_the_global_functions_name():
    src = ('#include <x.h>\nextern "C" __global__ void __launch_bounds__(384, 1) gdn_bwd_fused_kernel(half_t* q, int n)'
           ' {\n}\n__global__ void other(int) {}')
    assert kernel_times.kernel_symbol(src) == "gdn_bwd_fused_kernel"
    assert kernel_times.kernel_symbol("__global__ void k() {}") == "k"
    assert kernel_times.kernel_symbol("int main() {}") is None


def test_launch_spans_are_the_memory_traces():
    """``launch_spans`` over one forward + backward on the CPU kernel path (no-op kernels, named by their configs):
    per kernel, the MiB the memory trace records for the same launches."""
    from collections import defaultdict

    from benchmarks import memory_plan as mp
    from kernels.autograd import apply

    shape = (1, 256, 2, 4, None)
    p = mp.plan(shape)
    want = defaultdict(float)
    for ln in p.trace.launches:
        want[ln.name] += ln.nbytes / 2 ** 20
    leaves, kw, do, dht = mp.inputs(*shape)
    call = kernel_times.caller(lambda *a, **k: apply(*a, **k, impl="tilelang"), mp.contextlib.nullcontext, leaves,
                               kw, do, dht, False)
    with mp.stub_kernel_path():
        call()      # (the layout caches, as the trace's warm-up call)
        got = kernel_times.launch_spans(call)
    assert got == pytest.approx(dict(want)) and len(got) >= 4, (got, dict(want))
