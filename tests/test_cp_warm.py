"""The warm-up starts of the forward's CP segments (``kernels.forward.cp_warm``) on the CPU: the bound in the gate
table's row 7, the rule that picks each segment's start, and the emulated forward with them against the exact CP
path and the sequential one."""

import pytest
import torch

from kernels.forward import cp_warm
from kernels.forward.emulation import chunk_gated_delta_rule_at, cp_segments, intra_chunk
from kernels.forward.precision import PRESETS

BT = 64


def _inputs(T, H, HV, gate_scale, seed=0, raw_k=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, 128, generator=gen).bfloat16()
    k = torch.randn(1, T, H, 128, generator=gen)
    k = (k * 0.2 if raw_k else torch.nn.functional.normalize(k, dim=-1)).bfloat16()
    v = torch.randn(1, T, HV, 128, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen)) * torch.tensor(gate_scale)
    beta = torch.rand(1, T, HV, generator=gen)
    return q, k, v, g, beta


def test_row7_bounds_the_norm_of_each_chunks_transition():
    """``2^F[hv, c, 7, 63]`` bounds the spectral norm of the chunk's map ``prod_t e^g_t (I - beta_t k_t k_t^T)``
    (fp64), also where ``beta ||k||^2 > 2`` makes a factor expand, and with the in-kernel L2 norm."""
    for use_l2, raw in ((False, True), (True, True), (False, False)):
        q, k, v, g, beta = _inputs(200, 1, 2, 0.3, seed=3, raw_k=raw)
        beta = beta * 1.9
        _, _, F = intra_chunk(q[0], k[0], g[0], beta[0], [0, 200], 128 ** -0.5, use_l2, torch.bfloat16,
                              PRESETS["default"])
        kk = k[0, :, 0].double()
        if use_l2:
            kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
        expanding = 0
        for hv in range(2):
            for c in range(F.shape[1]):
                phi = torch.eye(128, dtype=torch.float64)
                for t in range(c * BT, min(200, (c + 1) * BT)):
                    kt = kk[t][:, None]
                    phi = torch.exp(g[0, t, hv].double()) * (phi - beta[0, t, hv].double() * kt @ (kt.T @ phi))
                    expanding += int(beta[0, t, hv] * (kt * kt).sum() > 2)
                norm = torch.linalg.matrix_norm(phi, ord=2).item()
                bound = 2.0 ** F[hv, c, 7, -1].item()
                assert norm <= bound * (1 + 1e-4), (use_l2, hv, c, norm, bound)
        assert raw is False or use_l2 or expanding > 0        # the raw-k case exercises the expanding factors


def test_the_rule_picks_warm_up_reach_start_or_exact():
    """``warm_chunks_host``: 0 for a sequence's first segment, the fewest chunks whose L sum to at most
    ``WARM_LOG2``, the chunks back to the sequence's first one, else -1; ``warm_offsets``' layout."""
    W = cp_warm.WARM_CHUNKS
    s2, e0 = W + 4, 2 * W + 8                       # segment 2's start, more than W chunks past its sequence's start
    s4 = e0 + W + 2
    seg_co, seg_of = [0, 2, s2, e0, s4, s4 + 3], [0, 3, 5]     # two sequences: chunks [0, e0) and [e0, s4 + 3)
    co = cp_warm.warm_offsets(seg_co, seg_of)
    assert co == seg_co + [0, 0, 0, 3, 3] + [2, 2, 2, 4, 4]
    L = torch.zeros(3, s4 + 3)
    L[0] = -50.0                                    # one chunk suffices
    L[1] = -15.0                                    # three (-45 <= -40)
    L[2] = -1.0                                     # never: exact, or back to the sequence start
    L[1, s2 - 3] = 30.0                             # an expanding chunk: segment 2 of head 1 needs six (-15 -15 +30 ...)
    got = [cp_warm.warm_chunks_host(L, co, j).tolist() for j in range(5)]
    assert got[0] == [0, 0, 0] and got[3] == [0, 0, 0]           # first segments
    assert got[1] == [1, 2, 2]                                    # 2 chunks back reach the sequence start (chunk 0)
    assert got[2] == [1, 6 if W >= 6 else -1, -1]
    assert got[4] == [1, 3, -1]


def test_the_reverse_rule_picks_warm_up_or_the_sequence_end():
    """``warm_back_host`` (the reverse pass's rule): 0 for a sequence's last segment, the fewest chunks after a
    segment's end whose L sum to at most ``WARM_LOG2``, the chunks on to the sequence's last one where those are
    fewer, else (no ``WARM_CHUNKS`` chunks bring the bound down) every chunk to the sequence's end."""
    W = cp_warm.WARM_CHUNKS
    e1, e2 = 2 * W + 8, 3 * W + 20                  # sequence 0: segments [0, 4), [4, e1), [e1, e2); sequence 1 after
    offs, last = [0, 4, e1, e2, e2 + 5, e2 + 9], [2, 2, 2, 4, 4]
    L = torch.zeros(3, e2 + 9)
    L[0] = -50.0                                    # one chunk suffices
    L[1] = -15.0                                    # three (-45 <= -40)
    L[2] = -1.0                                     # never within W: on to the sequence's end
    L[1, e1 + 1] = 30.0                             # an expanding chunk: segment 1 of head 1 needs six
    got = [cp_warm.warm_back_host(L, offs, last, j).tolist() for j in range(5)]
    assert got[2] == [0, 0, 0] and got[4] == [0, 0, 0]           # last segments
    assert got[0] == [1, 3, e2 - 4]
    assert got[1] == [1, 6 if W >= 6 else e2 - e1, e2 - e1]
    assert got[3] == [1, 3, 4]                                    # 4 chunks on reach the sequence's last chunk


@pytest.mark.parametrize("gate_scale,h0", [(1.0, True), (0.25, False), ([1.0, 0.01], True), (0.01, True)],
                         ids=["strong", "medium", "mixed-heads", "slow"])
def test_warm_cp_forward_matches_the_sequential_and_the_exact_cp(gate_scale, h0):
    """The emulated forward with warm-up starts against the sequential one and the exact CP path: within a few
    ulps of o and the final state (plus the exact CP path's own distance, for heads that fall back) where warm-up
    starts apply (the dropped part is below 2^-40), bitwise the exact CP path's where every segment falls back."""
    T, HV = 4 * (cp_warm.WARM_CHUNKS + 2) * BT + 48, 2      # segments longer than the most warm-up chunks
    q, k, v, g, beta = _inputs(T, 1, HV, gate_scale, seed=1)
    init = torch.randn(1, HV, 128, 128) if h0 else None
    kw = dict(initial_state=init, output_final_state=True)
    seq = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw)
    cp = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw, cp_segments_n=4)
    warm = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw, cp_segments_n=4, warm=True)
    _, _, F = intra_chunk(q[0], k[0], g[0].float(), beta[0], [0, T], 128 ** -0.5, False, torch.bfloat16,
                          PRESETS["default"])
    _, seg_co, seg_of = cp_segments([0, T], 4)
    co = cp_warm.warm_offsets(seg_co, seg_of)
    ws = torch.stack([cp_warm.warm_chunks_host(F[:, :, 7, -1], co, j) for j in range(1, 4)])
    if gate_scale == 0.01:
        assert (ws == -1).all()
        assert all(torch.equal(a, b) for a, b in zip(warm, cp))
        return
    assert (ws > 0).any()
    for i, name in enumerate(("o", "final state")):
        a, b, c = (x[i].double() for x in (warm, seq, cp))
        err = (a - b).abs().max().item()
        # a few ulps, plus the exact CP path's own distance from the sequential one (heads that fall back)
        tol = 4 * torch.finfo(warm[i].dtype).eps * b.abs().max().item() + (c - b).abs().max().item()
        assert err <= tol, (name, err, tol)


def test_split_heads_take_each_head_from_warm_segments_or_the_whole_sequence():
    """``split_heads``: a (sequence, value head) whose every segment start takes a warm-up is the warm CP path's,
    bitwise; any other the sequential path's, bitwise (``split_sequences``: the strong-decay head of the first
    sequence; a sequence of one segment counts as warm: its one start is exact)."""
    from kernels.forward.emulation import split_sequences
    L0 = 2 * (cp_warm.WARM_CHUNKS + 2) * BT + 76               # two segments, each longer than the most warm-up
    T, HV, cu = L0 + 100, 2, [0, L0, L0 + 50, L0 + 100]
    q, k, v, g, beta = _inputs(T, 1, HV, [1.0, 0.01], seed=2)
    init = torch.randn(3, HV, 128, 128)
    kw = dict(initial_state=init, output_final_state=True, cu_seqlens=torch.tensor(cu))
    seq = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw)
    warm = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw, cp_segments_n=2, warm=True)
    split = chunk_gated_delta_rule_at(q, k, v, g, beta, **kw, cp_segments_n=2, warm=True, split_heads=True)
    _, _, F = intra_chunk(q[0], k[0], g[0].float(), beta[0], cu, 128 ** -0.5, False, torch.bfloat16,
                          PRESETS["default"])
    pick = split_sequences(F, cu, 2)
    assert pick.tolist() == [[True, False], [True, True], [True, True]]
    for n in range(3):
        rows = slice(cu[n], cu[n + 1])
        for h in range(HV):
            o_ref, s_ref = warm if pick[n, h] else seq
            assert torch.equal(split[0][0, rows, h], o_ref[0, rows, h]), (n, h)
            assert torch.equal(split[1][n, h], s_ref[n, h]), (n, h)
    assert not torch.equal(warm[1][0, 1], seq[1][0, 1])     # the slow head: its exact CP start is another sum
