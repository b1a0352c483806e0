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
