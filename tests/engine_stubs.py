"""Stand-in engine modules for the CPU tests of the engine backends: a fake ``flashinfer.gdn_prefill`` (with
``flashinfer.jit.cake_gdn``) and fake vLLM / SGLang FLA copies. Each records the arguments it was called with and
computes the answer from the fp64 reference in the engine's own layout (FlashInfer: packed tokens, linear-space
gates, state [N, HV, V, K]), so a wrong conversion gives a wrong answer (log-space g given as alpha: NaN)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

import reference


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def _reference(q, k, v, g_log, beta, scale, h0_kv, cu, l2norm):
    o, ht = reference.chunk_gated_delta_rule(q, k, v, g_log, beta, scale=scale, initial_state=h0_kv,
                                             output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    return o, ht


def install_flashinfer(monkeypatch, cp: bool = False) -> dict:
    """Inject the fake FlashInfer; returns the record of the last call ({'kwargs': .., 'kernel': ..})."""
    record: dict = {}

    class CakeGDNUnsupportedError(RuntimeError):
        pass

    def arch_for_compute_capability(major, minor):
        if (major, minor) in ((10, 0), (10, 3)):
            return f"sm_{major}{minor}a"
        raise CakeGDNUnsupportedError(f"Cake GDN supports only SM100a/SM103a, got compute capability {major}.{minor}")

    def kernel(label):
        def run(q, k, v, alpha, beta, scale, h0_vk, cu, l2norm):
            record["kernel"] = label
            h0 = None if h0_vk is None else h0_vk.transpose(-1, -2)
            o, ht = _reference(q[None], k[None], v[None], torch.log(alpha)[None], beta[None], scale, h0, cu, l2norm)
            return o[0].to(q.dtype), ht.transpose(-1, -2).to(torch.float32)
        return run

    def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto", **rest):
        record["kwargs"] = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend, **rest)
        if cu_seqlens is None:
            raise AssertionError("cu_seqlens is required for varlen mode")
        if backend == "cudnn":  # FlashInfer calls flashinfer.cudnn's function, not a module global
            fn = kernel("cudnn")
        else:
            name = {"cake_gdn": "_run_cake_gdn_prefill"}.get(backend, "cp_delta_rule_dsl_sm90" if cp
                                                              else "chunk_gated_delta_rule_sm90")
            fn = getattr(sys.modules["flashinfer.gdn_prefill"], name)  # looked up at call time, as FlashInfer does
        return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)

    prefill = _module("flashinfer.gdn_prefill", chunk_gated_delta_rule=chunk_gated_delta_rule,
                      chunk_gated_delta_rule_sm90=kernel("sm90"), cp_delta_rule_dsl_sm90=kernel("sm90-cp"),
                      _run_cake_gdn_prefill=kernel("cake"))
    cake = _module("flashinfer.jit.cake_gdn", CakeGDNUnsupportedError=CakeGDNUnsupportedError,
                   arch_for_compute_capability=arch_for_compute_capability)
    for name, mod in (("flashinfer", _module("flashinfer")), ("flashinfer.jit", _module("flashinfer.jit")),
                      ("flashinfer.jit.cake_gdn", cake), ("flashinfer.gdn_prefill", prefill),
                      ("cudnn", _module("cudnn"))):
        monkeypatch.setitem(sys.modules, name, mod)
    return record


def install_fla_copy(monkeypatch, package: str, chunk_module: str, gating_module: str, v_first: bool,
                     beta_dtype_of_b: bool) -> dict:
    """Inject a fake engine FLA copy whose ``chunk_gated_delta_rule`` documents (and uses) a V-first state when
    ``v_first``, and whose ``fused_gdn_gating`` returns beta in b's dtype when ``beta_dtype_of_b`` (SGLang) or fp32."""
    record: dict = {}

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, **rest):
        record["kwargs"] = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        assert q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32"
        h0 = initial_state
        if h0 is not None and v_first:
            h0 = h0.transpose(-1, -2)
        o, ht = _reference(q, k, v, g, beta, scale, h0, cu_seqlens, use_qk_l2norm_in_kernel)
        if v_first:
            ht = ht.transpose(-1, -2)
        return o.to(q.dtype), ht.to(torch.float32)

    chunk_gated_delta_rule.__doc__ = f"initial_state: `[N, H, {'V, K' if v_first else 'K, V'}]`"

    def fused_gdn_gating(A_log, a, b, dt_bias):
        record["gating"] = dict(A_log=A_log, a=a, b=b, dt_bias=dt_bias)
        g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
        beta = torch.sigmoid(b.float()).to(b.dtype if beta_dtype_of_b else torch.float32)
        return g[None], beta[None]

    parts = chunk_module.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), _module(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, package, _module(package))
    monkeypatch.setitem(sys.modules, chunk_module, _module(chunk_module, chunk_gated_delta_rule=chunk_gated_delta_rule))
    monkeypatch.setitem(sys.modules, gating_module, _module(gating_module, fused_gdn_gating=fused_gdn_gating))
    return record
