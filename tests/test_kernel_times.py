"""``benchmarks/kernel_times.py`` on a CPU: kernel names without template arguments, and the refusal without CUDA."""

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
