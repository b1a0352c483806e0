# Source this on the offline GPU box after scripts/gpu_env.sh, from the repo root, with .gpu/ carried:
#   . scripts/gpu_env.sh && . scripts/flashinfer_env.sh
# Unpacks the FlashInfer GDN bundle (.gpu/flashinfer-gdn-site.tar.xz.part-*, made by make-flashinfer-bundle.sh:
# flashinfer-python 0.7.2.post1, nvidia-cutlass-dsl 4.8.1 with its cu13 libraries, apache-tvm-ffi 0.1.15, cuda-tile,
# the cuDNN frontend) once per machine into /tmp/fisite and appends it and nvidia_cutlass_dsl/dsl_packages (what the
# bundle's .pth file would add in a real install) to PYTHONPATH.
# The bundle goes after /tmp/site: TileLang 0.1.15 needs apache-tvm-ffi < 0.1.13 (/tmp/site has 0.1.12) and
# FlashInfer accepts >= 0.1.11, < 0.2, so both import the same tvm_ffi. FLASHINFER_SITE_FIRST=1 puts the bundle (and
# its tvm-ffi 0.1.15) first instead, for a FlashInfer-only run.
if ! ls .gpu/flashinfer-gdn-site.tar.xz.part-* >/dev/null 2>&1; then
  echo "flashinfer_env.sh: no .gpu/flashinfer-gdn-site.tar.xz.part-* here (copy them next to gpu-site.tar.xz)" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -d /tmp/fisite/flashinfer ]; then
  mkdir -p /tmp/fisite && cat .gpu/flashinfer-gdn-site.tar.xz.part-* | xz -d | tar -x -C /tmp/fisite || {
    echo "flashinfer_env.sh: unpacking .gpu/flashinfer-gdn-site.tar.xz.part-* failed" >&2; rm -rf /tmp/fisite
    return 1 2>/dev/null || exit 1; }
fi
FISITE=/tmp/fisite:/tmp/fisite/nvidia_cutlass_dsl/dsl_packages
if [ "${FLASHINFER_SITE_FIRST:-0}" = 1 ]; then export PYTHONPATH=$FISITE:$PYTHONPATH
else export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$FISITE; fi
unset FISITE
