#!/usr/bin/env bash
# One shard of a gdn-parity sweep, as a Slurm array task or a Kubernetes Indexed Job pod runs it.
# The shard comes from the scheduler's index (python -m parity run --shard auto, parity/scheduler.py); the rows go
# to $GDN_PARITY_OUT/shard-<index>.jsonl. A task that is run again continues its file (--resume).
#   GDN_PARITY_OUT   folder every shard and the merge can reach (required)
#   GDN_PARITY_ARGS  selection for `parity run`, split on whitespace (default: --matrix full)
#   PYTHON           the interpreter with gdn-parity installed (default: python3)
set -euo pipefail
: "${GDN_PARITY_OUT:?set GDN_PARITY_OUT to a folder that every shard and the merge can reach}"
index=${SLURM_ARRAY_TASK_ID:-${JOB_COMPLETION_INDEX:-}}
: "${index:?neither SLURM_ARRAY_TASK_ID (Slurm job array) nor JOB_COMPLETION_INDEX (Kubernetes Indexed Job) is set}"
read -r -a selection <<< "${GDN_PARITY_ARGS:---matrix full}"
mkdir -p "$GDN_PARITY_OUT"
exec "${PYTHON:-python3}" -m parity run --shard auto --resume --no-report --no-progress \
    --out "$GDN_PARITY_OUT/shard-$index.jsonl" "${selection[@]}"
