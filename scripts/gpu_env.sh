# Source this on an offline GPU box, from the repo root, with .gpu/ copied along (README: "On the offline H200 box"):
#   . scripts/gpu_env.sh
# Unpacks the tilelang / flash-qla / fla-core bundle once per machine, restores the compile caches that an
# earlier run saved with scripts/gpu_save_caches.sh (or FlashQLA's prebuilt TileLang cache), and sets
# PYTHONPATH so that `python3 -m parity ...` runs without installing anything.
if [ ! -d /tmp/site/tilelang ]; then
  mkdir -p /tmp/site && tar -xJf .gpu/gpu-site.tar.xz -C /tmp/site
fi
# pure-Python extras the box lacks (pytest-xdist and execnet, from this machine's .venv: scripts/gpu_pyextra.sh)
if [ -f .gpu/pyextra.tar.xz ] && [ ! -d /tmp/site/xdist ]; then tar -xJf .gpu/pyextra.tar.xz -C /tmp/site; fi
# compile caches saved by scripts/gpu_save_caches.sh (xz parts) or older single .tgz files
restore() {  # restore NAME DIR-under-HOME
  [ -d "$HOME/$2" ] && return 0
  if ls .gpu/"$1".tar.xz.part-* >/dev/null 2>&1; then cat .gpu/"$1".tar.xz.part-* | xz -d | tar -xf - -C "$HOME"
  elif [ -f .gpu/"$1".tgz ]; then tar -xzf .gpu/"$1".tgz -C "$HOME"; fi
}
fresh_tilelang=0; [ -d "$HOME/.tilelang/cache" ] || fresh_tilelang=1
restore tilelang-cache .tilelang/cache
restore triton-cache .triton/cache
# FlashQLA's prebuilt kernels (the bundle's tilelang-cache-flashqla.tgz) join a saved cache of ours: a cache saved
# by a run that never called FlashQLA lacks them, and compiling them cold takes minutes
if [ "$fresh_tilelang" = 1 ] && [ -f .gpu/tilelang-cache-flashqla.tgz ]; then
  tar -xzf .gpu/tilelang-cache-flashqla.tgz -C "$HOME" --skip-old-files
fi
# Triton keeps autotuning results in its cache: FLA's autotuned kernels then skip benchmarking every config
export TRITON_CACHE_AUTOTUNING=1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GDN_PARITY_CACHE=/tmp/gdn-parity-ref
# the commit this working tree came from (written by scripts/gpu_stamp.sh before the tree is copied to the box)
if [ -f .gpu/COMMIT ]; then read -r GDN_PARITY_COMMIT GDN_PARITY_DIRTY < .gpu/COMMIT; export GDN_PARITY_COMMIT GDN_PARITY_DIRTY; fi
