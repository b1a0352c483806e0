"""scripts/prune_triton_cache.py on a synthetic Triton cache: each group keeps its metadata and binary, the other
compile stages are deleted, files outside groups and malformed groups are left alone."""

from __future__ import annotations

import json
from pathlib import Path

from tests.script_support import load_script

prune_mod = load_script("prune_triton_cache")

STAGES = ("source", "ttir", "ttgir", "llir", "ptx", "cubin", "json")


def _kernel(root: Path, h: str, name: str) -> Path:
    d = root / h
    d.mkdir(parents=True)
    children = {}
    for ext in STAGES:
        (d / f"{name}.{ext}").write_text(ext * 100)
        children[f"{name}.{ext}"] = f"/root/.triton/cache/{h}/{name}.{ext}"    # absolute, from another machine
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": children}))
    return d


def test_groups_keep_metadata_and_binary(tmp_path):
    d = _kernel(tmp_path, "AAA", "chunk_fwd_kernel")
    (tmp_path / "AAA" / "__triton_launcher.so").write_bytes(b"x" * 10)
    (tmp_path / "BBB").mkdir()
    (tmp_path / "BBB" / "__grp__broken.json").write_text("{not json")
    (tmp_path / "BBB" / "x.ptx").write_text("ptx")

    stage_bytes = sum(len(ext) * 100 for ext in STAGES if ext not in ("cubin", "json"))
    assert prune_mod.prune(str(tmp_path), dry_run=True) == (1, stage_bytes)      # nothing deleted yet
    assert (d / "chunk_fwd_kernel.ptx").exists()
    assert prune_mod.prune(str(tmp_path)) == (1, stage_bytes)
    left = sorted(p.name for p in d.iterdir())
    assert left == ["__grp__chunk_fwd_kernel.json", "__triton_launcher.so", "chunk_fwd_kernel.cubin",
                    "chunk_fwd_kernel.json"]
    grp = json.loads((d / "__grp__chunk_fwd_kernel.json").read_text())["child_paths"]
    assert sorted(grp) == ["chunk_fwd_kernel.cubin", "chunk_fwd_kernel.json"]
    assert (tmp_path / "BBB" / "x.ptx").exists()                  # not in a usable group: left alone
    assert prune_mod.prune(str(tmp_path)) == (0, 0)              # idempotent
