"""GPU tests of padded varlen and FLA's in-kernel gate and beta activations on our TileLang kernels (marker
``gpu``; skipped with the reason without an sm_90 GPU and tilelang).

* (The harness's rule on ``varlen-padded`` and ``qwen-gates-kernel`` cells: ``tests/test_kernels_verdicts_gpu.py``.)
* Padded varlen, dense-equivalent: o, the final state and every gradient equal bitwise the call on the sequences'
  tokens alone, o and the gradients are 0 past cu_seqlens[-1], NaN in the padding changes nothing; with the
  forward's segment-parallel (CP) state and the backward's segmented reverse pass, and under no_grad and
  inference_mode (cu_seqlens an inference tensor).
* The in-kernel gate is no further from fp64 than FLA's fused gate kernel (when fla-core is installed).
"""

from __future__ import annotations

import pytest
import torch

from cases.case import Case
from tests import kernel_support as tt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tt.gpu_skip_reason() is not None, reason=tt.gpu_skip_reason() or "")]

# name: (sequence lengths, padding tokens, H, HV, D, initial state, state_v_first)
PADDED = {
    "ragged_h0_vfirst": ([700, 0, 1, 129], 333, 2, 4, 128, True, True),
    "D64_pad_in_chunk": ([64, 65, 1000], 5, 1, 2, 64, False, False),
    "cp_and_segmented_dh": ([33000, 100], 300, 1, 2, 128, True, False),
}


def _inputs(name, nan_padding=False):
    lens, pad, H, HV, D, h0, vf = PADDED[name]
    dev = torch.device("cuda")
    n = sum(lens)
    (q, k, v, g, b), s0, cu = tt.sequences_then_padding(lens, pad, H, HV, D, h0=h0, state_v_first=vf, device=dev)
    if nan_padding:
        for x in (q, k, v, g, b):
            x[:, n:] = float("nan")
    cu = cu.to(torch.int32)
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(v.shape, generator=gen).to(dev, torch.bfloat16)
    dht = 0.1 * torch.randn((len(lens), HV, D, D), generator=gen).to(dev)
    kw = dict(initial_state=s0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_v_first=vf)
    return [q, k, v, g, b], kw, do, dht, n


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_varlen_is_the_call_on_the_sequences(name):
    """o and the gradients: bitwise the call on the sequences' tokens before cu_seqlens[-1], 0 past it; the final
    state and dh0 bitwise; the same with NaN in the padding; the same o and state under no_grad and inference_mode;
    the long case runs the CP forward and the segmented reverse pass."""
    import kernels
    from kernels.backward.pipeline import plan_for as bwd_plan
    from kernels.backward.pipeline import prepare_backward
    from kernels.forward.pipeline import plan_for, prepare

    xs, kw, do, dht, n = _inputs(name)
    if name == "cp_and_segmented_dh":
        assert plan_for(prepare(*xs, **kw)).cp > 1, "the long case does not run the CP forward"
        assert bwd_plan(prepare_backward(*xs, do, dht, **kw)).dh_segments is not None, "no segmented reverse pass"
    got = tt.call_grads(xs, kw, do, dht)
    cut = tt.call_grads([x[:, :n] for x in xs], kw, do[:, :n], dht)
    nan = tt.call_grads(*_inputs(name, nan_padding=True)[:4])
    labels = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"][:len(got)]
    for label, a, c, z in zip(labels, got, cut, nan):
        assert bool(torch.isfinite(a).all()), label
        assert torch.equal(a, z), f"{label} changed with NaN in the padding"
        if label in ("ht", "dh0"):
            assert torch.equal(a, c), label
        else:
            assert torch.equal(a[:, :n], c), f"{label} differs from the call on the sequences alone"
            assert torch.all(a[:, n:] == 0), f"{label} is not 0 past cu_seqlens[-1]"
    with torch.no_grad():
        o, ht = kernels.chunk_gated_delta_rule(*xs, **kw, output_final_state=True)
    want_o, want_ht = kernels.chunk_gated_delta_rule(*[x[:, :n] for x in xs], **kw, output_final_state=True)
    assert torch.equal(o[:, :n], want_o.detach()) and torch.all(o[:, n:] == 0) and torch.equal(ht, want_ht.detach())
    with torch.inference_mode():
        cu = kw["cu_seqlens"].clone()
        o2, ht2 = kernels.chunk_gated_delta_rule(*xs, **dict(kw, cu_seqlens=cu), output_final_state=True)
    assert torch.equal(o2, o) and torch.equal(ht2, ht)


def test_in_kernel_gate_no_further_from_fp64_than_flas():
    """Our gate activation (fp32, torch) against fp64 is no further off than FLA's fused gate kernel
    (``fla.ops.gated_delta_rule.gate.fused_gdn_gate``) on the Qwen3-Next inputs."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.gate import fused_gdn_gate

    from cases.inputs import make_inputs
    from kernels.activations import activations
    from reference.prepare import gate_from_raw

    x = make_inputs(Case(T=8192, H=4, HV=8, dist="qwen-gates-kernel", g_dtype="bf16"), "cuda")
    ours, _ = activations(x.g, x.beta, x.v, True, x.A_log, x.dt_bias, False)
    fla = fused_gdn_gate(x.g, x.A_log, x.dt_bias)
    exact = gate_from_raw(x.g.double(), x.A_log.double(), x.dt_bias.double())
    e, ef = tt.rel_rmse(ours, exact), tt.rel_rmse(fla, exact)
    print(f"\ngate rel_rmse vs fp64: ours {e:.3e}, FLA fused_gdn_gate {ef:.3e}")
    assert e <= ef
