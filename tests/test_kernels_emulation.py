"""CPU checks of our TileLang GDN design (no GPU, no tilelang needed).

* ``kernels.forward.emulation`` replays exactly the kernels' tiling, padding, varlen chunk layout and roundings in
  torch.  On ``cases.Case`` rows (inputs ``cases.inputs``, metrics ``parity.metrics``) it must be no less accurate
  than an FLA-like bf16 scheme (``reference.emulated``) on o and on the state, within 2x the rounding floor of o.
* The segment-parallel (CP) state passing gives the same accuracy as the sequential pass (slow decay, no decay on
  half the heads, a large h0, varlen with empty sequences).
* The API's input validation raises ValueError without touching CUDA; the dispatch's plans are valid kernel
  configurations and a plan the kernels cannot run is refused by name.
* ``import kernels`` imports neither tilelang nor CUDA.
"""

import os
import subprocess
import sys

import pytest
import torch

from cases.case import Case
from kernels.forward import emulation as E
from parity.metrics import compare
from reference import chunk_gated_delta_rule as fp64_reference
from reference.emulated import chunk_gated_delta_rule as fla_like
from tests.kernel_support import call_args, past_fp16_range_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CASES = [
    Case(T=200, H=2, HV=4, K=64, V=64, dist="raw-qk-l2"),
    Case(B=2, T=130, H=2, HV=4, dtype="fp16", h0_dtype="fp32", dist="raw-qk-l2"),
    Case(T=1, H=1, HV=1, K=64, V=64),
    Case(T=64, H=2, HV=2, K=64, V=64, g_dtype="bf16", beta_dtype="bf16", dist="raw-qk-l2"),
    Case(layout="varlen-boundary", T=577, H=1, HV=2, K=64, V=64, h0_dtype="fp32", state_v_first=True,
         dist="raw-qk-l2"),
    Case(layout="varlen-short", T=1024, H=1, HV=2, K=64, V=64),
    Case(layout="varlen-empty", T=165, H=1, HV=2, K=64, V=64, h0_dtype="fp32", dist="raw-qk-l2"),
    Case(T=300, H=2, HV=2, K=64, V=64, dist="mixed-heads"),
    Case(T=150, H=2, HV=2, K=64, V=64, h0_dtype="fp32", dist="strong-decay"),
    Case(T=150, H=2, HV=2, K=64, V=64, h0_dtype="fp32", dist="large-h0"),
    Case(T=200, H=1, HV=2, K=64, V=64, dtype="fp16", dist="beta-edges"),
]


def _errors(out, ref):
    """rel_rmse of (o, final state) against the fp64 reference's."""
    return tuple(compare(x, r).rel_rmse for x, r in zip(out, ref))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_emulation_default_vs_fp64_reference(case):
    """The dispatched plan's emulation: finite, o <= 2x the rounding floor, state <= 5e-3, and no worse than an
    FLA-like bf16 scheme (reference.emulated) on the same inputs (5% slack on tiny cases)."""
    a, kw = call_args(case)
    kw["output_final_state"] = True
    o, S = E.chunk_gated_delta_rule(*a, **kw)
    o_ref, S_ref = fp64_reference(*a, **kw)
    assert o.dtype == a[0].dtype and o.shape == o_ref.shape
    assert S.dtype == torch.float32 and S.shape == S_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    floor = compare(o_ref.to(o.dtype), o_ref).rel_rmse
    e_o, e_s = _errors((o, S), (o_ref, S_ref))
    f_o, f_s = _errors(fla_like(*a, **kw), (o_ref, S_ref))
    msg = f"{case.id}: o {e_o:.3e} (floor {floor:.3e})  state {e_s:.3e} | fla-like o {f_o:.3e} state {f_s:.3e}"
    print(msg)
    assert e_o <= 1.05 * f_o + 1e-6, msg
    assert e_s <= 1.05 * f_s + 1e-7, msg
    assert e_o <= 2.0 * floor + 1e-6, msg
    assert e_s <= 5e-3, msg


def test_emulation_beats_fla_like_precision_scheme():
    """At T=2048 (no in-kernel l2 norm, like the harness's default case) the emulated kernel is much closer to fp64
    than an emulation of FLA's bf16 intermediates (reference.emulated)."""
    a, kw = call_args(Case(T=2048, H=2, HV=4))
    kw["output_final_state"] = True
    ref = fp64_reference(*a, **kw)
    e_o, e_s = _errors(E.chunk_gated_delta_rule(*a, **kw), ref)
    f_o, f_s = _errors(fla_like(*a, **kw), ref)
    print(f"ours o {e_o:.3e} S {e_s:.3e} | fla-like o {f_o:.3e} S {f_s:.3e}")
    assert e_o < 0.8 * f_o
    assert e_s < f_s


def _bad(**over):
    B, T, H, HV, D = 1, 8, 2, 4, 64
    x = dict(q=torch.zeros(B, T, H, D, dtype=torch.bfloat16), k=torch.zeros(B, T, H, D, dtype=torch.bfloat16),
             v=torch.zeros(B, T, HV, D, dtype=torch.bfloat16), g=torch.zeros(B, T, HV), beta=torch.zeros(B, T, HV))
    x.update(over)
    return x


@pytest.mark.parametrize("over,needle", [
    (dict(v=torch.zeros(1, 8, 3, 64, dtype=torch.bfloat16), g=torch.zeros(1, 8, 3), beta=torch.zeros(1, 8, 3)),
     "HV % H"),
    (dict(q=torch.zeros(1, 8, 2, 64)), "dtype"),
    (dict(k=torch.zeros(1, 8, 2, 64, dtype=torch.float16)), "dtype"),
    (dict(g=torch.zeros(1, 8, 5)), "g must be"),
    (dict(beta=torch.zeros(1, 8, 4, dtype=torch.float16)), "beta dtype"),
    (dict(k=torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)), "same shape"),
    (dict(v=torch.zeros(1, 7, 4, 64, dtype=torch.bfloat16)), "v must be"),
    (dict(q=torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16), k=torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16),
          v=torch.zeros(1, 8, 4, 32, dtype=torch.bfloat16)), "head dims"),
    (dict(q=torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16), k=torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16),
          v=torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16), g=torch.zeros(2, 8, 4), beta=torch.zeros(2, 8, 4),
          cu_seqlens=torch.tensor([0, 8])), "batch size must be 1"),
    (dict(initial_state=torch.zeros(2, 4, 64, 64)), "initial_state"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens dtype"),
    (dict(), "CUDA"),
])
def test_api_rejects_bad_input(over, needle):
    from kernels.forward.pipeline import chunk_gated_delta_rule
    with pytest.raises(ValueError, match=needle):
        chunk_gated_delta_rule(**_bad(**over))


def test_forward_dispatch_picks_the_measured_forms():
    """``forward_plan``: the fused ws kernel where blocks of 32 or more value columns fill the SMs at K = 128 (BV 64
    at B8 HV32, 32 at B1 HV32), per CP segment (BV 64) where they would leave most SMs idle over long sequences,
    the smem state kernel for short ones (BV 16) and at K = 64 (two CTAs per SM where BV 32 gives two); at K = 64
    the rv form with CP for few heads over long sequences; the chunk-start state split (fp16 operands are not
    dispatched); the intra kernel keeps Tinv only when asked."""
    from kernels.plan import block_v, forward_plan
    assert block_v(1, 32, occ=2) == 16 and block_v(8, 32, occ=2) == 32 and block_v(1, 32) == 32
    p = forward_plan("bfloat16", 8, 32, 64)
    assert (p.state_form, p.block_v, p.ctas_per_sm, p.cp) == ("ws", 64, 1, 1) and len(p.configs()) == 2
    p = forward_plan("bfloat16", 1, 32, 512)
    assert (p.state_form, p.block_v, p.ctas_per_sm, p.precision.s) == ("ws", 32, 1, "split")
    p = forward_plan("bfloat16", 1, 8, 512)
    assert (p.state_form, p.block_v, p.ctas_per_sm, p.cp, p.p_table) == ("ws", 64, 1, 8, True)
    assert [c.name.split("[")[0] for c in p.configs()] == ["intra", "state_ws", "scan_rv", "cp_fixup"]
    p = forward_plan("bfloat16", 1, 8, 16)
    assert (p.state_form, p.block_v, p.ctas_per_sm, p.cp) == ("smem", 16, 1, 1)
    p = forward_plan("bfloat16", 8, 32, 64, DK=64)
    assert (p.state_form, p.block_v, p.ctas_per_sm) == ("smem", 32, 2) and "occ2" in p.configs()[1].name
    p = forward_plan("float16", 1, 4, 1024, keep_tables=True)
    assert (p.state_form, p.cp, p.keep_tables) == ("ws", 16, True) and len(p.configs()) == 4
    assert p.configs()[0].th and not forward_plan("float16", 1, 4, 1024).configs()[0].th
    p = forward_plan("float16", 1, 4, 1024, DK=64)
    assert (p.state_form, p.cp) == ("rv", 16) and len(p.configs()) == 5


def test_a_plan_the_kernels_cannot_run_is_refused():
    """Two smem CTAs per SM need BV <= 32, the rv form BV 64 or 128, CP the rv or ws form (not with fp16 operands),
    the ws form one CTA per SM, warm-up starts the ws form per CP segment, split heads warm-up starts: a plan outside
    that raises a ValueError
    naming it, before any kernel is built."""
    import dataclasses

    from kernels.forward.precision import PRESETS, preset
    from kernels.plan import forward_plan
    p = dataclasses.replace(forward_plan("bfloat16", 8, 32, 64), state_form="smem", block_v=32, ctas_per_sm=2,
                            p_table=False, precision=preset())
    for bad, needle in ((dict(block_v=64), "BV <= 32"), (dict(cp=2), "cp 1"), (dict(state_form="x"), "unknown"),
                        (dict(state_form="rv"), "rv state kernel"),
                        (dict(state_form="ws", block_v=32, ctas_per_sm=2), "warp-specialised"),
                        (dict(state_form="ws", block_v=32, ctas_per_sm=1, cp=0), "cp counts segments"),
                        (dict(state_form="ws", block_v=32, ctas_per_sm=1, cp=2, p_table=True,
                              precision=PRESETS["half"]), "per sequence"),
                        (dict(state_form="ws", block_v=32, ctas_per_sm=1, cp=1, warm=True), "warm-up starts"),
                        (dict(warm=True), "warm-up starts"),
                        (dict(state_form="ws", block_v=32, ctas_per_sm=1, cp=17, warm=True), "cp <= 16"),
                        (dict(state_form="ws", block_v=64, ctas_per_sm=1, cp=2, split_heads=True), "split_heads")):
        with pytest.raises(ValueError, match=needle):
            dataclasses.replace(p, **bad)
    assert dataclasses.replace(p, state_form="ws", block_v=32, ctas_per_sm=1, cp=2).cp == 2


def test_fp16_operands_are_all_or_none_and_need_the_ws_form():
    """``Precision`` refuses an unknown value and fp16 on some operands alone (a product's operands share a type);
    a plan refuses fp16 operands outside the ws form, whose WG1 keeps the value columns' scales (and forms P
    from the fp16 copies without P tables)."""
    import dataclasses

    from kernels.forward.precision import PRESETS, Precision
    from kernels.plan import forward_plan
    with pytest.raises(ValueError, match="fp16 operands are all, p and u alone"):
        dataclasses.replace(PRESETS["half"], ks="split")
    with pytest.raises(ValueError, match="must be one of"):
        Precision(merge="fp16")
    ws = forward_plan("bfloat16", 8, 32, 64)
    assert (ws.state_form, ws.p_table) == ("ws", True)
    half = dataclasses.replace(ws, precision=PRESETS["half"])
    assert half.configs()[1].name.startswith("state_ws[DK=DV=128,BV=64,fp16,")
    assert half.configs()[0].ag == "fp16" and PRESETS["half"].operand_dtype("bfloat16") == "float16"
    no_pt = dataclasses.replace(half, p_table=False)
    assert not no_pt.configs()[0].pt and not no_pt.configs()[1].pt
    for bad in (dict(state_form="smem", p_table=False), dict(state_form="rv", block_v=64, p_table=False)):
        with pytest.raises(ValueError, match="fp16 operands"):
            dataclasses.replace(half, **bad)


@pytest.mark.parametrize("dist", ["gauss-l2", "qwen-gates", "slow-decay", "strong-decay", "large-h0"])
def test_fp16_operands_meet_the_accuracy_bar(dist):
    """Every operand one fp16 term (precision "half"), T=2048, H=2, HV=4, bf16: o within 1.1x its rounding floor and
    the final state at least 5x closer to fp64 than the FLA-like bf16 scheme; farther than the dispatched precision
    (whose S, X, U and P are split), so the fp16 roundings are in effect."""
    from cases.distributions import get_distribution
    from kernels.forward.precision import PRESETS

    h0 = "fp32" if get_distribution(dist).needs_h0 else None
    a, kw = call_args(Case(T=2048, H=2, HV=4, dist=dist, h0_dtype=h0))
    kw["output_final_state"] = True
    o_ref, S_ref = fp64_reference(*a, **kw)
    floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
    half = _errors(E.chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS["half"]), (o_ref, S_ref))
    dflt = _errors(E.chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS["default"]), (o_ref, S_ref))
    fla = _errors(fla_like(*a, **kw), (o_ref, S_ref))
    msg = (f"{dist}: half o {half[0] / floor:.3f}x floor, state {half[1]:.2e} | default state {dflt[1]:.2e} | "
           f"fla-like state {fla[1]:.2e}")
    print(msg)
    assert half[0] <= 1.1 * floor, msg
    assert 5 * half[1] <= fla[1], msg
    assert half[1] > 10 * dflt[1], msg


def test_fp16_operands_hold_inputs_past_fp16_range():
    """q and k at 2^17 (normalised in the kernel), v and h0 at 2^15, bf16 (q, k, v past fp16's 65504; the state
    with them): the fp16-operand forward stays finite and within the accuracy bar (o <= 1.1x its floor, the final
    state >= 5x closer to fp64 than the FLA-like scheme), its q / k row scales and value-column scales keeping
    every operand in range."""
    from kernels.forward.precision import PRESETS

    a, kw = past_fp16_range_args(512)
    assert not torch.isfinite(a[0].to(torch.float16)).all() and not torch.isfinite(a[2].to(torch.float16)).all()
    o_ref, S_ref = fp64_reference(*a, **kw)
    floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
    o, S = E.chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS["half"])
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    e_o, e_s = _errors((o, S), (o_ref, S_ref))
    f_s = _errors(fla_like(*a, **kw), (o_ref, S_ref))[1]
    msg = f"half o {e_o / floor:.3f}x floor, state {e_s:.2e} | fla-like state {f_s:.2e}"
    print(msg)
    assert e_o <= 1.1 * floor and 5 * e_s <= f_s, msg


@pytest.mark.parametrize("dist", ["gauss-l2", "qwen-gates", "slow-decay", "strong-decay", "large-h0"])
def test_pu16_keeps_the_state_and_o_near_its_floor(dist):
    """P @ U as one fp16 product (``Precision.pu16``), bf16, T=1024: the final state bitwise the dispatched
    precision's (the chain is not touched), o changed but within 1.02x its rounding floor."""
    from cases.distributions import get_distribution
    from kernels.forward.precision import PRESETS

    h0 = "fp32" if get_distribution(dist).needs_h0 else None
    a, kw = call_args(Case(T=1024, H=2, HV=4, dist=dist, h0_dtype=h0))
    kw["output_final_state"] = True
    o_ref, _ = fp64_reference(*a, **kw)
    floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
    o, S = E.chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS["pu16"])
    o_d, S_d = E.chunk_gated_delta_rule_at(*a, **kw, prec=PRESETS["default"])
    e_o = compare(o, o_ref).rel_rmse
    assert torch.equal(S, S_d) and not torch.equal(o, o_d)
    assert e_o <= 1.02 * floor, f"{dist}: pu16 o {e_o / floor:.4f}x floor"


def test_pu16_holds_p_and_u_past_fp16_range():
    """Inputs past fp16's range (``past_fp16_range_args``): P's tile and U's column scales keep the fp16 product
    finite, o within 1.02x its floor, the state bitwise the dispatched precision's."""
    from kernels.forward.precision import PRESETS

    (q, k, v, g, beta), kw = call_args(Case(T=512, H=2, HV=4, dist="gauss-l2"))
    kw["output_final_state"] = True
    big_p = ((q.float() * 2.0 ** 24).to(q.dtype), k, v, g, beta)        # scale q_t . k_j past 65504: P's tiles
    qk = torch.einsum("bthd,bshd->bhts", big_p[0].double(), k.double())
    assert not kw["use_qk_l2norm_in_kernel"] and q.shape[-1] ** -0.5 * qk.abs().max() > 65504
    for a, kwa in ((big_p, kw), past_fp16_range_args(512)):            # v and h0 at 2^15: U's columns
        o_ref, _ = fp64_reference(*a, **kwa)
        floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
        o, S = E.chunk_gated_delta_rule_at(*a, **kwa, prec=PRESETS["pu16"])
        S_d = E.chunk_gated_delta_rule_at(*a, **kwa, prec=PRESETS["default"])[1]
        assert torch.isfinite(o).all() and torch.equal(S, S_d)
        assert compare(o, o_ref).rel_rmse <= 1.02 * floor, compare(o, o_ref).rel_rmse / floor


def test_pu16_is_the_emulations_alone():
    """``Precision.pu16``: p and u alone fp16 is a valid precision (its tag says so), any other partial fp16 set is
    not, and no forward plan takes it (no kernel computes it)."""
    import dataclasses

    from kernels.forward.precision import PRESETS, Precision
    from kernels.plan import forward_plan
    pu = PRESETS["pu16"]
    assert pu.pu16 and not pu.half and pu.tag().endswith("pu16") and not PRESETS["half"].pu16
    for bad in (dict(p="fp16"), dict(u="fp16"), dict(p="fp16", u="fp16", s="fp16")):
        with pytest.raises(ValueError, match="fp16 operands are all"):
            Precision(**bad)
    with pytest.raises(ValueError, match="no kernel"):
        dataclasses.replace(forward_plan("bfloat16", 8, 32, 64), precision=pu)


def test_import_is_lazy():
    code = ("import sys; import kernels, kernels.forward.pipeline, kernels.backward.pipeline, kernels.autograd, "
            "kernels.plan, kernels.build, kernels.interface; kernels.build.all_configs(); "
            "assert 'tilelang' not in sys.modules, 'tilelang imported'; "
            "import torch; assert not torch.cuda.is_initialized(), 'cuda initialised'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("dist", ["gauss-l2", "strong-decay", "beta-edges", "heavy-tail-v", "large-h0"])
def test_emulation_beats_fla_like_on_distributions(dist):
    """``cases`` rows at T=1024 (H=2, HV=4, bf16): the dispatched precision is no worse than the FLA-like bf16
    scheme on o and on the state."""
    from cases.distributions import get_distribution

    h0 = "fp32" if get_distribution(dist).needs_h0 else None
    a, kw = call_args(Case(B=1, T=1024, H=2, HV=4, dist=dist, h0_dtype=h0, seed=0))
    kw["output_final_state"] = True
    ref = fp64_reference(*a, **kw)
    e = _errors(E.chunk_gated_delta_rule(*a, **kw), ref)
    f = _errors(fla_like(*a, **kw), ref)
    print(f"{dist}: ours o {e[0]:.3e} state {e[1]:.3e} | fla-like o {f[0]:.3e} state {f[1]:.3e}")
    assert e[0] <= f[0] and e[1] <= f[1]


_SLOW = ("slow-decay", "mixed-heads", "qwen-gates")


def _slow_decay_errors(dist, **variants) -> dict:
    """{name: (o rel_rmse / its rounding floor, final-state rel_rmse)} against the fp64 reference of the emulation at
    the dispatched precision with each variant's fields replaced, on T=2048, H=4, HV=8 of ``dist``, no initial
    state."""
    import dataclasses

    from kernels.forward.precision import preset

    a, kw = call_args(Case(T=2048, H=4, HV=8, dist=dist))
    kw["output_final_state"] = True
    o_ref, S_ref = fp64_reference(*a, **kw)
    floor = compare(o_ref.to(a[0].dtype), o_ref).rel_rmse
    out = {}
    for name, fields in variants.items():
        o, S = E.chunk_gated_delta_rule_at(*a, **kw, prec=dataclasses.replace(preset(), **fields))
        out[name] = (compare(o, o_ref).rel_rmse / floor, compare(S, S_ref).rel_rmse)
    return out


@pytest.mark.parametrize("dist", _SLOW)
def test_dispatched_precision_keeps_o_near_its_floor_under_slow_decays(dist):
    """Where the state carries across many chunks (T=2048, H=4, HV=8, no initial state), the dispatched precision
    (S split in K S and Q S) keeps o within 1.1x its rounding floor; S one term in both (the precision before
    d09c518, its other fields as dispatched) does not."""
    e = _slow_decay_errors(dist, split={}, one=dict(s="bf16", ks="bf16"))
    ratio = {k: v[0] for k, v in e.items()}
    print(f"{dist}: o / floor, S split {ratio['split']:.3f}, S one term {ratio['one']:.3f}")
    assert ratio["split"] <= 1.1, ratio
    assert ratio["one"] > 1.1, ratio


@pytest.mark.parametrize("dist", _SLOW[:2])
def test_fp32_merges_take_the_final_state_near_fp32(dist):
    """With S split, one-term block merges (the benchmark's ``m1``) are what is left of the final state's error
    under slow decays: split ones (``msplit``) take it >= 20x closer to fp64, and fp32 ones (``merge="fp32"``, the
    dispatch's) at least as close as split ones."""
    e = {k: v[1] for k, v in _slow_decay_errors(dist, bf16=dict(merge="bf16"), split=dict(merge="split"),
                                                   fp32=dict(merge="fp32")).items()}
    print(f"{dist}: final state rel_rmse, merges single {e['bf16']:.2e}, split {e['split']:.2e}, fp32 {e['fp32']:.2e}")
    assert e["split"] * 20 <= e["bf16"], e
    assert e["fp32"] <= e["split"], e


def _rv_plan(h0, cp):
    from kernels.forward.precision import preset
    from kernels.plan import ForwardPlan
    return ForwardPlan("bfloat16", preset(), "rv", 64, 1, cp)


@pytest.mark.parametrize("case,cp", [
    (Case(T=1300, H=1, HV=2, h0_dtype="fp32", dist="slow-decay"), 4),      # the carried state matters across segments
    (Case(T=1300, H=1, HV=2, h0_dtype="fp32", dist="mixed-heads"), 3),     # no decay at all on half the heads
    (Case(T=1300, H=1, HV=2, h0_dtype="fp32", dist="large-h0"), 3),        # a large initial state
    (Case(layout="varlen-empty", T=1795, H=1, HV=2, h0_dtype="fp32", dist="slow-decay"), 3),   # uneven segment
], ids=lambda x: x.id if isinstance(x, Case) else f"cp{x}")                                       # counts, empty seqs
def test_cp_matches_sequential(case, cp):
    """Segment-parallel state passing (scan of [Z | M], fp64 fix-up, per-segment pass) has the same
    accuracy as the sequential pass."""
    a, kw = call_args(case)
    kw["output_final_state"] = True
    ref = fp64_reference(*a, **kw)
    o1, S1 = E.chunk_gated_delta_rule(*a, **kw, plan=_rv_plan(kw["initial_state"], 1))
    oc, Sc = E.chunk_gated_delta_rule(*a, **kw, plan=_rv_plan(kw["initial_state"], cp))
    e1, ec = _errors((o1, S1), ref), _errors((oc, Sc), ref)
    print(f"{case.id}: cp1 o {e1[0]:.3e} S {e1[1]:.3e} | cp{cp} o {ec[0]:.3e} S {ec[1]:.3e}")
    assert torch.isfinite(oc).all() and torch.isfinite(Sc).all()
    assert ec[0] <= 1.1 * e1[0] + 1e-6 and ec[1] <= 1.2 * e1[1] + 1e-6


def test_varlen_tables_take_the_host_list_so_a_call_syncs_once():
    """The forward and backward APIs copy cu_seqlens to the host once and hand the list on: tables built from it
    equal those built from the tensor, and the tensor is not read again."""
    from kernels.interface import host_list as _host_list
    from kernels.interface import seq_tables as _seq_tables

    class NoHostCopy(torch.Tensor):
        def tolist(self):
            raise AssertionError("cu_seqlens copied to the host a second time")

    cu = torch.tensor([0, 1, 64, 64, 193], dtype=torch.int32)
    want = _seq_tables(1, 193, cu, torch.device("cpu"))
    got = _seq_tables(1, 193, cu.as_subclass(NoHostCopy), torch.device("cpu"), _host_list(cu))
    assert want[3] == got[3] == 1 + 1 + 0 + 3
    for a, b in zip(want[:3] + want[4:], got[:3] + got[4:]):
        assert torch.equal(a, b.as_subclass(torch.Tensor))


def test_seq_order_issues_the_longest_sequences_first():
    """``seq_order`` (the fused backward's CTA order): sequences by decreasing chunk count, ties (and empty
    sequences) in index order; dense input keeps the index order."""
    from kernels.interface import longest_first
    from kernels.interface import seq_tables as _seq_tables

    cpu = torch.device("cpu")
    # chunks: 1, 1, 0, 3, 2, 3
    cu = torch.tensor([0, 1, 64, 64, 193, 300, 429], dtype=torch.int32)
    assert _seq_tables(1, 429, cu, cpu)[4].tolist() == [3, 5, 4, 0, 1, 2]
    assert longest_first([16, 110, 40, 94, 5, 141, 63, 47]) == [5, 1, 3, 6, 7, 2, 0, 4]
    assert longest_first([]) == []
    order = _seq_tables(3, 100, None, cpu)[4]
    assert order.dtype == torch.int32 and order.tolist() == [0, 1, 2]


def test_host_cache_keeps_none_and_empties_itself_past_its_bound():
    """``interface.cached``: a value is made once per key, None included (the backward's "no segment plan"); a
    table past ``CACHE_ENTRIES`` entries is emptied before the next new key goes in."""
    from kernels.interface import CACHE_ENTRIES, cached

    made = []

    def make(v):
        return lambda: made.append(v) or v
    table: dict = {}
    assert cached(table, "a", make(None)) is None and cached(table, "a", make(1)) is None and made == [None]
    for i in range(CACHE_ENTRIES):
        cached(table, i, make(i))
    assert len(table) == CACHE_ENTRIES + 1 and cached(table, 3, make(-1)) == 3
    assert cached(table, "new", make(7)) == 7 and table == {"new": 7}


def test_varlen_tables_are_reused_for_the_same_unmodified_cu_seqlens():
    """A model calls the kernel once per layer with one cu_seqlens tensor: the second call with that tensor copies
    nothing to the host; an in-place change, another tensor, another T or device rebuilds the tables."""
    from kernels.interface import call_tables as _call_tables
    from kernels.interface import seq_tables as _seq_tables

    copies = []

    class Counting(torch.Tensor):
        def tolist(self):
            copies.append(1)
            return super().tolist()

    dev = torch.device("cpu")
    cu = torch.tensor([0, 1, 64, 64, 193], dtype=torch.int32).as_subclass(Counting)
    first = _call_tables(1, 193, cu, dev)
    again = _call_tables(1, 193, cu, dev)
    assert len(copies) == 1 and again is first
    assert first[0] == [0, 1, 64, 64, 193] and first[1][3] == 5
    for a, b in zip(first[1][:3], _seq_tables(1, 193, cu.as_subclass(torch.Tensor), dev)[:3]):
        assert torch.equal(a, b)

    cu[2] = 32                                    # in place: the version counter moves, the tables follow
    changed = _call_tables(1, 193, cu, dev)
    assert len(copies) == 2 and changed[0] == [0, 1, 32, 64, 193] and changed[1][3] == 1 + 1 + 1 + 3
    other = torch.tensor([0, 193], dtype=torch.int32).as_subclass(Counting)
    assert _call_tables(1, 193, other, dev)[1][3] == 4 and len(copies) == 3
    with pytest.raises(ValueError, match="end at most at T=150"):    # same tensor, another T: rebuilt, checked
        _call_tables(1, 150, other, dev)


def test_varlen_tables_of_an_inference_tensor_follow_in_place_changes():
    """Engines build cu_seqlens under torch.inference_mode(): such a tensor has no version counter, so its tables
    are built from its current values on every call, in and outside inference mode."""
    from kernels.interface import call_tables as _call_tables

    dev = torch.device("cpu")
    with torch.inference_mode():
        cu = torch.tensor([0, 1, 64, 64, 193], dtype=torch.int32)
    assert _call_tables(1, 193, cu, dev)[0] == [0, 1, 64, 64, 193]
    with torch.inference_mode():
        first = _call_tables(1, 193, cu, dev)
        cu[2] = 32
        changed = _call_tables(1, 193, cu, dev)
    assert first[0] == [0, 1, 64, 64, 193] and first[1][3] == 5
    assert changed[0] == [0, 1, 32, 64, 193] and changed[1][3] == 1 + 1 + 1 + 3
