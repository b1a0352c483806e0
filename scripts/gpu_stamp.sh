#!/usr/bin/env bash
# Before copying the tree to a GPU box: record the commit (and whether tracked files are modified) in
# .gpu/COMMIT, since the copy of the working tree on the GPU box has no git metadata. gpu_env.sh exports it there for the result files.
cd "$(git rev-parse --show-toplevel)" || exit 1
dirty=0; [ -n "$(git status --porcelain --untracked-files=no)" ] && dirty=1
mkdir -p .gpu && echo "$(git rev-parse HEAD) $dirty" > .gpu/COMMIT && cat .gpu/COMMIT
