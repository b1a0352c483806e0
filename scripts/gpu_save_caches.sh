#!/usr/bin/env bash
# Pack the TileLang and Triton compile caches into DIR (default $OUT) so the next GPU call can start warm:
# copy them into .gpu/ here and gpu_env.sh restores them there.
out=${1:-$OUT}
mkdir -p "$out"
[ -d "$HOME/.tilelang/cache" ] && tar -czf "$out/tilelang-cache.tgz" -C "$HOME" .tilelang/cache
[ -d "$HOME/.triton/cache" ] && tar -czf "$out/triton-cache.tgz" -C "$HOME" .triton/cache
ls -la "$out"/*.tgz 2>/dev/null
exit 0
