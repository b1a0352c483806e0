#!/usr/bin/env bash
# Pack the TileLang and Triton compile caches (Triton's with its autotuning results, see gpu_env.sh) into DIR
# (default $OUT) so the next run on a GPU box can start warm: copy them into .gpu/ and gpu_env.sh restores them.
# xz -9 (its 64 MB dictionary finds the many near-identical cache files: 40% smaller than -6), split into 15 MB
# parts (NAME.tar.xz.part-aa, -ab, ...), each small enough to move as a single file.
out=${1:-$OUT}
mkdir -p "$out"
pack() {  # pack NAME DIR-under-HOME
  [ -d "$HOME/$2" ] || return 0
  rm -f "$out/$1".tar.xz.part-*
  tar -cf - -C "$HOME" "$2" | xz -T0 -9 --block-size=48MiB | split -b 15m - "$out/$1.tar.xz.part-"
}
pack tilelang-cache .tilelang/cache
# Triton's compile stages other than the binary are ~80% of its cache (29 -> 5.6 MB packed on an H200)
[ -d "$HOME/.triton/cache" ] && python3 "$(dirname "$0")/prune_triton_cache.py" "$HOME/.triton/cache"
pack triton-cache .triton/cache
ls -la "$out"/*.part-* 2>/dev/null
exit 0
