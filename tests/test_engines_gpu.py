"""FlashInfer's GDN prefill through the ``flashinfer`` adapter on a GPU (marker ``gpu``): the verdict against fp64 on
dense, varlen, GVA, initial-state and in-kernel-L2-norm cases, the kernel ``impl`` names, and the SM checks of
``flashinfer-cake`` and ``cudnn`` taken from the real package. Skips with the reason without a CUDA GPU or without
flashinfer-python (on the offline box: ``. scripts/flashinfer_env.sh``)."""

from __future__ import annotations

import pytest
import torch

from cases.case import Case
from parity.backends import get_backend
from parity.session import ParitySession


def _skip_reason() -> str | None:
    ok, reason = get_backend("flashinfer").available()
    return None if ok else reason


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]

CASES = [
    Case(layout="dense", B=1, T=4096, H=4, HV=8, dist="qwen-gates"),
    Case(layout="dense", B=1, T=4096, H=4, HV=8, g_dtype="bf16", beta_dtype="bf16", dist="qwen-gates"),
    Case(layout="dense", B=3, T=1000, H=4, HV=8, h0_dtype="fp32", dist="gauss-l2"),
    Case(layout="dense", B=2, T=777, H=4, HV=8, h0_dtype="fp32", dist="gauss-l2", state_v_first=True),
    Case(layout="varlen-ragged", B=1, T=4096, H=4, HV=8, dist="qwen-gates"),
    Case(layout="varlen-boundary", B=1, T=2308, H=2, HV=8, h0_dtype="bf16", dist="raw-qk-l2"),
    Case(layout="dense", B=1, T=2048, H=4, HV=8, dtype="fp16", g_dtype="fp16", beta_dtype="fp16", dist="slow-decay"),
]


@pytest.fixture(scope="module")
def session():
    return ParitySession()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_flashinfer_passes_the_verdicts(session, case):
    res = session.run(case, "flashinfer")
    impls = {r.get("impl") for r in res.rows}
    print(case.id, impls, {t: (v.status, v.value, v.bound) for t, v in res.verdicts.items()})
    assert not res.skipped(), res.skipped()
    assert not res.failures(), [v.message for v in res.failures()]
    assert all(i and i.startswith("flashinfer/cute-dsl") for i in impls), impls


def test_cake_and_cudnn_decide_by_the_architecture_without_running():
    cap = torch.cuda.get_device_capability()
    for name, words in (("flashinfer-cake", "SM100a/SM103a"), ("cudnn", "cuDNN")):
        be = get_backend(name)
        ok, reason = be.available()
        if not ok:
            pytest.skip(f"{name}: {reason}")
        ok, reason = be.supports(CASES[0], torch.device("cuda"))
        if cap in ((10, 0), (10, 3)):
            assert ok, reason
        else:
            assert not ok and words in reason, reason
