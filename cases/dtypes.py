"""Short dtype names used in case ids, results and reports."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def to_torch(name: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16; ValueError naming the known names otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no short name; known: {', '.join(DTYPES)}") from None
