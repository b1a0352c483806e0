"""Shrink a Triton cache to what loading a compiled kernel needs: its metadata (.json) and binary (.cubin / .hsaco).

    python3 scripts/prune_triton_cache.py ~/.triton/cache [--dry-run]

Triton keeps every stage of a compile (source, ttir, ttgir, llir, ptx: ~80% of the bytes) next to the binary, and a
group file ``__grp__NAME.json`` that lists them; a cached kernel counts as present only if every listed file exists
(``FileCacheManager.get_group``), and loading it reads the metadata and the binary alone (``CompiledKernel``). This
rewrites each group to its metadata and binary and deletes the other stages, so that the cache (autotuning results
included) fits a small copy limit next to the package bundle. Files outside any group (autotuning results, launcher
``.so``) stay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

KEEP = (".json", ".cubin", ".hsaco")


def prune(root: str, dry_run: bool = False) -> tuple[int, int]:
    """Rewrite every group under ``root``; return (groups rewritten, bytes deleted)."""
    groups = deleted = 0
    for d, _, files in os.walk(root):
        for f in files:
            if not (f.startswith("__grp__") and f.endswith(".json")):
                continue
            path = os.path.join(d, f)
            try:
                with open(path) as fh:
                    children = json.load(fh)["child_paths"]
            except (OSError, ValueError, KeyError):
                continue                                   # not a group file Triton would use either
            keep = {c: p for c, p in children.items() if c.endswith(KEEP)}
            if len(keep) == len(children):
                continue
            for c in children:
                if c not in keep:
                    local = os.path.join(d, os.path.basename(c))   # the group's paths are absolute, from the box
                    if os.path.exists(local):
                        deleted += os.path.getsize(local)
                        if not dry_run:
                            os.remove(local)
            if not dry_run:
                with open(path, "w") as fh:
                    json.dump({"child_paths": keep}, fh)
            groups += 1
    return groups, deleted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    groups, deleted = prune(args.root, args.dry_run)
    print(f"{'would prune' if args.dry_run else 'pruned'} {groups} kernels, {deleted / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
