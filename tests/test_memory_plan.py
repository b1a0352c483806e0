"""``benchmarks/memory_plan.py``: its accounting of one forward + backward on the CPU (no-op kernels), checked
against itself (the peak is the sum of what it lists alive there) and against the CPU allocator's own events
(``torch.profiler``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks import memory_plan as mp

# (B, T, H, HV, varlen lengths): dense GVA 2, varlen with a partial chunk, GVA 3 (the group-sum kernel)
SHAPES = {"dense": (1, 256, 2, 4, None), "varlen": (1, 300, 2, 4, [100, 200]), "gva3": (2, 128, 1, 3, None)}


@pytest.fixture(scope="module", params=list(SHAPES))
def traced(request):
    return mp.plan(SHAPES[request.param], check=True)


def test_peak_is_the_sum_of_the_tensors_alive_there(traced):
    t = traced.trace
    assert t.peak > 0 and t.peak == sum(a.nbytes for a in t.peak_alive)
    assert len({a.id for a in t.peak_alive}) == len(t.peak_alive)


def test_peak_equals_the_cpu_allocators(traced):
    """Every allocation of the call is seen (no view of an input counted, no temporary missed)."""
    assert traced.profiler_peak == traced.peak


def test_outputs_and_gradients_are_alive_at_the_peak_and_named(traced):
    labels = [(a.site.split(":")[0], a.func, a.name) for a in traced.trace.peak_alive]
    assert ("kernels/forward/pipeline.py", "output", "o") in labels
    assert ("kernels/backward/pipeline.py", "dh", "dv") in labels
    # the gradients' storages are allocations of the call, alive at the end, and ``grads`` their sum
    end = {a.key: a for a in traced.trace.alive()}
    assert set(traced.grad_keys) <= set(end) and len(traced.grad_keys) == 5
    assert traced.grads == sum(end[k].nbytes for k in traced.grad_keys) > 0
    assert traced.peak_above_grads == traced.peak - traced.grads
    assert all(a.site.startswith("kernels/") for a in traced.trace.alive())


def test_timeline_has_every_stage_in_call_order(traced):
    stages = [(d, s) for d, s, _, _ in traced.trace.timeline]
    fwd = [s for d, s in stages if d == "forward"]
    bwd = [s for d, s in stages if d == "backward"]
    assert fwd[0] == "prepare" and fwd[-1] == "finish" and "intra_chunk" in fwd and "output" in fwd
    assert bwd[0] == "prepare_backward" and bwd[-1] == "dg_dbeta"
    assert {"prep", "recompute", "dh", "dqk"} <= set(bwd)
    assert max(pk for _, _, _, pk in traced.trace.timeline) == traced.peak


def test_stub_path_restores_what_it_patched():
    import kernels.build as build
    import kernels.forward.pipeline as fpipe
    before = (build.get_kernel, fpipe.check_inputs, fpipe.intra_chunk, torch.cuda.get_device_capability)
    with mp.stub_kernel_path(mp.MemoryTrace()):
        assert build.get_kernel is not before[0] and fpipe.intra_chunk is not before[2]
    assert (build.get_kernel, fpipe.check_inputs, fpipe.intra_chunk, torch.cuda.get_device_capability) == before


def test_unknown_shape_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        mp.main(["--shapes", "B1_T7_H1_HV1"])
    assert "--shapes" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Buffer lifetimes of the backward (kernels/backward/pipeline.py, kernels/autograd.py), read from the trace
# ---------------------------------------------------------------------------------------------------------

def _first(trace, func, name):
    return next(a for a in trace.allocations if a.func == func and a.name == name)


def test_buffers_only_dh_and_the_recompute_read_are_freed_before_dqk_allocates(traced):
    """dUloc^T and the forward's (or prep's) Tinv and Ag tables are freed before dqk's first output is allocated; the
    chunk states and their gradients before dg_dbeta's; the autograd Function keeps no table to its end."""
    t = traced.trace
    dqk_born = _first(t, "dqk", "qz").born
    dgdb_born = _first(t, "dg_dbeta", "dgdb").born
    early = [a for a in t.allocations if (a.func, a.name) in {("prep", "dUl"), ("intra_chunk", "Ah"),
                                                              ("intra_chunk", "Al"), ("intra_chunk", "Th"),
                                                              ("prep", "Th"), ("prep", "Tl"), ("prep", "Agh, Agl")}]
    late = [a for a in t.allocations if a.func in ("recompute", "dh") and a.name[:2] in ("Sc", "Uh", "Ul", "dS", "dY")]
    assert any(a.name == "dUl" for a in early) and len(late) == 8
    assert all(a.died is not None and a.died < dqk_born for a in early), [a.label for a in early if
                                                                          a.died is None or a.died > dqk_born]
    assert all(a.died is not None and a.died < dgdb_born for a in late), [a.label for a in late if
                                                                          a.died is None or a.died > dgdb_born]


def test_the_recompute_allocates_after_dh_and_after_its_inputs_are_freed(traced):
    """The recompute runs after dh (on the main stream at these sizes: no side stream), so its S and U tables are
    allocated after dh's outputs, once dUloc^T (read by dh alone) is freed: never alive beside dh's inputs."""
    t = traced.trace
    rec = [a for a in t.allocations if a.func == "recompute" and a.name[:2] in ("Sc", "Uh", "Ul")]
    dh_out = [a for a in t.allocations if a.func == "dh" and a.name[:2] in ("dS", "dY")]
    dul = _first(t, "prep", "dUl")
    assert len(rec) == 4 and len(dh_out) == 4, ([a.label for a in rec], [a.label for a in dh_out])
    assert min(a.born for a in rec) > max(a.born for a in dh_out)
    assert dul.died is not None and dul.died < min(a.born for a in rec), dul.label


def test_a_retained_graph_runs_its_second_backward_without_the_handed_over_tables(monkeypatch):
    """The Function hands its intra tables to the first backward, which frees them; a second backward of a retained
    graph recomputes them in prep and gives the same gradients (the torch stand-ins of the kernels)."""
    from cases.case import Case
    from kernels.autograd import apply
    from tests import kernel_support as tt
    from tests.test_kernels_bwd_emulation import _fake_kernels

    asked = []
    _fake_kernels(monkeypatch, asked)
    xs, kw, do, dht = tt.bwd_args(Case(T=130, H=2, HV=4))
    xs = [x.detach().requires_grad_() for x in xs]
    o, ht = apply(*xs, **{**kw, "output_final_state": True})
    grads = []
    for _ in range(2):
        first = torch.autograd.grad((o, ht), xs, (do, dht), retain_graph=True)
        grads.append(first)
    preps = [c for c in asked if getattr(c, "kind", None) == "prep"]
    assert [c.saved for c in preps] == [True, False]           # the second backward recomputed Tinv and Ag
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-3)


def test_lifetime_floor_frees_each_buffer_after_its_last_use_but_not_the_callers():
    """Synthetic trace: A (100 B) last used before B (50 B) is allocated, C (30 B) returned to the caller."""
    t = mp.MemoryTrace(returned=20)

    def alloc(i, n, born, last_use, died):
        return mp.Allocation(i, i, n, (n,), torch.uint8, "x.py:1", "f", "v", "op", born, died, last_use)

    t.allocations = [alloc(0, 100, 1, 2, 10), alloc(1, 30, 3, 3, 25), alloc(2, 50, 4, 5, 10)]
    assert t.lifetime_floor() == 100                    # A alone at 1; then C + B = 80
    t.allocations[0].last_use = 4                       # A read when B is allocated: all three together
    assert t.lifetime_floor() == 180


def test_floor_of_the_traced_call_is_at_most_its_peak_and_kernels_record_their_arguments(traced):
    t = traced.trace
    assert 0 < t.lifetime_floor() <= t.peak
    for func, name in (("output", "o"), ("dh", "dv"), ("prep", "Fb")):
        a = _first(t, func, name)
        assert a.last_use > a.born, (func, name)        # a kernel (a stub launch) took it after its allocation


def test_a_plain_saved_tables_dict_is_read_not_emptied(monkeypatch):
    """Only a ``HandedTables`` is emptied: a caller's plain dict (the benchmark's stage timing reuses one) serves
    every backward it is passed to."""
    from cases.case import Case
    from kernels.backward.pipeline import chunk_gated_delta_rule_bwd as bwd
    from kernels.forward.pipeline import chunk_gated_delta_rule as fwd
    from tests import kernel_support as tt
    from tests.test_kernels_bwd_emulation import _fake_kernels

    asked = []
    _fake_kernels(monkeypatch, asked)
    xs, kw, do, dht = tt.bwd_args(Case(T=130, H=2, HV=4))
    saved = {}
    fwd(*xs, **kw, keep_tables=saved)
    assert sorted(saved) == ["Ah", "Al", "Th"]
    first, second = (bwd(*xs, do, dht, **kw, saved_tables=saved) for _ in range(2))
    assert sorted(saved) == ["Ah", "Al", "Th"]
    assert [c.saved for c in asked if getattr(c, "kind", None) == "prep"] == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(first, second) if a is not None)


def test_record_appends_the_summary_table(tmp_path, monkeypatch, capsys):
    """``--record PATH`` appends the printed summary as one section keyed by commit and "CPU trace"."""
    monkeypatch.setitem(mp.SHAPES, "tiny", SHAPES["varlen"])
    out = tmp_path / "RESULTS.md"
    assert mp.main(["--shapes", "tiny", "--record", str(out)]) == 0
    text = out.read_text()
    printed = capsys.readouterr().out
    assert "## benchmarks/memory_plan.py - commit" in text and "CPU trace (no-op kernels)" in text
    row = next(line for line in printed.splitlines() if line.startswith("tiny "))
    assert row in text


def test_the_overlapped_recompute_allocates_on_the_side_stream_and_records_its_outputs_on_main():
    """Where the recompute runs on the side stream beside dh, its outputs are allocated with the side stream
    current (so that none reuses a block dh's pending kernels still read: the segmented dh frees its temporaries
    while they run) and recorded on the main stream, which reads them in dqk and frees them."""
    import kernels.backward.pipeline as bpipe
    from torch.utils._python_dispatch import TorchDispatchMode

    log = {"side": False, "allocs": [], "records": []}
    main, side = mp._FakeStream(), bpipe._side_stream   # the stub's side stream is a stand-in; main a marker

    @contextlib.contextmanager
    def on_stream(s):
        log["side"] = True
        try:
            yield
        finally:
            log["side"] = False

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "empty" in str(func) and log["side"]:
                log["allocs"].append(out)
            return out

    leaves, kw, do, dht = mp.inputs(1, 512 * 64, 1, 8, None)    # 512 chunks x 8 value heads: the overlap's threshold
    with mp.stub_kernel_path():
        assert side is not bpipe._side_stream
        with mp._patched(torch.cuda, "stream", on_stream), \
                mp._patched(torch.cuda, "current_stream", lambda *a: main), \
                mp._patched(torch.Tensor, "record_stream", lambda t, s: log["records"].append((t, s))), Spy():
            mp._fwd_bwd(leaves, kw, do, dht)
    shapes = sorted(tuple(t.shape) for t in log["allocs"])
    # S hi, lo, U hi, lo, and nothing else: the recompute runs on dh's segments from their warm-up chunks (no start
    # states); the unwritten final state is the forward's cached stand-in, allocated by no call
    tables = [(8, 512, 128, 128)] * 2 + [(8, 512, 64, 128)] * 2
    assert shapes == sorted(tables), shapes
    on_main = [t for t, s in log["records"] if s is main]
    made = {a.untyped_storage()._cdata for a in log["allocs"]}
    assert sorted(tuple(t.shape) for t in on_main) == sorted(tables)
    assert all(t.untyped_storage()._cdata in made for t in on_main)


def test_span_bytes_counts_each_view_once():
    x = torch.zeros(4, 8)
    assert mp.span_bytes([x, x]) == x.nbytes
    assert mp.span_bytes([x, x[:2]]) == x.nbytes + x[:2].nbytes
    assert mp.span_bytes([x[:2], x[2:]]) == x.nbytes


def test_every_kernel_launch_is_recorded_in_its_stage(traced):
    """Each launch names its config and a stage of the timeline and spans some bytes; the
    launch table lists each one and a sum per direction."""
    t = traced.trace
    assert t.launches and all(0 <= ln.stage < len(t.timeline) and ln.nbytes > 0 for ln in t.launches)
    stages = {t.timeline[ln.stage][:2] for ln in t.launches}
    assert ("forward", "intra_chunk") in stages and ("backward", "prep") in stages, stages
    lines = mp.launch_table(traced)
    assert len(lines) == 1 + len(t.launches) + len({d for d, _ in stages})
    assert all(ln.name in line for ln, line in zip(t.launches, lines[1:]))
