"""Shared helpers of the kernel tests and the kernel benchmarks.

Inputs, metrics, the fp64 reference (``reference.chunk`` when present, else a
small fp64 recurrence), FLA Triton with its other backends switched off, and the
list of GPU correctness cases.  Imports torch only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as Fn


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


def check_wgmma(src: str, dtype: str, want: int):
    """The compile tests' common asserts on a generated CUDA source: ``want`` wgmma call sites, each with
    ``dtype`` operands and fp32 accumulation; no TF32 anywhere."""
    import re

    operand = {"bfloat16": "kBFloat16", "float16": "kFloat16"}[dtype]
    inst = re.findall(r"wgmma_(?:ss|rs)<tl::DataType::(\w+), tl::DataType::(\w+), tl::DataType::(\w+),", src)
    assert len(inst) == want, f"expected {want} wgmma call sites, found {len(inst)}"
    for a, b, c in inst:
        assert (a, b, c) == (operand, operand, "kFloat32"), (a, b, c)
    assert "TensorFloat32" not in src and "tf32" not in src.lower()


def check_ptxas(p: dict):
    """The compile tests' asserts on a ``ptxas_report``: it compiled, with no spills and no stack."""
    assert p["returncode"] == 0, p["log"]
    assert p.get("spill_stores") == 0 and p.get("spill_loads") == 0, p["log"]
    assert p.get("stack") == 0, p["log"]


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(x - ref) / RMS(ref), in fp64."""
    x, ref = x.double(), ref.double()
    den = ref.pow(2).mean().sqrt()
    return ((x - ref).pow(2).mean().sqrt() / den).item() if den > 0 else (x - ref).abs().max().item()


def max_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def max_rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (fp64; over max |x - ref| alone when ref is all zeros)."""
    return max_diff(x, ref) / ((ref.double().abs().max().item() if ref.numel() else 0.0) or 1.0)


def nonfinite(x: torch.Tensor | None) -> int:
    return 0 if x is None else int((~torch.isfinite(x)).sum().item())


def make_inputs(B, T, H, HV, D, dt, *, gate="logsigmoid", beta="uniform", h0=None, l2=True, seed=0,
                gate_dtype=torch.float32, N=None, device="cpu", state_v_first=False):
    """q, k ~ N(0, 1) (k L2-normalised up front when the kernel does not normalise), v ~ N(0, 1),
    g: 'logsigmoid' (logsigmoid(N(0,1))), 'near_-20' (-20 + U(0, 0.5)), 'zero'; beta: 'uniform' U(0, 1)
    or 'extreme' (1e-4 or 1 - 1e-4); h0: None or a scale for N(0, 1) initial states [N, HV, D, D]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, H, D, generator=gen)
    if not l2:
        k = Fn.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, D, generator=gen)
    if gate == "logsigmoid":
        g = Fn.logsigmoid(torch.randn(B, T, HV, generator=gen))
    elif gate == "near_-20":
        g = -20.0 + 0.5 * torch.rand(B, T, HV, generator=gen)
    elif gate == "zero":
        g = torch.zeros(B, T, HV)
    elif gate == "small":
        g = -0.01 * torch.rand(B, T, HV, generator=gen)
    else:
        raise ValueError(gate)
    if beta == "uniform":
        b = torch.rand(B, T, HV, generator=gen)
    elif beta == "extreme":
        b = torch.where(torch.rand(B, T, HV, generator=gen) < 0.5, 1e-4, 1.0 - 1e-4)
    else:
        raise ValueError(beta)
    N = B if N is None else N
    s0 = None if h0 is None else h0 * torch.randn(N, HV, D, D, generator=gen)
    if s0 is not None and state_v_first:
        s0 = s0.transpose(-1, -2).contiguous()
    out = [q.to(dt), k.to(dt), v.to(dt), g.to(gate_dtype), b.to(gate_dtype), s0]
    return [None if x is None else x.to(device) for x in out]


def bwd_inputs(B, T, H, HV, D=128, lens=None, h0=None, vf=False, l2=True, gate="logsigmoid", dt=torch.bfloat16,
               gate_dtype=torch.float32, seed=0):
    """CPU inputs of a backward check: ``((q, k, v, g, beta), do, dht, kwargs)``; ``lens``: varlen sequence
    lengths (B = 1); ``do`` ~ N(0, 1) and ``dht`` ~ 0.1 N(0, 1) in the state layout (``vf``: value-first)."""
    N, cu = None, None
    if lens is not None:
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, b, s0 = make_inputs(B, T, H, HV, D, dt, gate=gate, h0=h0, l2=l2, N=N, state_v_first=vf,
                                    gate_dtype=gate_dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(B, T, HV, D, generator=gen).to(dt)
    dht = 0.1 * torch.randn(B if cu is None else N, HV, D, D, generator=gen)
    if vf:
        dht = dht.transpose(-1, -2).contiguous()
    kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=l2, state_v_first=vf, cu_seqlens=cu)
    return (q, k, v, g, b), do, dht, kw


def assert_segmented_matches_sequential(got, want, in_dtype, names, label=""):
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
        assert nonfinite(a) == 0, n
        tol = (torch.finfo(a.dtype).eps / 32 if a.dtype in (torch.bfloat16, torch.float16)
               else rel_rmse(b.to(in_dtype), b) / 4)
        if label:
            print(f"  {label} {n}: segmented vs sequential {rel_rmse(a, b):.2e} (bound {tol:.2e})")
        assert torch.equal(a, b) or rel_rmse(a, b) <= tol, (n, rel_rmse(a, b), tol)


def case_bwd_inputs(case, dev):
    """``(args, kw, do, dht)`` of a ``Case``'s backward call: its forward inputs (``case.inputs``, without
    ``output_final_state``), ``do`` ~ N(0, 1) in the input dtype and ``dht`` ~ 0.1 N(0, 1) fp32 from the seed
    ``case.seed + 11`` (the backward tests' inputs, on the GPU or, with the same recipe, on the CPU)."""
    args, kw = case.inputs(dev)
    kw = {k: v for k, v in kw.items() if k != "output_final_state"}     # the backward API has no such argument
    B, T, HV, V = args[2].shape
    N = B if kw["cu_seqlens"] is None else kw["cu_seqlens"].numel() - 1
    gen = torch.Generator(device=dev).manual_seed(case.seed + 11)
    do = torch.randn(B, T, HV, V, device=dev, generator=gen).to(args[0].dtype)
    dht = 0.1 * torch.randn(N, HV, V, V, device=dev, generator=gen)
    return args, kw, do, dht


def autograd_grads(fwd, xs, kw, do, dht, cast, **extra):
    """Gradients ``[dq, dk, dv, dg, dbeta] (+ [dh0])`` of ``sum(o * do) + sum(ht * dht)`` through ``fwd`` (FLA's
    call signature) on the inputs ``xs`` cast by ``cast`` (e.g. to fp64 for the reference)."""
    leaves = [cast(x).detach().requires_grad_() for x in xs]
    h0 = kw["initial_state"]
    h = None if h0 is None else cast(h0).detach().requires_grad_()
    o, ht = fwd(*leaves, **dict(kw, initial_state=h), output_final_state=True, **extra)
    (o.to(cast(do).dtype) * cast(do)).sum().add((ht * cast(dht)).sum()).backward()
    return [x.grad for x in leaves] + ([h.grad] if h is not None else [])


def reference_fn():
    """The shared fp64 reference, or the fallback recurrence below."""
    try:
        from reference.chunk import chunk_gated_delta_rule as ref
        return ref
    except ImportError:
        return fp64_recurrence


def fp64_recurrence(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None):
    """Token-by-token fp64 recurrence (fallback reference; slow, for small T)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    segs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(len(cu_seqlens) - 1)])
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(segs):
        S = torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = initial_state[n].double()
            S = S.transpose(-1, -2) if state_v_first else S
        for t in range(s, e):
            S = S * g[b, t].exp()[:, None, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    return o, (torch.stack(finals) if output_final_state else None)


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fla_triton_fn():
    """FLA's chunk_gated_delta_rule forced onto its Triton kernels (FLA_FLASH_QLA=0, FLA_TILELANG=0
    while it runs), or None when fla is not importable."""
    try:
        with _env(FLA_FLASH_QLA="0", FLA_TILELANG="0"):
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except Exception:
        return None

    def run(*args, **kwargs):
        with _env(FLA_FLASH_QLA="0", FLA_TILELANG="0"):
            return fla_fn(*args, **kwargs)

    return run


def flash_qla_fn():
    """flash_qla.chunk_gated_delta_rule, or (None, reason)."""
    try:
        import flash_qla
        return flash_qla.chunk_gated_delta_rule, None
    except Exception as e:  # pragma: no cover - depends on the GPU box
        return None, f"{type(e).__name__}: {e}"


@dataclass
class Case:
    name: str
    B: int
    T: int
    H: int
    HV: int
    D: int = 128
    dtype: torch.dtype = torch.bfloat16
    lens: list | None = None          # varlen sequence lengths (B must be 1)
    h0: float | None = None
    state_v_first: bool = False
    l2: bool = False
    gate: str = "logsigmoid"
    beta: str = "uniform"
    gate_dtype: torch.dtype = torch.float32
    cu_dtype: torch.dtype = torch.int64
    compare_fla: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def inputs(self, device):
        if self.lens is not None:
            T = sum(self.lens)
            N = len(self.lens)
            cu = torch.tensor([0] + list(torch.tensor(self.lens).cumsum(0).tolist()), dtype=self.cu_dtype,
                              device=device)
        else:
            T, N, cu = self.T, None, None
        q, k, v, g, b, s0 = make_inputs(self.B, T, self.H, self.HV, self.D, self.dtype, gate=self.gate,
                                        beta=self.beta, h0=self.h0, l2=self.l2, seed=self.seed,
                                        gate_dtype=self.gate_dtype, N=N, device=device,
                                        state_v_first=self.state_v_first)
        kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=self.l2,
                      state_v_first=self.state_v_first, cu_seqlens=cu)
        return (q, k, v, g, b), kwargs


def _short_lens(n, lo, hi, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


GPU_CASES = [
    Case("T1", 1, 1, 4, 8),
    Case("T63", 1, 63, 4, 8),
    Case("T64", 1, 64, 4, 8),
    Case("T65_h0", 1, 65, 4, 8, h0=1.0),
    Case("T1000_h0_gva2", 1, 1000, 4, 8, h0=1.0),
    Case("T8192", 1, 8192, 4, 8),
    Case("T20468_fla_case", 1, 20468, 4, 8, compare_fla=True),
    Case("B3_T1000_fp16_vfirst_h0", 3, 1000, 2, 4, dtype=torch.float16, h0=1.0, state_v_first=True),
    Case("varlen_boundaries_h0_vfirst", 1, 0, 2, 4, lens=[1, 63, 64, 65, 127, 128, 129], h0=1.0,
         state_v_first=True, cu_dtype=torch.int32),
    Case("varlen_with_empty_h0", 1, 0, 2, 4, lens=[0, 100, 0, 64, 1, 0], h0=1.0),
    Case("varlen_300_short_h0", 1, 0, 2, 4, lens=_short_lens(300, 1, 100, 3), h0=1.0, compare_fla=True),
    Case("gva4_l2norm", 1, 2048, 2, 8, l2=True, compare_fla=True),
    Case("bf16_gates", 1, 1000, 4, 8, gate_dtype=torch.bfloat16),
    Case("fp16_fp16_gates_h0", 1, 1000, 4, 8, dtype=torch.float16, gate_dtype=torch.float16, h0=1.0),
    Case("g_near_-20_h0x50", 1, 1000, 2, 4, gate="near_-20", h0=50.0),
    Case("g_zero_beta_extreme", 1, 4096, 2, 4, gate="zero", beta="extreme", compare_fla=True),
    Case("g_small_l2_h0x50", 1, 4096, 2, 4, gate="small", l2=True, h0=50.0),
    Case("D64_h0_vfirst", 2, 500, 2, 4, D=64, h0=1.0, state_v_first=True),
]


def bounds(case: Case, floor_o: float):
    """(o bound, state bound) against the fp64 reference.

    The dispatched precision splits Ag, X, U, P and the state update into two terms; the emulation's o stays
    within 2x the rounding floor rel_rmse(ref.to(dtype), ref) and its state within 5e-3 on every case
    (``test_kernels_emulation.py``), below an FLA-like bf16 scheme: bounds 2x the floor and 5e-3, plus the
    comparison with FLA Triton on the compare_fla cases."""
    return 2.0 * floor_o + 1e-6, 5e-3
