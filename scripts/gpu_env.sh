# Source this on the offline GPU box (see ../shared/gpu/README.md), from the repo root, with .gpu/ carried:
#   . scripts/gpu_env.sh
# Unpacks the tilelang / flash-qla / fla-core bundle once per machine, restores the compile caches that an
# earlier call saved with scripts/gpu_save_caches.sh (or FlashQLA's prebuilt TileLang cache), and sets
# PYTHONPATH so that `python3 -m parity ...` runs without installing anything.
if [ ! -d /tmp/site/tilelang ]; then
  mkdir -p /tmp/site && tar -xJf .gpu/gpu-site.tar.xz -C /tmp/site
fi
if [ ! -d "$HOME/.tilelang/cache" ]; then
  if [ -f .gpu/tilelang-cache.tgz ]; then tar -xzf .gpu/tilelang-cache.tgz -C "$HOME"
  else tar -xzf .gpu/tilelang-cache-flashqla.tgz -C "$HOME"; fi
fi
if [ -f .gpu/triton-cache.tgz ] && [ ! -d "$HOME/.triton/cache" ]; then tar -xzf .gpu/triton-cache.tgz -C "$HOME"; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GDN_PARITY_CACHE=/tmp/gdn-parity-ref
# the commit this working tree came from (written here by scripts/gpu_stamp.sh before the call)
if [ -f .gpu/COMMIT ]; then read -r GDN_PARITY_COMMIT GDN_PARITY_DIRTY < .gpu/COMMIT; export GDN_PARITY_COMMIT GDN_PARITY_DIRTY; fi
