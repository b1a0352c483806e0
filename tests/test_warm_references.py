"""``benchmarks/warm_references.py`` on a CPU: one call per shape in spawned processes, forward and backward, with
a stand-in implementation; a shape that fails and an implementation that is unavailable are reported by name
without stopping the other shapes."""

from __future__ import annotations

from benchmarks.warm_references import warm

SHAPES = ["B1_T8192_H4_HV8", "B1_T65536_H2_HV4"]


def _stand_in_fn(q, k, v, g, beta, output_final_state=False, cu_seqlens=None):
    if v.shape[2] == 4:
        raise ValueError("stand-in refuses HV=4")
    o = v.float() * beta[..., None] * g.exp()[..., None] + q.float().mean() + k.float().mean()
    return o, o.sum(dim=1)


def stand_in():
    return _stand_in_fn, None


def unavailable():
    return None, "not installed here"


def test_every_shape_is_called_once_and_a_failure_stays_its_own():
    lines = []
    out = warm("tests.test_warm_references:stand_in", SHAPES, workers=2, backward=True, device="cpu",
               log=lines.append)
    assert out["B1_T8192_H4_HV8"] is None
    assert "stand-in refuses HV=4" in out["B1_T65536_H2_HV4"]
    assert len(lines) == 3 and "2 shapes in" in lines[-1]


def test_an_unavailable_implementation_is_reported_per_shape():
    out = warm("tests.test_warm_references:unavailable", SHAPES[:1], workers=1, device="cpu", log=lambda m: None)
    assert out == {"B1_T8192_H4_HV8": "unavailable: not installed here"}


def crash():
    import os
    os._exit(3)                    # a worker process that dies, as a segfault in a JIT would


def test_a_worker_that_dies_is_reported_and_returns():
    lines = []
    out = warm("tests.test_warm_references:crash", SHAPES[:1], workers=1, device="cpu", log=lines.append)
    assert out["B1_T8192_H4_HV8"].startswith("warm-up process lost: BrokenProcessPool")
    assert any("warm-up stopped" in m for m in lines)
