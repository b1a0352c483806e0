"""Python entry of our TileLang GDN chunked forward (Hopper, sm_90a).

``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False, use_qk_l2norm_in_kernel=False, state_v_first=False,
cu_seqlens=None) -> (o, final_state)`` with the semantics of FLA's
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``:

* q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``: bf16 or fp16 (all the same dtype),
  ``K == V`` in {64, 128}, ``HV % H == 0`` (value head j reads q/k head
  ``j // (HV // H)``);
* g, beta ``[B, T, HV]``: fp32 or the input dtype (g is the log decay; the
  cumsum and every exponent are fp32 whatever its dtype);
* initial_state ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
  ``state_v_first=True``), N = B, or ``len(cu_seqlens) - 1`` with varlen;
* cu_seqlens: int32/int64 ``[N + 1]``, requires B == 1; the state restarts at
  every boundary;
* returns o ``[B, T, HV, V]`` in the input dtype and the final state (fp32,
  same layout as initial_state) or None.

Bad input raises ``ValueError`` naming the problem.  Dense input is run as
varlen (B sequences of length T), so both use the same kernels (the v2
"split2" path, the only one): ``gdn_intra_v2`` (intra2.py, parallel), the
sequential state kernel (state2.py "smem" form, or state3.py "rv" form with the
segment-parallel CP scan and a host fix-up, chosen by ``build.plan_v2``), then
``gdn_output_v2`` (output2.py, parallel).  The kernels are built for K == V ==
128; K == V == 64 is zero-padded to 128 here (exact, but it costs the 128
kernel's time).  Both state layouts have the same shape (K == V), so the layout
is a runtime flag.
This module imports tilelang only when a kernel is needed.
"""

from __future__ import annotations

import torch

BT = 64
_INPUT_DTYPES = (torch.bfloat16, torch.float16)
_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first):
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, H, K] / [B, T, HV, V]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}; got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if q.dtype not in _INPUT_DTYPES:
        raise ValueError(f"q/k/v dtype must be bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if H == 0 or HV % H != 0:
        raise ValueError(f"HV % H must be 0 (GVA: HV={HV} value heads, H={H} q/k heads)")
    if K != V or K not in (64, 128):
        raise ValueError(f"unsupported head dims K={K}, V={V}: this kernel needs K == V in (64, 128)")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, q.dtype):
            raise ValueError(f"{name} dtype must be float32 or the input dtype {q.dtype}, got {x.dtype}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N + 1] with N >= 1")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens dtype must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flattened varlen input), got B={B}")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise ValueError("initial_state must be a torch.Tensor or None")
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            lay = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be {lay} = {want}, got {tuple(initial_state.shape)}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point (fp32), got {initial_state.dtype}")
    if N > 65535:
        raise ValueError(f"at most 65535 sequences per call (grid z), got N={N}")
    if HV > 65535:
        raise ValueError(f"at most 65535 value heads, got HV={HV}")
    if B * T >= 2 ** 31 - BT:
        raise ValueError(f"B*T = {B * T} tokens is too many (int32 token indices)")
    dev = q.device
    if dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (sm_90), got {dev}")
    others = dict(tensors, initial_state=initial_state)  # cu_seqlens may be on the host or the device
    for name, x in others.items():
        if x is not None and x.device != dev:
            raise ValueError(f"{name} is on {x.device}, expected {dev} like q")
    return B, T, H, HV, K, V, N


_DENSE_TABLES: dict = {}


def _require_sm90(dev, what: str):
    """Raise unless ``dev`` is an sm_90 (Hopper) GPU: the kernels are built for sm_90a."""
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) != (9, 0):
        raise RuntimeError(f"{what} is built for sm_90a (Hopper); device is sm_{major}{minor}")


def _seq_tables(B, T, cu_seqlens, dev, cu_host=None):
    """cu_seqlens (int32), chunk_indices [NC, 2] (int32), chunk_offsets [N + 1] (int32), NC.

    Dense tables are built on the device without a host sync and cached per (B, T, device); varlen tables
    from ``cu_host`` (cu_seqlens as a host list) when the caller already has it, else with one host sync."""
    if cu_seqlens is None:
        key = (B, T, str(dev))
        hit = _DENSE_TABLES.get(key)
        if hit is not None:
            return hit
        if len(_DENSE_TABLES) > 64:
            _DENSE_TABLES.clear()
        _DENSE_TABLES[key] = _dense_tables(B, T, dev)
        return _DENSE_TABLES[key]
    return _varlen_tables(T, cu_seqlens, dev, cu_host)


def _dense_tables(B, T, dev):
    nt = -(-T // BT)
    cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * T
    offs = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * nt
    seq = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(nt)
    ic = torch.arange(nt, device=dev, dtype=torch.int32).repeat(B)
    return cu, torch.stack([seq, ic], 1).contiguous(), offs, B * nt


def _host_list(cu_seqlens) -> list[int]:
    """cu_seqlens as a host list of ints (one device -> host copy)."""
    return [int(x) for x in cu_seqlens.tolist()]


_VARLEN_LAST: dict = {}


def _call_tables(B, T, cu_seqlens, dev):
    """``(cu_host, _seq_tables(...))`` of a call (``cu_host`` None for dense input).  A varlen call reuses the
    previous call's when ``cu_seqlens`` is the same tensor object, unmodified (same ``_version``), with the same T
    and device: a model calls the kernel once per layer with one ``cu_seqlens``, and only the first call then pays
    the device -> host copy (a sync) and the host-side table build.  (FLA caches its chunk indices by tensor
    identity the same way.)  The cache holds a reference to that one tensor, so its memory cannot be reused by
    another tensor while it is cached."""
    if cu_seqlens is None:
        return None, _seq_tables(B, T, None, dev)
    last = _VARLEN_LAST.get("entry")     # one tuple, replaced in one assignment: no torn key / value pair
    if (last is not None and last[0] is cu_seqlens and last[1] == cu_seqlens._version and last[2] == T
            and last[3] == str(dev)):
        return last[4]
    cu_host = _host_list(cu_seqlens)
    value = (cu_host, _seq_tables(B, T, cu_seqlens, dev, cu_host))
    _VARLEN_LAST["entry"] = (cu_seqlens, cu_seqlens._version, T, str(dev), value)
    return value


def _varlen_tables(T, cu_seqlens, dev, cu_host=None):
    if cu_host is None:
        cu_host = _host_list(cu_seqlens)
    if cu_host[0] != 0 or cu_host[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu_host[0]} ... {cu_host[-1]}")
    idx, offs = [], [0]
    for n in range(len(cu_host) - 1):
        L = cu_host[n + 1] - cu_host[n]
        if L < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (sequence {n} has length {L})")
        nch = -(-L // BT)
        idx.extend((n, i) for i in range(nch))
        offs.append(offs[-1] + nch)
    cu = torch.tensor(cu_host, dtype=torch.int32).to(dev, non_blocking=True)
    ci = torch.tensor(idx if idx else [[0, 0]], dtype=torch.int32).reshape(-1, 2).to(dev, non_blocking=True)
    co = torch.tensor(offs, dtype=torch.int32).to(dev, non_blocking=True)
    return cu, ci, co, len(idx)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    _block_v: int | None = None,
    _path: str | None = None,
    _precision: str | None = None,
    _cp: int | None = None,
    _form: str | None = None,
    _out: str | None = None,
    _intra: str | None = None,
    _occ: int | None = None,
    _cpb: int | None = None,
    _keep_tables: dict | None = None,
):
    """GDN chunked forward.  See the module docstring for shapes and dtypes.

    Private knobs (benchmarking / tuning only): ``_block_v`` overrides the sequential kernel's
    value columns per CTA (16, 32 or 64 for "smem"; 64 or 128 for "rv"); ``_path`` accepts only
    "split2" (or None; the older "split" / "fused" paths were removed and raise ``ValueError``);
    ``_precision`` is a ``variants.PRECISIONS_V2`` preset name or "sp[f1+f2+...]"; ``_cp`` is the
    number of segments per sequence of the segment-parallel state passing (1 = off; > 1 implies
    "rv"; None = ``build.plan_v2``); ``_form`` is the state kernel: "smem" (``state2.py``) or "rv"
    (``state3.py``, register operands; None = ``build.plan_v2``); ``_out`` is the output kernel: "chunk" (one
    chunk per CTA) or "pipe" (several chunks per CTA, pipelined loads; None = ``build.output_form``); ``_intra`` is
    the intra kernel: "ax" (default, ``build.Intra2Config.alias_x``) or "v2" (bitwise the same); ``_occ`` is the "smem" state
    kernel's CTAs per SM, 1 or 2 (None = ``build.state_occ``'s pick; 2 needs BV <= 32);
    ``_cpb`` is the "pipe" output kernel's chunks per CTA (``build.OUT_CPBS``; bitwise the same o).
    ``_keep_tables`` (the autograd Function's): a dict that receives the intra kernel's tables for the backward,
    ``Th`` (Tinv in the input dtype), ``Ah``, ``Al`` (Ag = Tinv diag(beta), hi + lo), each [HV, NC, 64, 64]; left
    empty where the precision's tables are not the backward's (``build.keeps_tables``).
    """
    from .build import check_knobs
    check_knobs(_path, _out, _intra, _precision, _occ, _cpb)      # unknown values fail here, before any CUDA check
    B, T, H, HV, K, V, N = _check(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    if scale is None:
        scale = K ** -0.5
    scale = float(scale)
    dev = q.device
    _require_sm90(dev, "kernels.chunk_gated_delta_rule")

    from .build import KERNEL_HEAD_DIM

    dt = q.dtype
    D = KERNEL_HEAD_DIM
    Ttot = B * T
    # the one host sync of a varlen call, none when the previous call had the same cu_seqlens
    cu_host, (cu, chunk_indices, chunk_offsets, NC) = _call_tables(B, T, cu_seqlens, dev)

    # K == V == 64 runs on the 128 kernels, zero-padded: q.k, the l2 norms and the state's
    # leading 64x64 block are unchanged, the padded rows/columns of S stay exactly 0.
    pad = D - K

    def _pad_last(x, n):
        return torch.nn.functional.pad(x, (0, n)) if n else x

    def _tma_ready(x):
        # contiguous with a 16-byte aligned base (TMA descriptors need it; odd views get copied)
        x = x.contiguous()
        return x if x.data_ptr() % 16 == 0 else x.clone()

    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(torch.float32)
        if pad:
            h0 = torch.nn.functional.pad(h0, (0, pad, 0, pad))
        h0 = h0.contiguous()
    else:
        h0 = torch.empty((1, HV, D, D), device=dev, dtype=torch.float32)  # not read (use_h0 = 0)
    ht = torch.empty((N if output_final_state else 1, HV, D, D), device=dev, dtype=torch.float32)

    if Ttot == 0 or NC == 0:
        o = torch.zeros(B, T, HV, V, device=dev, dtype=dt)
        if not output_final_state:
            return o, None
        if initial_state is None:
            return o, torch.zeros((N, HV, V, K) if state_v_first else (N, HV, K, V), device=dev,
                                  dtype=torch.float32)
        return o, initial_state.to(torch.float32).clone()

    q2 = _tma_ready(_pad_last(q.reshape(Ttot, H, K), pad))
    k2 = _tma_ready(_pad_last(k.reshape(Ttot, H, K), pad))
    v2 = _tma_ready(_pad_last(v.reshape(Ttot, HV, V), pad))
    g2 = g.reshape(Ttot, HV).to(torch.float32).contiguous()
    b2 = beta.reshape(Ttot, HV).to(torch.float32).contiguous()
    o2 = torch.empty(Ttot, HV, D, device=dev, dtype=dt)

    o2, ht = _split2(q2, k2, v2, g2, b2, h0, ht, o2, cu, chunk_indices, chunk_offsets, NC, N, HV, D, dt,
                     cu_seqlens, B, T, scale, initial_state is not None, output_final_state, state_v_first,
                     use_qk_l2norm_in_kernel, _block_v, _precision, _cp, _form, cu_host, _out, _intra, _occ,
                     _cpb, _keep_tables)
    return _finish(o2, ht, pad, B, T, HV, K, V, output_final_state)


def _finish(o2, ht, pad, B, T, HV, K, V, output_final_state):
    o = (o2[..., :V] if pad else o2).reshape(B, T, HV, V)
    if pad:
        o = o.contiguous()
    if not output_final_state:
        return o, None
    if pad:
        ht = ht[..., :K, :V].contiguous()
    return o, ht


_SEG_TABLES: dict = {}


def _cp_tables(B, T, cu_seqlens, cu_host, n_seg, dev):
    """Segment tables of the CP path: seg_cu, seg_co (int32, device), seg_of (host list [N + 1]),
    the fix-up schedule (per step p: (sequence ids, segment ids) as device int64 tensors, or None
    when every sequence has the same number of segments) and Nseg.  Cached for dense input."""
    key = (B, T, n_seg, str(dev)) if cu_seqlens is None else None
    if key is not None and key in _SEG_TABLES:
        return _SEG_TABLES[key]
    from .emulation import cp_segments
    if cu_host is None:
        cu_host = [b * T for b in range(B + 1)] if cu_seqlens is None else _host_list(cu_seqlens)
    seg_cu, seg_co, seg_of = cp_segments(cu_host, n_seg)
    counts = [seg_of[n + 1] - seg_of[n] for n in range(len(seg_of) - 1)]
    uniform = len(set(counts)) == 1
    sched = None
    if not uniform:
        sched = []
        for p in range(max(counts)):
            seqs = [n for n, cn in enumerate(counts) if cn > p]
            sched.append((torch.tensor(seqs, dtype=torch.long).to(dev, non_blocking=True),
                          torch.tensor([seg_of[n] + p for n in seqs], dtype=torch.long).to(dev, non_blocking=True)))
    out = (torch.tensor(seg_cu, dtype=torch.int32).to(dev, non_blocking=True),
           torch.tensor(seg_co, dtype=torch.int32).to(dev, non_blocking=True), seg_of, counts, sched,
           len(seg_cu) - 1)
    if key is not None:
        if len(_SEG_TABLES) > 64:
            _SEG_TABLES.clear()
        _SEG_TABLES[key] = out
    return out


def _cp_fixup(ZM, h0, seg_of, counts, sched, N, HV, D, vt):
    """Phase 2 of CP (fp64 batched matmuls: no TF32 whatever the global torch flags say).

    The chunk-aligned segments p = 0..P-1 of a sequence start from S_0 = h0 (or 0) and
    S_{p+1} = M_p S_p + Z_p, with the scan's output ZM [Nseg, HV, D, 2D] = [Z | M] (key-first form)
    or, with ``vt`` (the rv kernels, value-first), ZM [Nseg, HV, 2D, D] = [Z^T ; M^T] and
    S^T_{p+1} = S^T_p M^T_p + Z^T_p.  ``h0`` must already be in the kernel's layout.
    Returns the segment start states [Nseg, HV, D, D] (fp32, the kernel's layout)."""
    if sched is None:                   # every sequence has P segments: segment id = n * P + p
        return _cp_fixup_uniform(ZM, h0, counts[0], N, HV, D, vt)
    dev = ZM.device
    if vt:
        Z, M = ZM[:, :, :D, :], ZM[:, :, D:, :]
    else:
        Z, M = ZM[..., :D], ZM[..., D:]

    def step(Zp, Mp, Sp):
        a, b = (Sp, Mp) if vt else (Mp, Sp)
        return torch.baddbmm(Zp, a, b)

    S0 = h0.double() if h0 is not None else torch.zeros(N, HV, D, D, device=dev, dtype=torch.float64)
    Z, M = Z.double(), M.double()
    S = S0.clone()
    h0s = torch.empty(ZM.shape[0], HV, D, D, device=dev, dtype=torch.float32)
    for p, (seqs, segs) in enumerate(sched):
        h0s[segs] = S[seqs].float()
        if p + 1 < len(sched):
            S[seqs] = step(Z[segs].reshape(-1, D, D), M[segs].reshape(-1, D, D),
                           S[seqs].reshape(-1, D, D)).view(-1, HV, D, D)
    return h0s


def _cp_fixup_uniform(ZM, h0, P, N, HV, D, vt):
    """``_cp_fixup`` when every sequence has ``P`` segments (segment id = n * P + p), in ~3 log2(P) + 3 launches
    instead of a sequential walk (2 per segment): an inclusive Hillis-Steele scan of the affine maps
    ``A_p(S) = M_p S + Z_p`` in fp64.  Level d composes ``C_p <- C_p o C_(p-d)`` for p >= d, with
    ``(M, Z) o (M', Z') = (M M', M Z' + Z)``, as one batched matmul ``M_p [Z'_q | M'_q]``; after the scan
    ``S_(p+1) = Mc_p S_0 + Zc_p``.  Key-first throughout (the value-first ``vt`` input and output are transposed in
    the fp64 conversion and the final cast)."""
    zm = ZM.transpose(-1, -2) if vt else ZM                     # [Nseg, HV, D, 2D] = [Z | M] (key-first)
    c = zm.reshape(N, P, HV, D, 2 * D).transpose(0, 1).to(torch.float64).reshape(P, N * HV, D, 2 * D)
    d = 1
    while d < P:
        y = torch.matmul(c[d:, :, :, D:], c[:-d])               # [M_p Zc_q | M_p Mc_q], q = p - d
        y[..., :D] += c[d:, :, :, :D]
        c[d:] = y
        d *= 2
    S = torch.empty(P, N * HV, D, D, device=ZM.device, dtype=torch.float64)
    if h0 is None:
        S[0].zero_()
        S[1:] = c[:-1, :, :, :D]
    else:
        S0 = h0.transpose(-1, -2) if vt else h0
        S[0] = S0.reshape(N * HV, D, D)
        torch.baddbmm(c[:-1, :, :, :D].reshape(-1, D, D), c[:-1, :, :, D:].reshape(-1, D, D),
                      S[0].expand(P - 1, N * HV, D, D).reshape(-1, D, D), out=S[1:].view(-1, D, D))
    S = S.view(P, N, HV, D, D).transpose(0, 1).reshape(N * P, HV, D, D)
    # the kernels take packed tensors: the value-first transpose is made contiguous in the fp32 cast
    return (S.transpose(-1, -2) if vt else S).to(torch.float32, memory_format=torch.contiguous_format)


def _split2(q2, k2, v2, g2, b2, h0, ht, o2, cu, chunk_indices, chunk_offsets, NC, N, HV, D, dt, cu_seqlens,
            B, T, scale, use_h0, output_final_state, state_v_first, use_l2, block_v_, precision, cp, form,
            cu_host=None, out=None, intra=None, occ=None, cpb=None, keep=None):
    """The v2 path: intra2 -> state (or CP: scan, fix-up, state per segment) -> output2.  ``cu_host``:
    cu_seqlens as a host list (None for dense input); ``keep``: a dict for the intra tables (``_keep_tables``)."""
    from .build import dispatch_v2, get_kernel, plan_v2, precision_v2

    prec = precision_v2(precision, has_h0=bool(use_h0))
    dev = q2.device
    max_chunks = 0
    if cu_seqlens is not None and cu_host is None:
        cu_host = _host_list(cu_seqlens)
    if cp is None or form is None:
        if cu_seqlens is None:
            max_chunks = -(-T // BT)
        else:
            max_chunks = max([-(-(cu_host[i + 1] - cu_host[i]) // BT) for i in range(N)] + [0])
    form, cp = plan_v2(N, HV, max_chunks, form, cp)
    vt = form == "rv"
    cfgs = dispatch_v2(_TL_DTYPE[dt], N, HV, block_v_, prec, cp, form, out, intra, occ, cpb, th=keep is not None)
    kerns = [get_kernel(c) for c in cfgs]
    th = cfgs[0].th                 # where the precision's tables are the backward's (build.keeps_tables)

    Ah = torch.empty(HV, NC, BT, BT, device=dev, dtype=dt)
    Al = torch.empty_like(Ah) if prec.ag == "split" else Ah        # not read unless split
    F = torch.empty(HV, NC, 8, BT, device=dev, dtype=torch.float32)
    Th = torch.empty_like(Ah) if th else Ah                         # not accessed unless th
    kerns[0](q2, k2, g2, b2, cu, chunk_indices, Ah, Al, F, Th, scale, int(bool(use_l2)))
    if th:
        keep.update(Th=Th, Ah=Ah, Al=Al)

    Sch = torch.empty(HV, NC, D, D, device=dev, dtype=dt)           # [.., DV, DK] when vt (same shape)
    Scl = torch.empty_like(Sch) if prec.s == "split" else Sch
    Uh = torch.empty((HV, NC, D, BT) if vt else (HV, NC, BT, D), device=dev, dtype=dt)
    Ul = torch.empty_like(Uh) if prec.u == "split" else Uh
    if cp <= 1:
        kerns[1](k2, v2, Ah, Al, F, cu, chunk_offsets, h0, Sch, Scl, Uh, Ul, ht, int(use_h0),
                 int(bool(output_final_state)), int(bool(state_v_first)))
    else:
        seg_cu, seg_co, seg_of, counts, sched, Nseg = _cp_tables(B, T, cu_seqlens, cu_host, cp, dev)
        ZM = torch.empty((Nseg, HV, 2 * D, D) if vt else (Nseg, HV, D, 2 * D), device=dev, dtype=torch.float32)
        kerns[3](k2, v2, Ah, Al, F, seg_cu, seg_co, h0[:1], Sch, Scl, Uh, Ul, ZM, 0, 1, 0)
        h0k = None
        if use_h0:                      # into the kernel's natural layout (value-first for rv)
            h0k = h0 if bool(state_v_first) == vt else h0.transpose(-1, -2)
        h0s = _cp_fixup(ZM, h0k, seg_of, counts, sched, N, HV, D, vt)
        hts = torch.empty(Nseg, HV, D, D, device=dev, dtype=torch.float32)
        kerns[1](k2, v2, Ah, Al, F, seg_cu, seg_co, h0s, Sch, Scl, Uh, Ul, hts, 1, int(bool(output_final_state)),
                 int(vt))
        if output_final_state:
            ht = hts.index_select(0, _last_segments(seg_of, dev))
            if bool(state_v_first) != vt:
                ht = ht.transpose(-1, -2).contiguous()
    kerns[2](q2, k2, F, Sch, Scl, Uh, Ul, cu, chunk_indices, o2)
    return o2, ht


_LAST: dict = {}


def _last_segments(seg_of, dev):
    key = (tuple(seg_of), str(dev))
    if key not in _LAST:
        if len(_LAST) > 64:
            _LAST.clear()
        _LAST[key] = torch.tensor([seg_of[n + 1] - 1 for n in range(len(seg_of) - 1)],
                                  dtype=torch.long).to(dev, non_blocking=True)
    return _LAST[key]


def intra2_stage(q, k, g, beta, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, _precision=None):
    """Run only the v2 intra-chunk kernel and return ``(Ah, Al, F)`` (for stage-by-stage checks;
    Al is zeros unless the precision splits Ag)."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    from .build import Intra2Config, get_kernel, precision_v2
    if K != 128:
        raise ValueError("intra2_stage is only exposed for K == 128")
    prec = precision_v2(_precision)
    dev = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    cu, ci, _, NC = _seq_tables(B, T, cu_seqlens, dev)
    Ah = torch.empty(HV, NC, BT, BT, device=dev, dtype=q.dtype)
    Al = torch.zeros_like(Ah)
    F = torch.empty(HV, NC, 8, BT, device=dev, dtype=torch.float32)
    kern = get_kernel(Intra2Config(_TL_DTYPE[q.dtype], prec.merge, prec.ag))
    kern(q.reshape(B * T, H, K).contiguous(), k.reshape(B * T, H, K).contiguous(),
         g.reshape(B * T, HV).float().contiguous(), beta.reshape(B * T, HV).float().contiguous(),
         cu, ci, Ah, Al, F, Ah, scale, int(bool(use_qk_l2norm_in_kernel)))
    return Ah, Al, F
