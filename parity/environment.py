"""The machine a run happened on: GPU, driver, CUDA, package versions, git commit. Nothing here imports a
GPU package: versions come from package metadata."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from parity.backends.base import package_version

PACKAGES = ("torch", "triton", "tilelang", "fla-core", "flash-qla", "flashinfer-python", "vllm", "sglang", "numpy",
            "pandas")
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    """commit and dirty (uncommitted changes to tracked files).  GDN_PARITY_COMMIT / GDN_PARITY_DIRTY win when set:
    scripts/gpu_env.sh sets them from .gpu/COMMIT on a GPU box, whose copy of the working tree may carry a stale
    .git of an earlier commit (HEAD of an older checkout, reported "dirty")."""
    env_commit = os.environ.get("GDN_PARITY_COMMIT")
    if env_commit:
        dirty = os.environ.get("GDN_PARITY_DIRTY")
        return {"commit": env_commit, "dirty": None if dirty is None else dirty == "1"}
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def gpu_info() -> dict:
    """GPU name, count, compute capability, memory, driver and CUDA runtime; empty values without a GPU."""
    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_count": 0, "sm": None, "gpu_mem_gib": None, "driver": None,
                "cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_count": torch.cuda.device_count(), "sm": f"{props.major}{props.minor}",
            "gpu_mem_gib": round(props.total_memory / 2**30, 1), "driver": _driver(), "cuda": torch.version.cuda}


def collect() -> dict:
    """Everything a result file records about the machine and the code."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **gpu_info(),
        "packages": {p: package_version(p) for p in PACKAGES},
        "git": git_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_tag(env: dict) -> str:
    """A short name for file and run ids: the GPU model ('h200') or 'cpu'."""
    if not env.get("gpu"):
        return "cpu"
    name = env["gpu"].lower().replace("nvidia", "").strip()
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").split("-")[0] or "gpu"
