"""What both directions share at the host: argument checks, dtype maps, the sm_90 requirement and the
per-call chunk tables (dense or varlen), cached per layout.

Importing this module imports neither tilelang nor CUDA.
"""

from __future__ import annotations

import math

import torch

BT = 64                                      # tokens per chunk
INPUT_DTYPES = (torch.bfloat16, torch.float16)
TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
TORCH_DTYPE = {v: k for k, v in TL_DTYPE.items()}
LO8_DTYPE = torch.float8_e4m3fn              # a lo table stored as fp8 (kernels.common.lo8)


def as_kernel_dtype(dt: torch.dtype, q, k, v, g, beta, do):
    """q, k, v, do converted to ``dt`` (the kernels' input dtype where it is not the caller's: bf16 inputs through
    the fp16 kernels; exact for bf16 values within fp16's normal range), g and beta in the input dtype to fp32: the
    emulation's form of ``gdn_bwd_convert``."""
    f32 = lambda t: t.float() if t.dtype in INPUT_DTYPES else t    # noqa: E731
    return q.to(dt), k.to(dt), v.to(dt), f32(g), f32(beta), do.to(dt)


def lo8_shift(dt: torch.dtype) -> int:
    """Mantissa bits + 1 of a lo8 hi term's dtype (bf16: 8, fp16: 11): a lo term is at most 2^-shift times its hi
    term's power of two."""
    return round(-math.log2(torch.finfo(dt).eps)) + 1        # eps = 2^-(mantissa bits)


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, require_cuda: bool = True):
    """Raise ValueError naming the first bad argument; return (B, T, H, HV, K, V, N), N the number of sequences.
    ``require_cuda=False`` accepts any device (the CPU emulation, shape propagation), one for all tensors."""
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
    if q.dtype not in INPUT_DTYPES:
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
    if require_cuda and dev.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device (sm_90), got {dev}")
    others = dict(tensors, initial_state=initial_state)  # cu_seqlens may be on the host or the device
    for name, x in others.items():
        if x is not None and x.device != dev:
            raise ValueError(f"{name} is on {x.device}, expected {dev} like q")
    return B, T, H, HV, K, V, N


CACHE_ENTRIES = 64                           # entries a per-layout host cache keeps before it is emptied


def cached(table: dict, key, make):
    """``table[key]``, made by ``make()`` where missing (None is a value like any other); a table holding more than
    ``CACHE_ENTRIES`` entries is emptied before the new one goes in.  The host caches of both directions (tables
    per layout, plans, stand-in tensors) share this."""
    try:
        return table[key]
    except KeyError:
        pass
    if len(table) > CACHE_ENTRIES:
        table.clear()
    value = table[key] = make()
    return value


_UNUSED: dict = {}


def unused(shape: tuple, dtype, dev) -> torch.Tensor:
    """A tensor for an argument that its kernel's flags switch off (never read, never written): one per (shape,
    dtype, device), kept for every later call."""
    return cached(_UNUSED, (shape, dtype, dev), lambda: torch.empty(shape, device=dev, dtype=dtype))


_DENSE_TABLES: dict = {}


_INDEX_ORDER: dict = {}


def index_order(n: int, dev) -> torch.Tensor:
    """``arange(n)`` int32 on ``dev``: a per-sequence kernel's ``seq_order`` that issues its sequences (or segments)
    in index order; one per (n, device), kept for every later call."""
    return cached(_INDEX_ORDER, (n, str(dev)), lambda: torch.arange(n, device=dev, dtype=torch.int32))


_CAPABILITY: dict = {}


_SIDE: dict = {}


def side_stream(dev):
    """The side stream of ``dev`` (one per device, created once) on which a pipeline runs kernels beside its main
    stream's; None off a GPU."""
    if dev.type != "cuda":
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx)
    return _SIDE[idx]


def require_sm90(dev, what: str):
    """Raise unless ``dev`` is an sm_90 (Hopper) GPU: the kernels are built for sm_90a.  The capability of a device
    with an index is asked once (a call's host time)."""
    key = (dev.type, dev.index)
    cap = _CAPABILITY.get(key)
    if cap is None:
        cap = torch.cuda.get_device_capability(dev)
        if dev.index is not None:
            _CAPABILITY[key] = cap
    major, minor = cap
    if (major, minor) != (9, 0):
        raise RuntimeError(f"{what} is built for sm_90a (Hopper); device is sm_{major}{minor}")


def seq_tables(B, T, cu_seqlens, dev, cu_host=None):
    """cu_seqlens (int32), chunk_indices [NC, 2] (int32), chunk_offsets [N + 1] (int32), NC, seq_order [N] (int32:
    the sequences by decreasing chunk count, ties in index order; ``longest_first``).

    Dense tables are built on the device without a host sync and cached per (B, T, device); varlen tables
    from ``cu_host`` (cu_seqlens as a host list) when the caller already has it, else with one host sync."""
    if cu_seqlens is None:
        return cached(_DENSE_TABLES, (B, T, str(dev)), lambda: _dense_tables(B, T, dev))
    return _varlen_tables(T, cu_seqlens, dev, cu_host)


def _dense_tables(B, T, dev):
    nt = -(-T // BT)
    cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * T
    offs = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * nt
    seq = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(nt)
    ic = torch.arange(nt, device=dev, dtype=torch.int32).repeat(B)
    order = torch.arange(B, device=dev, dtype=torch.int32)
    return cu, torch.stack([seq, ic], 1).contiguous(), offs, B * nt, order


def longest_first(chunks: list[int]) -> list[int]:
    """The sequence indices by decreasing chunk count, ties in index order: the order in which a kernel with one
    CTA per (head, sequence) issues its sequences' CTAs, so that the longest start first and the short ones fill
    the SMs at the end (longest processing time first)."""
    return sorted(range(len(chunks)), key=lambda n: (-chunks[n], n))


def host_list(cu_seqlens) -> list[int]:
    """cu_seqlens as a host list of ints (one device -> host copy)."""
    return [int(x) for x in cu_seqlens.tolist()]


_VARLEN_LAST: dict = {}


def call_tables(B, T, cu_seqlens, dev):
    """``(cu_host, seq_tables(...))`` of a call (``cu_host`` None for dense input).  A varlen call reuses the
    previous call's when ``cu_seqlens`` is the same tensor object, unmodified (same ``_version``), with the same T
    and device: a model calls the kernel once per layer with one ``cu_seqlens``, and only the first call then pays
    the device -> host copy (a sync) and the host-side table build.  (FLA caches its chunk indices by tensor
    identity the same way.)  The cache holds a reference to that one tensor, so its memory cannot be reused by
    another tensor while it is cached.  An inference tensor (made under ``torch.inference_mode()``, as engines make
    their metadata) has no version counter, so an in-place change could not be seen: its tables are built on every
    call (one device -> host copy each)."""
    if cu_seqlens is None:
        return None, seq_tables(B, T, None, dev)
    tracked = not cu_seqlens.is_inference()
    last = _VARLEN_LAST.get("entry")     # one tuple, replaced in one assignment: no torn key / value pair
    if (tracked and last is not None and last[0] is cu_seqlens and last[1] == cu_seqlens._version and last[2] == T
            and last[3] == str(dev)):
        return last[4]
    cu_host = host_list(cu_seqlens)
    value = (cu_host, seq_tables(B, T, cu_seqlens, dev, cu_host))
    if tracked:
        _VARLEN_LAST["entry"] = (cu_seqlens, cu_seqlens._version, T, str(dev), value)
    return value


def _varlen_tables(T, cu_seqlens, dev, cu_host=None):
    if cu_host is None:
        cu_host = host_list(cu_seqlens)
    if cu_host[0] != 0 or cu_host[-1] > T:
        raise ValueError(f"cu_seqlens must start at 0 and end at most at T={T} (tokens past its end are padding), "
                         f"got {cu_host[0]} ... {cu_host[-1]}")
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
    chunks = [b - a for a, b in zip(offs, offs[1:])]
    order = torch.tensor(longest_first(chunks), dtype=torch.int32).to(dev, non_blocking=True)
    return cu, ci, co, len(idx), order




def token_count(B: int, T: int, cu_host) -> int:
    """Tokens in sequences: B * T dense, ``cu_seqlens[-1]`` varlen (``<= T``: the rest is padding)."""
    return B * T if cu_host is None else cu_host[-1]


def token_rows(x, n: int):
    """The first ``n`` token rows of ``x [Ttot, ...]`` (a contiguous view of contiguous ``x``): what the kernels
    see of a padded varlen call, so that no padding token is ever read."""
    return x if n == x.shape[0] else x[:n]


def pad_rows(x, n: int):
    """``x [Ttot', ...]`` zero-padded to ``n`` token rows: the outputs of a padded varlen call (zero past the last
    sequence); ``x`` itself when it has ``n`` rows."""
    if x.shape[0] == n:
        return x
    out = x.new_zeros((n, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def tma_ready(x):
    """``x`` contiguous with a 16-byte aligned base (TMA descriptors need it; odd views are copied)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def fp32_state(x):
    """A state-shaped tensor ``[N, HV, K, V]`` as contiguous fp32 (``x`` itself when it already is)."""
    return x.to(torch.float32).contiguous()


def max_chunks(B: int, T: int, cu_host) -> int:
    """Chunks of the longest sequence (dense when ``cu_host`` is None)."""
    if cu_host is None:
        return -(-T // BT)
    return max([-(-(cu_host[i + 1] - cu_host[i]) // BT) for i in range(len(cu_host) - 1)] + [0])
