#!/usr/bin/env bash
# The GPU checks of the project, as steps of at most ~10 minutes each (SECONDS, default 540). Source
# scripts/gpu_env.sh first, then run the steps. On a 2-GPU machine, put one step on each GPU with
# CUDA_VISIBLE_DEVICES and `&`. Each step writes under OUT (default $OUT), so a timeout keeps what was done.
#
#   scripts/gpu_steps.sh standard [SECONDS]   # parity run --matrix standard (resumes OUT/std/results.jsonl)
#   scripts/gpu_steps.sh cold-standard [S]    # the same after emptying the compile caches: the cold timing (#3)
#   scripts/gpu_steps.sh cold-warmup [S]      # parity warmup --matrix standard on empty caches: cold compile alone
#   scripts/gpu_steps.sh warmup [S]           # parity warmup --matrix standard on the shared caches: run it on one
#       GPU while the pytest step runs on the other, so that the suite's first-use compiles are done in parallel
#   scripts/gpu_steps.sh pytest [SECONDS]     # pytest -m gpu --matrix standard -n $PT_WORKERS (default 6 xdist
#       processes on one GPU) (#6); junit XML + log. Or in two parts, one per GPU, e.g.
#       PT_TAG=a PYTEST_ARGS="tests/test_matrix.py tests/test_properties.py --backend fla-triton
#         --backend fla-dispatch --backend fla-recurrent"                    on GPU 0, and
#       PT_TAG=b PYTEST_ARGS="tests/test_matrix.py tests/test_properties.py tests/test_known_failures.py
#         tests/test_kernels_gpu.py tests/test_kernels_bwd_gpu.py --backend flash-qla --backend tilelang" on GPU 1
#   scripts/gpu_steps.sh engines [S]          # the FlashInfer paths (flashinfer, flashinfer-cake, cudnn) beside
#       fla-triton, flash-qla and tilelang on the T=20468 and varlen cases (#22); source scripts/flashinfer_env.sh first
#   scripts/gpu_steps.sh precompile [S]       # compile every forward and backward kernel configuration (shared cache)
#   scripts/gpu_steps.sh triton-check [S]     # one FLA Triton cell (forward + backward) on the restored Triton cache
#       (pruned by scripts/prune_triton_cache.py): if it errors, the cache is emptied and the calls compile cold
#   scripts/gpu_steps.sh kernels [S]          # every kernel GPU test file (run precompile first)
#   scripts/gpu_steps.sh kernels-fwd [S]      # tests/test_kernels_gpu.py + benchmarks/bench_kernels_fwd.py (#4)
#   scripts/gpu_steps.sh kernels-bwd [S]      # tests/test_kernels_bwd_gpu.py + benchmarks/bench_kernels_bwd.py (#7)
#   scripts/gpu_steps.sh bwd-ab [S]           # backward A/B (bench_kernels_bwd --ab: recompute overlap, cluster sums)
#   scripts/gpu_steps.sh fwd-ab [S]           # forward A/B: the GPU tests of tests/test_kernels_gpu.py matching
#       FWD_TESTS (a pytest -k expression; none if unset), then bench_kernels_fwd.py with the variants FWD_VARIANTS
#       (default "default,again,smem,occ", the stage columns beside them) and FWD_ARGS (default: no reference columns)
#   scripts/gpu_steps.sh refs [S]             # the forward, then the forward + backward benchmark with every reference
#       column (FLA Triton, FlashQLA; FlashInfer where scripts/flashinfer_env.sh was sourced), the default plan
#       only, REFS_ARGS (e.g. "--gates qwen" or "--no-check"); S per benchmark; then the compile caches into
#       OUT/c (scripts/gpu_save_caches.sh), FlashQLA's per-shape kernels included
#   scripts/gpu_steps.sh profile [S]          # Nsight Compute over one fwd+bwd call (benchmarks/profile_kernels.py;
#       PROFILE_SHAPE, and PROFILE_ARGS e.g. "--ab ours-no-cluster" or "--impl fla-triton")
#   scripts/gpu_steps.sh host [S]             # where a call's host time goes (benchmarks/profile_host.py): forward +
#       backward through autograd at HOST_SHAPES (default the two few-head shapes), its split between the forward,
#       the hand-off to autograd's device thread, the backward's body and the return, and the backward alone
#   scripts/gpu_steps.sh profile-source [S]   # Nsight Compute's per-instruction warp-state samples (SourceCounters) of
#       the kernels matching PROFILE_KERNELS (a regex, default "dqk|state_output_ws|dh_ws") in the same call: one
#       SASS listing per kernel (OUT/k/sass-KERNEL.csv) and scripts/ncu_stalls.py on each
#   scripts/gpu_steps.sh ab [S]               # a candidate's GPU tests (AB_TESTS: a pytest -k expression over
#       tests/test_kernels_bwd_gpu.py; none if unset), then the backward bench with the A/B columns AB_COLS (default
#       ours-again,ours-serial: the dispatched plan through the A/B path is the run's noise floor) and BENCH_ARGS (e.g. "--shapes A,B --no-check --skip FlashQLA") (#7); S per part
set -u
out=${OUT:?set OUT}
step=${1:?step}
secs=${2:-540}
t0=$(date +%s)
# SIGINT first, so that pytest and the runner write their summaries; KILL 20 s later
run() { timeout -s INT -k 20 "$secs" "$@"; }
# empty compile and reference caches of its own under DIR (not the shared ones: a step on the other GPU may use them)
empty_caches() {
  export TRITON_CACHE_DIR=$1/triton TILELANG_CACHE_DIR=$1/tilelang GDN_PARITY_CACHE=$1/ref
  rm -rf "$1"; mkdir -p "$1"
}
case "$step" in
  cold-warmup)
    empty_caches /tmp/coldw
    ;&
  warmup)
    mkdir -p "$out/std"
    run python3 -m parity warmup --matrix standard --timeout $((secs - 15)) > "$out/std/$step.json" 2> "$out/std/log-$step.txt"
    echo "$step rc=$? $(( $(date +%s) - t0 )) s"; cat "$out/std/$step.json" ;;
  cold-standard)
    empty_caches /tmp/cold
    ;&
  standard)
    mkdir -p "$out/std"
    extra=(); [ -f "$out/std/results.jsonl" ] && extra=(--resume)
    run python3 -m parity run --matrix standard --out "$out/std/results.jsonl" --no-progress "${extra[@]}" \
      > "$out/std/log-$step.txt" 2>&1
    echo "$step rc=$? $(( $(date +%s) - t0 )) s"; grep -v TileLang "$out/std/log-$step.txt" | tail -4 ;;
  engines)
    # the engine backends beside FLA Triton, FlashQLA and ours (#22): the standard matrix's T=20468 dense cases and
    # its varlen layouts, plus varlen-one at T=20468 (not in the matrix). Source scripts/flashinfer_env.sh first.
    mkdir -p "$out/eng"
    extra=(); [ -f "$out/eng/results.jsonl" ] && extra=(--resume)
    ids=(); for d in qwen-gates gauss-l2; do for g in fp32 bf16; do for s in 0 1 2; do
      ids+=(--case "varlen-one_B1_T20468_H4-HV8_K128-V128_bf16_g-${g}_beta-${g}_h0-none_${d}_s$s"); done; done; done
    run python3 -m parity run --matrix standard --case 'dense_B1_T20468_*' --case 'varlen-*' --case 'left-pad_*' \
      "${ids[@]}" --backends fla-triton,flash-qla,tilelang,flashinfer,flashinfer-cake,cudnn \
      --out "$out/eng/results.jsonl" --no-progress "${extra[@]}" > "$out/eng/log-$step.txt" 2>&1
    echo "$step rc=$? $(( $(date +%s) - t0 )) s"; grep -v TileLang "$out/eng/log-$step.txt" | tail -4
    python3 -m parity engines "$out/eng/results.jsonl" > "$out/eng/engines.md" 2>&1; cat "$out/eng/engines.md" ;;
  pytest)
    # PYTEST_ARGS selects a part (files, --backend ...), PT_TAG names its output folder: see the header
    d="$out/pt${PT_TAG:-}"; mkdir -p "$d"
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    # PT_WORKERS pytest-xdist processes on the one GPU (default 6; 0: no xdist), see gpu_env.sh for xdist
    nx=(); [ "${PT_WORKERS:-6}" != 0 ] && nx=(-n "${PT_WORKERS:-6}")
    GDN_PARITY_CACHE=/tmp/ref-pt${PT_TAG:-} run python3 -m pytest -m gpu --matrix standard -q -p no:cacheprovider \
      -rfEX --durations=15 --junitxml="$d/junit.xml" "${nx[@]}" ${PYTEST_ARGS:-} > "$d/pytest.txt" 2>&1
    echo "pytest${PT_TAG:-} rc=$? $(( $(date +%s) - t0 )) s"; tail -15 "$d/pytest.txt" ;;
  precompile)
    # every kernel configuration of the forward and the backward, and those the GPU tests' forced plans add
    # (tests/test_gpu_test_plans.py), into the shared TileLang cache (10 processes), so
    # that the steps after it (and pytest's workers) load instead of compiling the same kernels several times
    mkdir -p "$out/k"
    run python3 -c 'from kernels.build import all_configs, precompile
from tests.test_gpu_test_plans import UNBUILT
import sys
sys.exit(1 if precompile(all_configs() + UNBUILT, 10) else 0)' > "$out/k/precompile.txt" 2>&1
    echo "$step rc=$? $(( $(date +%s) - t0 )) s"; grep -v "TileLang\|Warning" "$out/k/precompile.txt" | grep "kernels in\|Error\|error" ;;
  triton-check)
    mkdir -p "$out/tc"
    run python3 -m parity run --case "${TC_CASE:-dense_B1_T1024_H4-HV8_K128-V128_bf16_g-fp32_beta-fp32_h0-none_gauss-l2_grad_s0}" \
      --backends fla-triton --workers 0 --warmup 0 --no-report --no-progress --out "$out/tc/results.jsonl" > "$out/tc/log.txt" 2>&1
    if python3 -c 'import json, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
rows = [r for r in rows if r.get("record") == "row" and r.get("backend") == "fla-triton"]
sys.exit(0 if rows and all(r.get("status") != "error" for r in rows) else 1)' "$out/tc/results.jsonl" 2>/dev/null; then
      echo "$step: the Triton cache works ($(( $(date +%s) - t0 )) s)"
    else
      rm -rf "$HOME/.triton/cache"; echo "$step: FLA Triton failed on the restored cache: emptied it"; tail -5 "$out/tc/log.txt"
    fi ;;
  kernels)
    # every kernel GPU test file (plans, stages, verdict rows, the torch.library op, padded varlen and in-kernel
    # gates, K = V = 64, the memory plan against the GPU), KT_WORKERS xdist processes (default 6); precompile first
    mkdir -p "$out/k"
    run python3 -m pytest -q -p no:cacheprovider -rfEs -n "${KT_WORKERS:-6}" -m gpu tests/test_kernels_gpu.py \
      tests/test_kernels_bwd_gpu.py tests/test_kernels_verdicts_gpu.py tests/test_kernels_library_gpu.py \
      tests/test_kernels_complete_gpu.py tests/test_kernels_head_dims.py tests/test_backward_memory_gpu.py \
      > "$out/k/test-kernels.txt" 2>&1
    echo "kernel tests rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/k/test-kernels.txt" | tail -20 ;;
  kernels-fwd)
    mkdir -p "$out/k"
    run python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py > "$out/k/test-fwd.txt" 2>&1
    echo "fwd tests rc=$?"; tail -3 "$out/k/test-fwd.txt"
    run python3 benchmarks/bench_kernels_fwd.py > "$out/k/bench-fwd.txt" 2>&1
    echo "fwd bench rc=$? $(( $(date +%s) - t0 )) s"; grep -A12 "== summary" "$out/k/bench-fwd.txt" ;;
  kernels-bwd)
    mkdir -p "$out/k"
    run python3 -m pytest -q -s -rs -p no:cacheprovider tests/test_kernels_bwd_gpu.py > "$out/k/test-bwd.txt" 2>&1
    echo "bwd tests rc=$?"; tail -20 "$out/k/test-bwd.txt"
    run python3 benchmarks/bench_kernels_bwd.py > "$out/k/bench-bwd.txt" 2>&1
    echo "bwd bench rc=$? $(( $(date +%s) - t0 )) s"; tail -25 "$out/k/bench-bwd.txt" ;;
  bwd-ab)
    mkdir -p "$out/k"
    run python3 benchmarks/bench_kernels_bwd.py --rep 10 --warmup 2 --ab ours-serial,ours-no-cluster \
      > "$out/k/bench-bwd-ab.txt" 2>&1
    echo "bwd A/B bench rc=$? $(( $(date +%s) - t0 )) s"; grep "stages" "$out/k/bench-bwd-ab.txt"
    grep -A8 "== summary" "$out/k/bench-bwd-ab.txt" ;;
  ab)
    mkdir -p "$out/k"
    if [ -n "${AB_TESTS:-}" ]; then
      run python3 -m pytest -q -s -p no:cacheprovider -rfE tests/test_kernels_bwd_gpu.py -k "$AB_TESTS" \
        > "$out/k/test-ab.txt" 2>&1
      echo "A/B tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$out/k/test-ab.txt"
    fi
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words (e.g. --shapes A,B --no-check)
    # --rep / --warmup are do_bench's milliseconds: 200 is ~25 calls at ~8 ms (10 would be one or two)
    run python3 benchmarks/bench_kernels_bwd.py --rep "${BENCH_REP:-200}" --warmup 30 --ab "${AB_COLS:-ours-again,ours-serial}" \
      --workers 14 ${BENCH_ARGS:-} > "$out/k/bench-bwd-cand.txt" 2>&1
    echo "A/B bench rc=$? $(( $(date +%s) - t0 )) s"; grep "stages\|check" "$out/k/bench-bwd-cand.txt"
    sed -n '/== summary/,$p' "$out/k/bench-bwd-cand.txt" ;;
  fwd-ab)
    mkdir -p "$out/k"
    if [ -n "${FWD_TESTS:-}" ]; then
      run python3 -m pytest -q -s -p no:cacheprovider -rfE -m gpu tests/test_kernels_gpu.py -k "$FWD_TESTS" \
        > "$out/k/test-fwd-ab.txt" 2>&1
      echo "forward A/B tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$out/k/test-fwd-ab.txt"
    fi
    # shellcheck disable=SC2086  # FWD_ARGS is a list of words
    run python3 benchmarks/bench_kernels_fwd.py --variants "${FWD_VARIANTS:-default,again,smem,occ}" --rep 30 --warmup 5 \
      ${FWD_ARGS:---no-check --skip FLA,FlashQLA,flashinfer} > "$out/k/bench-fwd-ab.txt" 2>&1
    echo "forward A/B bench rc=$? $(( $(date +%s) - t0 )) s"; sed -n '/== summary/,/^host ms/p' "$out/k/bench-fwd-ab.txt" ;;
  refs)
    mkdir -p "$out/k"
    # shellcheck disable=SC2086  # REFS_ARGS is a list of words
    run python3 benchmarks/bench_kernels_fwd.py --variants default --rep 30 --warmup 5 ${REFS_ARGS:-} \
      > "$out/k/bench-fwd-refs.txt" 2>&1
    echo "forward bench rc=$? $(( $(date +%s) - t0 )) s"; grep -A7 "== summary" "$out/k/bench-fwd-refs.txt"
    grep -A6 "^ratios" "$out/k/bench-fwd-refs.txt"
    # shellcheck disable=SC2086
    run python3 benchmarks/bench_kernels_bwd.py --rep 200 --warmup 30 --workers 14 ${REFS_ARGS:-} \
      > "$out/k/bench-bwd-refs.txt" 2>&1
    echo "fwd+bwd bench rc=$? $(( $(date +%s) - t0 )) s"; grep -A16 "== summary" "$out/k/bench-bwd-refs.txt"
    "$(dirname "$0")/gpu_save_caches.sh" "$out/c" > /dev/null ;;
  profile)
    # needs ncu's hardware counters: a container runtime that hides them (e.g. gVisor) makes ncu fail
    mkdir -p "$out/k"
    # + MemoryWorkloadAnalysis (Mem Busy, Max Bandwidth) and the shared-memory bank conflicts (NCU_METRICS)
    run ncu --clock-control none --nvtx --nvtx-include "gdn-profile/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      --metrics "${NCU_METRICS:-l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum}" \
      --csv --page details \
      python3 benchmarks/profile_kernels.py --shape "${PROFILE_SHAPE:-B1_T32768_H16_HV32}" ${PROFILE_ARGS:-} > "$out/k/ncu.csv" \
      2> "$out/k/ncu-log.txt"
    echo "profile rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$out/k/ncu-log.txt"
    python3 scripts/ncu_summary.py "$out/k/ncu.csv" | tee "$out/k/ncu-summary.txt" ;;
  host)
    mkdir -p "$out/k"
    for shape in ${HOST_SHAPES:-B1_T8192_H4_HV8 B1_T65536_H2_HV4}; do
      for dir in fwdbwd bwd; do
        run python3 benchmarks/profile_host.py --shape "$shape" --direction "$dir" --calls 20 --rows 40 --python 45 \
          > "$out/k/host-$shape-$dir.txt" 2>&1
        echo "host $shape $dir rc=$? $(( $(date +%s) - t0 )) s"; grep -E "per call|one call" "$out/k/host-$shape-$dir.txt"
      done
    done ;;
  profile-source)
    mkdir -p "$out/k"
    run ncu --clock-control none --nvtx --nvtx-include "gdn-profile/" \
      -k "regex:${PROFILE_KERNELS:-dqk|state_output_ws|dh_ws}" --section SourceCounters --section WarpStateStats \
      -o "$out/k/src" -f \
      python3 benchmarks/profile_kernels.py --shape "${PROFILE_SHAPE:-B1_T32768_H16_HV32}" ${PROFILE_ARGS:-} \
      > "$out/k/ncu-src-log.txt" 2>&1
    echo "profile-source rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$out/k/ncu-src-log.txt"
    # the kernel names of the report (its raw page: one row per launch under a numeric ID)
    names='import csv, sys; print(" ".join(sorted({r["Kernel Name"] for r in csv.DictReader(sys.stdin)
           if r["ID"].isdigit()})))'
    for k in $(ncu -i "$out/k/src.ncu-rep" --page raw --csv 2>/dev/null | python3 -c "$names"); do
      ncu -i "$out/k/src.ncu-rep" -k "$k" --page source --csv --print-source sass > "$out/k/sass-$k.csv"
      echo "== $k"; python3 scripts/ncu_stalls.py "$out/k/sass-$k.csv" --min 1.5 | tee "$out/k/stalls-$k.txt"
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
