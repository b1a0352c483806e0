"""What only the kernel tests share: why they cannot run here, the compile tests' process pool and their asserts
on the generated CUDA and on ptxas, a ``cases.Case``'s arguments in the kernel APIs' call form, and the comparison
of the segment-parallel reverse pass with the sequential one.

Inputs come from ``cases.inputs``, output gradients from ``parity.refs.grad_outputs``, the fp64 reference from
``parity.refs.compute`` and every metric from ``parity.metrics``.
"""

from __future__ import annotations

import torch

from parity.backends.base import GRAD_TENSORS
from parity.metrics import compare

GRAD_NAMES = tuple(GRAD_TENSORS.values())         # dq, dk, dv, dg, dbeta, dh0: the kernel APIs' order


def compile_skip_reason():
    """Why the compile tests cannot run here (None when tilelang and nvcc are available)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    return None


def gpu_skip_reason():
    """Why the GPU tests cannot run here (None on an sm_90 GPU with tilelang installed)."""
    import importlib.util

    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm_90 (Hopper), found sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed"
    return None


def compile_in_processes(job, n: int, label: str, name_width: int, workers: int) -> dict:
    """The compile tests' module fixture: ``job(i)`` (a top-level ``compile_for_test`` wrapper) for
    i < n in ``workers`` spawned processes; prints each kernel's compile and ptxas time and stats;
    returns the reports by kernel name."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    t = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        results = list(ex.map(job, range(n)))
    print(f"\n[{label}] {len(results)} configurations in {time.time() - t:.1f} s wall ({workers} processes)")
    for r in results:
        p = r.get("ptxas", {})
        print(f"  {r['name']:<{name_width}} tilelang {r['seconds']:6.1f} s   ptxas {r.get('ptxas_seconds', 0):5.1f} s   "
              f"regs {p.get('registers')}  spill {p.get('spill_stores')}/{p.get('spill_loads')}  "
              f"stack {p.get('stack')}")
    return {r["name"]: r for r in results}


def check_wgmma(src: str, dtype: str, want: int, others: dict | None = None):
    """The compile tests' common asserts on a generated CUDA source: ``want`` wgmma call sites with ``dtype``
    operands, and ``others[d]`` with ``d`` operands (a kernel whose exact sums take another type), each with fp32
    accumulation; no TF32 anywhere."""
    import re
    from collections import Counter

    name = {"bfloat16": "kBFloat16", "float16": "kFloat16"}
    inst = re.findall(r"wgmma_(?:ss|rs)<tl::DataType::(\w+), tl::DataType::(\w+), tl::DataType::(\w+),", src)
    expected = Counter({name[dtype]: want, **{name[d]: n for d, n in (others or {}).items()}})
    assert sum(expected.values()) == len(inst), f"expected {sum(expected.values())} wgmma call sites, found {len(inst)}"
    for a, b, c in inst:
        assert a == b and c == "kFloat32", (a, b, c)
    assert Counter(a for a, _, _ in inst) == expected, (Counter(a for a, _, _ in inst), expected)
    assert "TensorFloat32" not in src and "tf32" not in src.lower()


def check_ptxas(p: dict):
    """The compile tests' asserts on a ``ptxas_report``: it compiled, with no spills and no stack."""
    assert p["returncode"] == 0, p["log"]
    assert p.get("spill_stores") == 0 and p.get("spill_loads") == 0, p["log"]
    assert p.get("stack") == 0, p["log"]


def kernel_inputs(case, device="cpu"):
    """``cases.inputs.make_inputs(case, device)``; ValueError for a case whose gate or beta transform is in-kernel
    (these helpers pass g and beta to the kernels' pipelines as they are)."""
    from cases.inputs import make_inputs

    inp = make_inputs(case, device)
    if inp.use_gate_in_kernel or inp.use_beta_sigmoid_in_kernel:
        raise ValueError(f"case {case.id}: distribution {case.dist!r} computes the gate or beta in the kernel; "
                         "these helpers pass g and beta to the kernels' pipelines as they are")
    return inp


def call_args(case, device="cpu"):
    """``((q, k, v, g, beta), kw)`` of ``case`` (``cases.inputs.make_inputs``) on ``device`` in the kernel APIs' call
    form: kw holds scale, initial_state, use_qk_l2norm_in_kernel, state_v_first and cu_seqlens (no
    output_final_state); ValueError as ``kernel_inputs``."""
    return _call_form(kernel_inputs(case, device))


def past_fp16_range_args(T: int, device="cpu"):
    """``call_args`` of a raw-qk-l2 case (T, H=2, HV=4, an fp32 h0) with q and k at 2^17 (the kernels normalise
    them) and v and h0 at 2^15, bf16: q, k, v and the states past fp16's 65504; kw asks for the final state."""
    from cases.case import Case

    (q, k, v, g, beta), kw = call_args(Case(T=T, H=2, HV=4, dist="raw-qk-l2", h0_dtype="fp32"), device)
    q, k, v = ((x.float() * 2.0 ** e).to(torch.bfloat16) for x, e in ((q, 17), (k, 17), (v, 15)))
    kw.update(initial_state=kw["initial_state"] * 2.0 ** 15, output_final_state=True)
    return (q, k, v, g, beta), kw


def _call_form(inp):
    kw = dict(scale=inp.scale, initial_state=inp.initial_state, use_qk_l2norm_in_kernel=inp.use_qk_l2norm_in_kernel,
              state_v_first=inp.state_v_first, cu_seqlens=inp.cu_seqlens)
    return (inp.q, inp.k, inp.v, inp.g, inp.beta), kw


def bwd_args(case, device="cpu"):
    """``(args, kw, do, dht)``: ``call_args`` of ``case`` and its output gradients (``parity.refs.grad_outputs``:
    do in the input dtype, dht fp32 in the state layout), on ``device``."""
    from parity.refs import grad_outputs

    inp = kernel_inputs(case, device)
    args, kw = _call_form(inp)
    return (args, kw, *grad_outputs(case, inp))


def fp64_grads(case, device="cpu") -> list:
    """The fp64 reference's gradients of ``case`` (``case.grad``) in ``GRAD_NAMES`` order (None for dh0 without an
    initial state), from ``parity.refs.compute`` on ``device``: fp64 autograd through ``reference.chunk`` of
    sum(o * do) + sum(ht * dht) with ``bwd_args``' do and dht."""
    from cases.inputs import make_inputs
    from parity.refs import compute

    ref = compute(case.replace(grad=True), make_inputs(case, device))
    return [ref.get(n) for n in GRAD_NAMES]


def baseline_grads(case, device="cpu") -> list:
    """The same-precision baseline's (``parity.backends.BASELINE``: ``reference.emulated``) gradients of ``case``
    in ``GRAD_NAMES`` order (None for dh0 without an initial state), with ``bwd_args``' do and dht."""
    from cases.inputs import make_inputs
    from parity.backends import BASELINE, get_backend
    from parity.refs import grad_outputs

    inputs = make_inputs(case, device)
    res = get_backend(BASELINE).run(inputs, grad_outputs(case, inputs))
    return [res.grads.get(n) for n in GRAD_NAMES]


def function_grads(fn, case, device="cpu", **extra) -> list:
    """Gradients in ``GRAD_NAMES`` order (None for dh0 without an initial state) of sum(o * do) + sum(ht * dht)
    through ``fn`` (FLA's call signature, e.g. ``kernels.autograd.apply``; ``extra``: its further keyword
    arguments) on ``case``'s inputs (``parity.backends.base.run_with_grads``)."""
    from parity.backends.base import run_with_grads
    from parity.refs import grad_outputs

    inputs = kernel_inputs(case, device)

    def forward(x):
        return (*fn(**x.kwargs(), **extra), getattr(fn, "__name__", "fn"))

    res = run_with_grads(forward, inputs, grad_outputs(case, inputs))
    return [res.grads.get(n) for n in GRAD_NAMES]


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (over max |x - ref| alone for an all-zero ref), from ``parity.metrics.compare``."""
    m = compare(x.reshape(1, 1, -1), ref.reshape(1, 1, -1).to(x.device))    # any rank: a [B, T, heads] view
    return m.max_diff / (m.max_ref or 1.0)


def assert_segmented_matches_sequential(got, want, in_dtype, names=GRAD_NAMES, label=""):
    """The segment-parallel reverse pass's gradients ``got`` against the sequential pass's ``want`` (same order as
    ``names``; None where there is no gradient): same shape, dtype, no NaN/Inf; 16-bit outputs within eps / 32 (a
    tenth of their rounding floor: the state gradient entering a segment comes through an fp64 scan of fp32 results,
    so single roundings may flip), fp32 outputs within a quarter of the input dtype's rounding of the sequential
    result.  Prints one line per gradient when ``label`` is given."""
    for n, a, b in zip(names, got, want):
        if b is None:
            assert a is None, n
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, n
        m = compare(a, b)
        assert m.finite, n
        tol = (torch.finfo(a.dtype).eps / 32 if a.dtype in (torch.bfloat16, torch.float16)
               else compare(b.to(in_dtype), b).rel_rmse / 4)
        err = m.rel_rmse
        if label:
            print(f"  {label} {n}: segmented vs sequential {err:.2e} (bound {tol:.2e})")
        assert torch.equal(a, b) or err <= tol, (n, err, tol)


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_rmse of ``x`` against ``ref`` (any rank, same shape), from ``parity.metrics.compare``."""
    return compare(x.reshape(1, 1, -1), ref.reshape(1, 1, -1).to(x.device)).rel_rmse


def sequences_then_padding(lens, pad: int, H: int, HV: int, D: int, dtype=torch.bfloat16, *, h0: bool = False,
                           state_v_first: bool = False, l2: bool = True, device="cpu"):
    """``([q, k, v, g, beta], initial_state or None, cu_seqlens int64)`` of the sequences ``lens`` followed by
    ``pad`` tokens outside every sequence (cu_seqlens[-1] = sum(lens) < T): the draws of the dense ``cases.Case`` of
    T = sum(lens) + pad (distribution raw-qk-l2 with ``l2``, else gauss-l2); the initial states those of the dense
    case with one row per sequence."""
    from cases.case import Case
    from cases.inputs import make_inputs

    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    shape = dict(H=H, HV=HV, K=D, V=D, dtype=dt, dist="raw-qk-l2" if l2 else "gauss-l2")
    x = make_inputs(Case(T=sum(lens) + pad, **shape), device)
    s0 = None
    if h0:
        s0 = make_inputs(Case(B=max(len(lens), 1), T=1, h0_dtype="fp32", state_v_first=state_v_first, **shape),
                         device).initial_state
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64,
                      device=device)
    return [x.q, x.k, x.v, x.g, x.beta], s0, cu


def call_grads(args, kw, do, dht) -> list:
    """``[o, ht, dq, dk, dv, dg, dbeta(, dh0)]`` of sum(o * do) + sum(ht * dht) through
    ``kernels.chunk_gated_delta_rule(*args, **kw, output_final_state=True)`` (fresh leaves; dh0 where ``kw`` has an
    initial state)."""
    import kernels

    leaves = [x.detach().clone().requires_grad_() for x in args]
    h0 = kw["initial_state"]
    kw = dict(kw, initial_state=None if h0 is None else h0.detach().clone().requires_grad_())
    o, ht = kernels.chunk_gated_delta_rule(*leaves, **kw, output_final_state=True)
    wrt = leaves + ([kw["initial_state"]] if h0 is not None else [])
    return [o.detach(), ht.detach(), *torch.autograd.grad((o, ht), wrt, (do, dht))]
