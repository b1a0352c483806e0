"""``flashinfer``: ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` (flashinfer-python 0.7.x) called the way vLLM
(``fi_chunk_gated_delta_rule`` in vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py) and SGLang
(``FlashInferGDNKernel.extend`` in sglang/srt/layers/attention/linear/kernels/gdn_flashinfer.py) call it:

- q/k/v packed to ``[B*T, H, K]`` / ``[B*T, HV, V]`` with ``cu_seqlens`` (int64); a dense batch becomes B sequences
  of T tokens (``cu_seqlens = [0, T, 2T, ...]``);
- the gate as alpha = exp(g) in fp32 (FlashInfer takes linear-space gates; log-space g gives NaN, flashinfer #2490);
- beta in fp32 ``[B*T, HV]``;
- an fp32 state in FlashInfer's ``[N, HV, V, K]`` layout: ours (``[N, HV, K, V]``) is transposed in and the final
  state transposed back (a V-first case passes through);
- where the case asks for the in-kernel Q/K L2 norm, Q and K are normalised before the call in fp32 and rounded to
  their dtype, as both engines' ``l2norm_fwd`` does, and FlashInfer gets ``use_qk_l2norm_in_kernel=False``;
- ``scale`` as the case has it (the engines pass none: FlashInfer's default 1/sqrt(K), the cases' too).

``impl`` names the FlashInfer kernel that ran: FlashInfer wraps its arch kernels as module globals of
``flashinfer.gdn_prefill`` and picks them at call time; the adapter wraps those globals for the call. With
``use_cp="auto"`` FlashInfer takes its context-parallel form (``cp_delta_rule_dsl_sm*``) when the non-CP parallelism,
sequences x value heads, is below a per-card fraction of the SM count (``should_use_cp_host``), and falls back to
the plain kernel with a RuntimeWarning when the CP kernel rejects the inputs; both show in ``impl``.
Forward only; fp16/bf16 q/k/v with K = V = 128.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings

import torch

from cases.case import Case
from cases.distributions import get_distribution
from parity.backends.base import Backend, cuda_capability, unpadded
from reference.prepare import l2norm

MODULE = "flashinfer.gdn_prefill"
ARCHS = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}  # gdn_prefill dispatches on majors 9, 10 and 12
# flashinfer.gdn_prefill globals the public call dispatches to, and what each one is
KERNELS = {
    "chunk_gated_delta_rule_sm90": "cute-dsl sm90",
    "chunk_gated_delta_rule_sm100": "cute-dsl sm100",
    "chunk_gated_delta_rule_sm120": "cute-dsl sm120",
    "cp_delta_rule_dsl_sm90": "cute-dsl sm90 context-parallel",
    "cp_delta_rule_dsl_sm100": "cute-dsl sm100 context-parallel",
    "cp_delta_rule_dsl_sm120": "cute-dsl sm120 context-parallel",
    "_chunk_gated_delta_rule_gdn_cp_sm100": "gdn-cp sm100 context-parallel",
    "_run_cake_gdn_prefill": "cake_gdn",
}
CONVERSION = ("packed [B*T, H, K] + cu_seqlens int64 (dense -> B sequences); g -> alpha = exp(g) fp32; beta -> fp32; "
              "h0 -> fp32 [N, HV, V, K] (transposed in, final state transposed back); in-kernel Q/K L2 norm done "
              "before the call in fp32 (as the engines' l2norm_fwd)")


def to_flashinfer(inputs) -> dict:
    """The call's keyword arguments, converted as the engines convert them (see the module docstring)."""
    B, T, H, K = inputs.q.shape
    HV = inputs.v.shape[2]
    cu = inputs.cu_seqlens
    if cu is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=inputs.q.device)
    h0 = inputs.initial_state
    if h0 is not None:
        h0 = h0.to(torch.float32)
        h0 = (h0 if inputs.state_v_first else h0.transpose(-1, -2)).contiguous()
    q, k = inputs.q, inputs.k
    if inputs.use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
    return dict(
        q=q.reshape(B * T, H, K).contiguous(), k=k.reshape(B * T, H, K).contiguous(),
        v=inputs.v.reshape(B * T, HV, -1).contiguous(),
        g=torch.exp(inputs.g.to(torch.float32)).reshape(B * T, HV).contiguous(),
        beta=inputs.beta.to(torch.float32).reshape(B * T, HV).contiguous(),
        scale=inputs.scale, initial_state=h0, output_final_state=True, cu_seqlens=cu.to(torch.int64),
        use_qk_l2norm_in_kernel=False)


def from_flashinfer(inputs, o: torch.Tensor, ht: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o [B*T, HV, V] -> [B, T, HV, V]; the final state [N, HV, V, K] -> ours (V-first cases keep it)."""
    B, T = inputs.q.shape[:2]
    o = o.reshape(B, T, *o.shape[1:])
    if ht is not None and not inputs.state_v_first:
        ht = ht.transpose(-1, -2)
    return o, ht


@contextlib.contextmanager
def trace_kernels(module):
    """Yield a list that collects the names (``KERNELS`` values) of the module's kernel globals called inside, and
    any fallback warning FlashInfer raised; the globals are restored after."""
    calls: list[str] = []
    saved = {}
    for name, label in KERNELS.items():
        fn = getattr(module, name, None)
        if fn is None:
            continue

        def traced(*args, _fn=fn, _label=label, **kwargs):
            calls.append(_label)
            return _fn(*args, **kwargs)

        saved[name] = fn
        setattr(module, name, traced)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield calls
        calls.extend(f"warning: {w.message}" for w in caught if "fall" in str(w.message).lower())
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def describe(calls: list[str], prefix: str = "flashinfer", untraced: str = "unknown kernel") -> str:
    """'flashinfer/<kernel>' (several joined with '+'; ``untraced`` when none was seen), with any fallback warning in
    parentheses."""
    kernels = [c for c in calls if not c.startswith("warning: ")]
    notes = [c[len("warning: "):] for c in calls if c.startswith("warning: ")]
    text = f"{prefix}/{'+'.join(dict.fromkeys(kernels)) or untraced}"
    return text + (f" ({'; '.join(notes)})" if notes else "")


class FlashInfer(Backend):
    name = "flashinfer"
    description = "FlashInfer gdn_prefill.chunk_gated_delta_rule (CuTe-DSL), called as vLLM and SGLang call it"
    conversion = CONVERSION
    needs_gpu = True
    packages = ("flashinfer-python", "nvidia-cutlass-dsl", "apache-tvm-ffi")
    call_backend: str | None = None  # the ``backend=`` argument; None: FlashInfer's default ("auto")
    untraced = "unknown kernel"  # the impl when none of the traced kernel globals ran

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("flashinfer") is None:
            return False, "package flashinfer-python is not installed"
        cap = cuda_capability()
        if cap is None:
            return False, "no CUDA GPU (FlashInfer's GDN prefill runs on SM90, SM100/103 and SM120)"
        return True, ""

    def supports(self, case: Case, device: torch.device) -> tuple[bool, str]:
        if case.dtype not in ("bf16", "fp16"):
            return False, f"FlashInfer's GDN prefill takes fp16/bf16 q/k/v, got {case.dtype}"
        if case.K != 128 or case.V != 128:
            return False, f"FlashInfer's GDN prefill needs K=V=128 (one head_size), got K={case.K}, V={case.V}"
        if get_distribution(case.dist).gate_in_kernel:
            return False, "FlashInfer takes computed gates (alpha, beta): no in-kernel gate or beta sigmoid"
        ok, why = unpadded(case, "FlashInfer's API")
        if not ok:
            return ok, why
        cap = cuda_capability()
        if cap is not None and cap not in ARCHS:
            return False, f"GPU is sm_{cap[0]}{cap[1]}; FlashInfer's GDN prefill runs on SM90, SM100/103 and SM120"
        return self.arch_supports(cap) if cap is not None else (True, "")

    def arch_supports(self, cap) -> tuple[bool, str]:
        """Whether the chosen FlashInfer path runs on compute capability ``cap``; asked without running it."""
        return True, ""

    def _call(self, fn, kwargs: dict):
        if self.call_backend is not None:
            kwargs = {**kwargs, "backend": self.call_backend}
        return fn(**kwargs)

    def prepared_call(self, inputs):
        """A no-argument callable that runs only the FlashInfer call, on ``inputs`` converted once (for timing)."""
        import importlib

        module = importlib.import_module(MODULE)
        kwargs = to_flashinfer(inputs)
        return lambda: self._call(module.chunk_gated_delta_rule, kwargs)

    def _forward(self, inputs):
        import importlib

        module = importlib.import_module(MODULE)
        with trace_kernels(module) as calls:
            o, ht = self._call(module.chunk_gated_delta_rule, to_flashinfer(inputs))
        o, ht = from_flashinfer(inputs, o, ht)
        prefix = "flashinfer" if self.call_backend is None else f"flashinfer[{self.call_backend}]"
        return o, ht, describe(calls, prefix, self.untraced)
