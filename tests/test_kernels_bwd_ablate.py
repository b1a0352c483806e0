"""The timing-study switches of the backward's kernels (``dqk.build_bwd_dqk_inter`` / ``_intra``, ``dh.build_bwd_dh``,
``dqk_fused.build_bwd_dqk_fused``
with ``_ablate``, timed by ``benchmarks/ablate_bwd.py`` on a GPU): each switch removes something from the kernel, an
unknown name is refused, and the API's kernels are built without any (CPU, TileLang front end only)."""

from __future__ import annotations

import pytest

pytest.importorskip("tilelang")

from benchmarks.ablate_bwd import VARIANTS  # noqa: E402
from kernels.gdn_bwd import dh, dqk, dqk_fused, prep  # noqa: E402

BUILD = {"inter": dqk.build_bwd_dqk_inter, "intra": dqk.build_bwd_dqk_intra, "dh": dh.build_bwd_dh,
         "dqk": dqk_fused.build_bwd_dqk_fused, "prep": prep.build_bwd_prep}
NAMES = {"inter": dqk.ABLATIONS, "intra": dqk.INTRA_ABLATIONS, "dh": dh.DH_ABLATIONS, "dqk": dqk_fused.ABLATIONS,
         "prep": prep.PREP_ABLATIONS}


def _script(kernel, ablate=()):
    return BUILD[kernel](128, 128, "bfloat16", _ablate=frozenset(ablate)).script()


@pytest.mark.parametrize("kernel", ["inter", "intra", "dh", "dqk", "prep"])
def test_every_switch_changes_the_kernel_and_unknown_ones_are_refused(kernel):
    base = _script(kernel)
    for name in NAMES[kernel]:
        assert _script(kernel, (name,)) != base, name
    with pytest.raises(AssertionError):
        _script(kernel, ("no_such_part",))


def test_the_benchmark_times_every_switch_and_the_api_kernel_first():
    for kernel, variants in VARIANTS.items():
        labels = list(variants)
        assert variants[labels[0]] == (), kernel
        used = {n for ab in variants.values() for n in ab}
        assert used == set(NAMES[kernel]), kernel
