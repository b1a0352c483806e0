#!/usr/bin/env bash
# Pack the pure-Python packages the GPU box lacks (pytest-xdist and execnet) from this machine's .venv into
# .gpu/pyextra.tar.xz; scripts/gpu_env.sh unpacks them into /tmp/site there. Pure Python: the .venv's Python
# version does not matter.
cd "$(git rev-parse --show-toplevel)" || exit 1
sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cd "$sp" || exit 1
tar -cJf "$OLDPWD/.gpu/pyextra.tar.xz" xdist pytest_xdist-*.dist-info execnet execnet-*.dist-info && ls -la "$OLDPWD/.gpu/pyextra.tar.xz"
