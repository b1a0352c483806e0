"""CPU tests of FLA's in-kernel gate and beta activations and of padded varlen on our kernels' API
(``kernels.autograd.apply(..., impl="emulation")``, and the kernel pipelines with stand-in kernels).

* Activations: ``use_gate_in_kernel`` (g = -exp(A_log) softplus(g + dt_bias), fp32) and
  ``use_beta_sigmoid_in_kernel`` (beta = sigmoid(beta), fp32) against the fp64 reference with the same arguments:
  o, the final state and every gradient (dA_log and ddt_bias included) no further from fp64 than the FLA-like
  baseline (``reference.emulated``) on the same inputs; bad activation arguments raise a ValueError naming them.
* Padded varlen (``cu_seqlens[-1] < T``): o and every gradient are zero past the last sequence, equal bitwise to
  the call on the tokens of the sequences only, unchanged by NaN in the padding (never read), and as close to
  the fp64 reference as the baseline; the segment plans of both directions stop at the last sequence; the layout
  ``varlen-padded`` is supported by the references and ours, refused with a reason by backends that leave the
  padding undefined.
"""

from __future__ import annotations

import pytest
import torch

from cases.case import Case
from cases.inputs import make_inputs
from kernels.autograd import apply
from tests import kernel_support as tt

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _gate_inputs(dtype="bf16", T=200, g_dtype="fp32", dt_bias=True):
    """Qwen3-Next's raw gate input, beta logits, A_log and dt_bias ([HV] fp32) of a registered distribution."""
    x = make_inputs(Case(T=T, H=2, HV=4, K=64, V=64, dtype=dtype, g_dtype=g_dtype, beta_dtype=g_dtype,
                         h0_dtype="fp32", dist="qwen-gates-kernel"))
    kw = dict(initial_state=x.initial_state, use_qk_l2norm_in_kernel=x.use_qk_l2norm_in_kernel,
              use_gate_in_kernel=True, A_log=x.A_log, dt_bias=x.dt_bias if dt_bias else None,
              use_beta_sigmoid_in_kernel=True)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(x.v.shape, generator=gen).to(x.v.dtype)
    dht = 0.1 * torch.randn(x.initial_state.shape, generator=gen)
    return (x.q, x.k, x.v, x.g, x.beta), kw, do, dht


def _run(fwd, xs, kw, do, dht, cast):
    """(o, ht, {name: gradient}) of ``sum(o * do) + sum(ht * dht)`` through ``fwd`` on ``xs`` and the differentiable
    keyword tensors (initial_state, A_log, dt_bias) cast by ``cast``."""
    leaves = [cast(x).detach().requires_grad_() for x in xs]
    kw = dict(kw)
    extra = {}
    for n in ("initial_state", "A_log", "dt_bias"):
        if kw.get(n) is not None:
            kw[n] = extra[n] = cast(kw[n]).detach().requires_grad_()
    o, ht = fwd(*leaves, **kw, output_final_state=True)
    (o.to(cast(do).dtype) * cast(do)).sum().add((ht * cast(dht)).sum()).backward()
    grads = dict(zip(NAMES, [x.grad for x in leaves]))
    grads.update({{"initial_state": "dh0", "A_log": "dA_log", "dt_bias": "ddt_bias"}[n]: t.grad
                  for n, t in extra.items()})
    return o.detach(), ht.detach(), grads


def _ours(*args, **kw):
    return apply(*args, **kw, impl="emulation")


def _low(x):
    return x if x.dtype != torch.float64 else x.float()


def _within_baseline(xs, kw, do, dht, label):
    """Ours (emulation) no further from the fp64 reference than the FLA-like baseline, tensor by tensor (o also
    within 2x its rounding floor); returns ours."""
    from reference.chunk import chunk_gated_delta_rule as ref
    from reference.emulated import chunk_gated_delta_rule as emu

    ro, rh, rg = _run(ref, xs, kw, do, dht, lambda x: x.double())
    bo, bh, bg = _run(emu, xs, kw, do, dht, _low)
    oo, oh, og = _run(_ours, xs, kw, do, dht, lambda x: x)
    assert set(og) == set(rg), (sorted(og), sorted(rg))
    floor = tt.rel_rmse(ro.to(xs[0].dtype), ro)
    assert tt.rel_rmse(oo, ro) <= 2 * floor, (label, "o", tt.rel_rmse(oo, ro), floor)
    rows = [("o", oo, bo, ro), ("ht", oh, bh, rh)] + [(n, og[n], bg[n], rg[n]) for n in rg]
    for n, a, b, r in rows:
        assert a.shape == r.shape and bool(torch.isfinite(a).all()), (label, n)
        e, eb = tt.rel_rmse(a, r), tt.rel_rmse(b, r)
        assert e <= eb, f"{label}: {n} rel_rmse {e:.3e} > FLA-like baseline {eb:.3e}"
    return oo, oh, og


# ------------------------------------------------------------------------------------------ in-kernel activations


def test_activations_follow_fla_formulas():
    """fp32 results of FLA's formulas: -exp(A_log) softplus(g + dt_bias) (softplus linear above 20, dt_bias
    optional) and sigmoid(beta), from inputs in any float dtype; without the flags the inputs come back as they
    are."""
    from kernels.activations import activations
    from reference.prepare import gate_from_raw

    (_, _, v, g, beta), kw, _, _ = _gate_inputs(g_dtype="bf16")
    g = torch.cat([g[:, :-1], torch.full_like(g[:, :1], 30.0)], 1)      # a raw gate input past the threshold
    A_log, dt_bias = kw["A_log"], kw["dt_bias"]
    ga, ba = activations(g, beta, v, True, A_log, dt_bias, True)
    assert ga.dtype == ba.dtype == torch.float32
    want = gate_from_raw(g.double(), A_log.double(), dt_bias.double())
    assert torch.allclose(ga.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(ga[0, -1], -A_log.exp() * (30.0 + dt_bias))          # softplus(x) = x above 20
    assert torch.allclose(ba.double(), torch.sigmoid(beta.double()), rtol=1e-6, atol=0)
    no_bias = activations(g, beta, v, True, A_log, None, False)
    assert torch.allclose(no_bias[0].double(), gate_from_raw(g.double(), A_log.double(), None), rtol=1e-6, atol=0)
    assert no_bias[1] is beta
    same = activations(g, beta, v)
    assert same[0] is g and same[1] is beta


@pytest.mark.parametrize("variant", ["bf16_dt_bias", "fp16_no_dt_bias", "bf16_gates_in_bf16"])
def test_in_kernel_activations_vs_fp64(variant):
    """o, ht and dq, dk, dv, dg (raw gate input), dbeta (logits), dh0, dA_log, ddt_bias through the emulation with
    the activations in the call, no further from fp64 than the FLA-like baseline with the same arguments."""
    args = {"bf16_dt_bias": {}, "fp16_no_dt_bias": dict(dtype="fp16", dt_bias=False),
            "bf16_gates_in_bf16": dict(g_dtype="bf16")}[variant]
    xs, kw, do, dht = _gate_inputs(**args)
    _, _, grads = _within_baseline(xs, kw, do, dht, variant)
    assert grads["dA_log"].dtype == torch.float32 and grads["dA_log"].shape == kw["A_log"].shape
    assert ("ddt_bias" in grads) == (kw["dt_bias"] is not None)
    assert grads["dg"].dtype == xs[3].dtype and grads["dbeta"].dtype == xs[4].dtype


def test_activations_in_the_call_equal_activations_before_it():
    """The in-kernel flags give what the activated g and beta give (bitwise: one computation), and the gradient of
    A_log is sum(dg_decay * g_decay) as FLA's gate backward computes it."""
    from kernels.activations import activations

    xs, kw, do, dht = _gate_inputs()
    o, ht, grads = _run(_ours, xs, kw, do, dht, lambda x: x)
    q, k, v, g, beta = xs
    ga, ba = activations(g, beta, v, True, kw["A_log"], kw["dt_bias"], True)
    ga = ga.detach().requires_grad_()
    plain = {n: kw[n] for n in ("initial_state", "use_qk_l2norm_in_kernel")}
    o2, ht2 = _ours(q, k, v, ga, ba, **plain, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    (o2.float() * do.float()).sum().add((ht2 * dht).sum()).backward()
    want = (ga.grad.double() * ga.detach().double()).sum((0, 1))
    assert torch.allclose(grads["dA_log"].double(), want, rtol=1e-5, atol=0)


def _bad(kw_change, tensors=None):
    xs, kw, _, _ = _gate_inputs(T=70)
    xs = list(xs)
    for i, t in (tensors or {}).items():
        xs[i] = t(xs[i])
    return xs, {**kw, **kw_change}


HV = 4
BAD_ACTIVATIONS = {
    "A_log missing": (dict(A_log=None), None, r"use_gate_in_kernel=True needs A_log"),
    "A_log [HV + 1]": (dict(A_log=torch.zeros(HV + 1)), None, r"A_log must be a floating \[HV\] = \(4,\)"),
    "A_log [1, HV]": (dict(A_log=torch.zeros(1, HV)), None, r"A_log must be a floating \[HV\].*\(1, 4\)"),
    "A_log integer": (dict(A_log=torch.zeros(HV, dtype=torch.int64)), None, r"A_log must be a floating"),
    "dt_bias [HV, 1]": (dict(dt_bias=torch.zeros(HV, 1)), None, r"dt_bias must be a floating \[HV\]"),
    "A_log without the gate": (dict(use_gate_in_kernel=False), None, r"A_log is given but use_gate_in_kernel=False"),
    "dt_bias without the gate": (dict(use_gate_in_kernel=False, A_log=None), None,
                                 r"dt_bias is given but use_gate_in_kernel=False"),
    "raw gate [B, T, 1]": ({}, {3: lambda g: g[..., :1]}, r"g \(raw gate input\) must be a floating \[B, T, HV\]"),
    "beta logits [B, T - 1, HV]": ({}, {4: lambda b: b[:, 1:]}, r"beta \(beta logits\) must be .*\(1, 70, 4\)"),
    "flag not a bool": (dict(use_gate_in_kernel="yes"), None, r"use_gate_in_kernel must be a bool"),
}


@pytest.mark.parametrize("name", list(BAD_ACTIVATIONS))
def test_bad_activation_arguments_raise_valueerror(name):
    """Each bad activation argument: a ValueError naming it, from the emulation and from the public entry (before
    any device check: it runs on the CPU)."""
    import kernels

    change, tensors, match = BAD_ACTIVATIONS[name]
    xs, kw = _bad(change, tensors)
    with pytest.raises(ValueError, match=match):
        _ours(*xs, **kw)
    with pytest.raises(ValueError, match=match):
        kernels.chunk_gated_delta_rule(*xs, **kw)


# ------------------------------------------------------------------------------------------------ padded varlen

PADDED = {  # name: (lengths, padding tokens, options)
    "three_seqs_pad40_h0_vfirst": ([50, 0, 80], 40, dict(h0=True, state_v_first=True)),
    "pad_inside_a_chunk_gva": ([64, 65], 7, dict()),
    "one_seq_pad_one_chunk_fp16_no_l2": ([100], 64, dict(dt=torch.float16, l2=False)),
    "no_sequence_tokens": ([0, 0], 30, dict(h0=True)),
}


def _padded_inputs(name, nan_padding=False):
    lens, pad, kw = PADDED[name]
    kw = dict(kw)
    dt = kw.pop("dt", torch.bfloat16)
    l2 = kw.pop("l2", True)
    vf = kw.get("state_v_first", False)
    n = sum(lens)
    H, HVp = (1, 2) if "gva" not in name else (1, 4)
    (q, k, v, g, b), s0, cu = tt.sequences_then_padding(lens, pad, H, HVp, 64, dt, h0=kw.get("h0", False),
                                                        state_v_first=vf, l2=l2)
    if nan_padding:
        for x in (q, k, v, g, b):
            x[:, n:] = float("nan")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(v.shape, generator=gen).to(dt)
    dht = 0.1 * torch.randn((len(lens), HVp, 64, 64), generator=gen)
    call = dict(initial_state=s0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, state_v_first=vf)
    return (q, k, v, g, b), call, do, dht, n


def _grads_list(o, ht, g):
    return [o, ht] + [g[n] for n in NAMES if n in g]


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_varlen_is_the_call_on_the_sequences(name):
    """Emulation: o and every gradient are 0 past cu_seqlens[-1]; before it they, the final state and dh0 equal
    (bitwise) the call on the first cu_seqlens[-1] tokens; NaN in the padding changes nothing (it is never read)."""
    _same_as_the_sequences(_ours, name)


def _same_as_the_sequences(fwd, name):
    """``fwd`` on padded varlen ``name``: o and the gradients equal (bitwise) ``fwd`` on the sequences' tokens alone
    before cu_seqlens[-1] and 0 past it, the final state and dh0 equal; the same with NaN in the padding.  Returns
    the outputs and gradients."""
    xs, call, do, dht, n = _padded_inputs(name)
    ident = lambda x: x   # noqa: E731
    got = _grads_list(*_run(fwd, xs, call, do, dht, ident))
    cut = _grads_list(*_run(fwd, [x[:, :n] for x in xs], call, do[:, :n], dht, ident))
    nan = _grads_list(*_run(fwd, *_padded_inputs(name, nan_padding=True)[:4], ident))
    labels = ["o", "ht"] + [m for m in NAMES if m != "dh0" or call["initial_state"] is not None]
    assert len(got) == len(labels)
    for label, a, c, z in zip(labels, got, cut, nan):
        assert torch.equal(a, z), f"{label} changed with NaN in the padding"
        if label in ("ht", "dh0"):
            assert torch.equal(a, c), label
            continue
        assert a.shape[1] == n + PADDED[name][1], label
        assert torch.equal(a[:, :n], c), label
        assert torch.all(a[:, n:] == 0), f"{label} is not 0 past cu_seqlens[-1]"
    return xs, call, do, dht, got


@pytest.mark.parametrize("name", [n for n in PADDED if n != "no_sequence_tokens"])
def test_padded_varlen_vs_fp64(name):
    """Emulation on padded varlen: o, ht and every gradient no further from the fp64 reference (o = 0 past the last
    sequence there too) than the FLA-like baseline."""
    xs, call, do, dht, _ = _padded_inputs(name)
    _within_baseline(xs, call, do, dht, name)


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_varlen_kernel_pipelines_on_cpu(monkeypatch, name):
    """The kernel path's forward and backward (``kernels.autograd`` with stand-in kernels on the CPU) on padded
    varlen: every kernel is handed only the sequences' tokens; o and the gradients equal (bitwise) the same path on
    those tokens alone and are 0 past cu_seqlens[-1], also with NaN in the padding; the gradients equal the
    emulation's."""
    import kernels.build as build
    from tests.test_kernels_bwd_emulation import _fake_kernels

    _fake_kernels(monkeypatch, [])
    rows = []
    stand_in = build.get_kernel

    def watching(cfg):
        kern = stand_in(cfg)

        def run(*args):
            rows.extend(a.shape[0] for a in args[:2] if isinstance(a, torch.Tensor) and a.dim() == 3)
            return kern(*args)
        return run

    monkeypatch.setattr(build, "get_kernel", watching)
    xs, call, do, dht, got = _same_as_the_sequences(apply, name)
    n = sum(PADDED[name][0])
    assert set(rows) <= {n}, f"a kernel was handed token rows {sorted(set(rows))}, not the {n} of the sequences"
    want = _grads_list(*_run(_ours, xs, call, do, dht, lambda x: x))
    for a, w in zip(got[2:], want[2:]):
        assert a.shape == w.shape and a.dtype == w.dtype
        assert torch.equal(a, w) or tt.rel_rmse(a, w) <= tt.rel_rmse(w.to(xs[0].dtype), w) / 4


def test_padded_varlen_tables_and_segment_plans_stop_at_the_last_sequence():
    """The chunk tables cover the sequences' chunks only; cu_seqlens past T is refused by name; the forward's CP
    segments and the backward's segmented reverse pass end at cu_seqlens[-1], not T."""
    from kernels.backward import dh_segmented
    from kernels.forward.pipeline import _cp_tables
    from kernels.interface import call_tables

    dev = torch.device("cpu")
    cu = torch.tensor([0, 100, 164], dtype=torch.int32)
    cu_host, (cu_d, ci, co, NC, order) = call_tables(1, 300, cu, dev)
    assert cu_host == [0, 100, 164] and NC == 2 + 1 and ci.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert co.tolist() == [0, 2, 3] and cu_d.tolist() == [0, 100, 164] and order.tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at most at T=150"):
        call_tables(1, 150, torch.tensor([0, 100, 164]), dev)
    long = [0, 300 * 64 + 5]
    seg_cu, seg_co, seg_of, seg_of_d, nseg, scan_cu, scan_co, warm_co = _cp_tables(1, long[-1] + 1000,
                                                                                   torch.tensor(long), long, 4, dev,
                                                                                   warm=True)
    assert seg_cu.tolist()[-1] == long[-1] and seg_co.tolist()[-1] == 301 and nseg == 4
    assert warm_co.tolist() == seg_co.tolist() + [0] * 4 + [3] * 4     # cp_warm: first and last segment of each
    assert _cp_tables(1, long[-1] + 1000, torch.tensor(long), long, 4, dev)[-1] is None     # exact starts: none
    assert scan_cu.tolist() == seg_cu.tolist()[:-1] and scan_co.tolist() == seg_co.tolist()[:-1]
    assert seg_of == [0, 4] and seg_of_d.tolist() == seg_of and seg_of_d.dtype == torch.int32
    plan = dh_segmented.plan(long, 1, 2, 132)
    assert plan is not None and plan.cu[-1] == long[-1] and plan.chunk_offsets[-1] == 301


# ----------------------------------------------------------------------------------------- the layout and backends


def test_varlen_padded_layout_and_the_references():
    """The layout leaves padding past cu_seqlens[-1]; both references give o = 0 there and what they give on the
    sequences alone before it."""
    from reference.chunk import chunk_gated_delta_rule as chunk
    from reference.recurrent import fused_recurrent_gated_delta_rule as recurrent

    case = Case(layout="varlen-padded", T=300, H=1, HV=2, K=16, V=16, dtype="fp32", h0_dtype="fp32")
    x = make_inputs(case)
    n = int(x.cu_seqlens[-1])
    assert 0 < n < case.T and x.seq_lens == [b - a for a, b in zip(x.cu_seqlens[:-1], x.cu_seqlens[1:])]
    cut = {**x.reference_kwargs(), **{t: getattr(x, t)[:, :n] for t in ("q", "k", "v", "g", "beta")}}
    for ref in (chunk, recurrent):
        o, ht = ref(**x.reference_kwargs())
        oc, hc = ref(**cut)
        assert o.shape[1] == case.T and torch.all(o[:, n:] == 0), ref.__module__
        assert torch.allclose(o[:, :n], oc, rtol=1e-12, atol=1e-12) and torch.allclose(ht, hc, rtol=1e-12, atol=1e-12)


def test_backends_say_whether_they_take_padded_varlen():
    """The references and ours take padded varlen and the in-kernel activations; the backends that leave o past
    cu_seqlens[-1] undefined refuse it with that reason (before any GPU check)."""
    from parity.backends import all_backends

    cpu = torch.device("cpu")
    case = Case(layout="varlen-padded", T=256, H=2, HV=4, K=128, V=128, dtype="bf16")
    takes = {"ref-recurrent", "torch-emulated", "tilelang"}
    refuses = {"fla-triton", "fla-recurrent", "fla-dispatch", "flash-qla", "flashinfer", "flashinfer-cake", "cudnn",
               "vllm-fla", "sglang-fla"}
    backends = all_backends()
    assert takes | refuses <= set(backends), sorted(backends)
    for name in takes:
        assert backends[name]().supports(case, cpu) == (True, ""), name
    assert backends["tilelang"]().supports(case.replace(layout="dense", dist="qwen-gates-kernel"), cpu) == (True, "")
    for name in refuses:
        ok, reason = backends[name]().supports(case, cpu)
        assert not ok and "padded varlen" in reason and "past the last sequence" in reason, (name, reason)
        _, reason = backends[name]().supports(case.replace(layout="varlen-ragged"), cpu)
        assert "padded" not in reason, (name, reason)


def test_a_worst_element_in_the_padding_is_located():
    """metrics.compare on padded varlen: a difference past cu_seqlens[-1] is located after the last sequence."""
    from parity import metrics

    ref = torch.zeros(1, 10, 2, 3)
    out = ref.clone()
    out[0, 8, 1, 2] = 1.0
    m = metrics.compare(out, ref, cu_seqlens=[0, 4, 7])
    assert (m.where.seq, m.where.token, m.where.head, m.where.channel) == (2, 1, 1, 2)
