#!/usr/bin/env bash
# Compile every kernel configuration of ours here (sm_90a: nvcc, no GPU) into an empty TileLang cache and pack it
# for an offline GPU box as scripts/gpu_save_caches.sh packs a box's own: .gpu/tilelang-cache.tar.xz.part-*, which
# scripts/gpu_env.sh unpacks into ~/.tilelang/cache there (only where that cache does not exist yet).
#
#   scripts/pack_kernel_cache.sh [WORKERS]     # WORKERS compile processes (default 2)
#
# TileLang 0.1.15 keys a cached kernel by its TIR, the explicit target (cuda, sm_90a), the pass configs and its own
# version and platform (tilelang/cache/kernel_cache.py, without TILELANG_KERNEL_CACHE_USE_LIB_STAMP), so a box with
# the same tilelang version loads these kernels instead of compiling them. The box's own cache, saved by
# gpu_save_caches.sh, takes the same file names: the last one written to .gpu/ is the one restored.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
workers=${1:-2}
py=.venv/bin/python
[ -x "$py" ] || py=python3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# with the kernels of the plans the GPU tests force beyond that list (tests/test_gpu_test_plans.py: UNBUILT)
TILELANG_CACHE_DIR=$dir/.tilelang/cache "$py" -c "
import sys
from kernels.build import all_configs, precompile
from tests.test_gpu_test_plans import UNBUILT
sys.exit(1 if precompile(all_configs() + UNBUILT, $workers) else 0)"
mkdir -p .gpu
rm -f .gpu/tilelang-cache.tar.xz.part-*
tar -cf - -C "$dir" .tilelang/cache | xz -T0 -9 --block-size=48MiB | split -b 15m - .gpu/tilelang-cache.tar.xz.part-
echo "$(ls "$dir"/.tilelang/cache/*/linux-x86_64/kernels | wc -l) kernels"
ls -la .gpu/tilelang-cache.tar.xz.part-*
