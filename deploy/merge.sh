#!/usr/bin/env bash
# Join the shards of a scheduled sweep ($GDN_PARITY_OUT/shard-*.jsonl) into $GDN_PARITY_OUT/results.jsonl and
# render report.md beside it. With GDN_PARITY_SHARDS set, refuses to merge while a shard's file is missing.
set -euo pipefail
: "${GDN_PARITY_OUT:?set GDN_PARITY_OUT to the folder of the shard files}"
shopt -s nullglob
shards=("$GDN_PARITY_OUT"/shard-*.jsonl)
if [ -n "${GDN_PARITY_SHARDS:-}" ] && [ "${#shards[@]}" -ne "$GDN_PARITY_SHARDS" ]; then
    echo "merge: ${#shards[@]} of GDN_PARITY_SHARDS=$GDN_PARITY_SHARDS shard files in $GDN_PARITY_OUT;" \
         "run the missing shards again (they resume), then merge" >&2
    exit 1
fi
if [ "${#shards[@]}" -eq 0 ]; then
    echo "merge: no shard-*.jsonl in $GDN_PARITY_OUT" >&2
    exit 1
fi
exec "${PYTHON:-python3}" -m parity merge "${shards[@]}" --out "$GDN_PARITY_OUT/results.jsonl"
