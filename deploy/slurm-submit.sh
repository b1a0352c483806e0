#!/usr/bin/env bash
# Submit gdn-parity's sweep to Slurm: an array of GDN_PARITY_SHARDS tasks (deploy/slurm.sbatch) and a merge job
# that runs once every task has succeeded. Run from the repository root; extra arguments go to both sbatch calls
# (e.g. --partition=h200 --account=me). Environment: GDN_PARITY_SHARDS (default 8), GDN_PARITY_OUT (default
# reports/slurm-<UTC time>), GDN_PARITY_ARGS and PYTHON as deploy/run-shard.sh reads them.
set -euo pipefail
export GDN_PARITY_SHARDS=${GDN_PARITY_SHARDS:-8}
export GDN_PARITY_OUT=${GDN_PARITY_OUT:-$PWD/reports/slurm-$(date -u +%Y%m%d-%H%M%S)}
array=$(sbatch --parsable --array=0-$((GDN_PARITY_SHARDS - 1)) "$@" deploy/slurm.sbatch)
merge=$(sbatch --parsable --dependency=afterok:"${array%%;*}" --job-name=gdn-parity-merge --ntasks=1 \
        --time=00:30:00 --output=gdn-parity-merge-%j.log "$@" deploy/merge.sh)
echo "array job ${array%%;*} ($GDN_PARITY_SHARDS shards), merge job ${merge%%;*} -> $GDN_PARITY_OUT/results.jsonl"
