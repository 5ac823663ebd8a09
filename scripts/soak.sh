#!/usr/bin/env bash
# The long soak and chaos run: tests/server/soak_test.cc (attngrad_soak_test) for a
# chosen duration and devices, writing the server's RSS over time as CSV, then a summary.
#   scripts/soak.sh [--duration SECONDS] [--devices cpu|0|0,1] [--trainers N] [--victims N]
#                   [--batches N] [--seq-len S] [--pause-ms MS] [--cpu-threads N] [--model NAME]
#                   [--csv FILE] [--build-dir DIR]
# Defaults: 1800 s, cpu, 3 trainers, 1 killed client at a time, 6 batches a round, S = 8, no pause,
# 2 CPU threads, gemma-3-270m layer 0 on the CPU and the SPEC layer ("spec") on GPUs (the GPU
# kernels serve head_dim 128 only), CSV soak-<devices>-<UTC time>.csv, build-cpu/ (CPU) or build/.
# The CSV: seconds,rss_kib,acknowledged,windows,errors (one line a second). Exit status: the test's.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=1800
devices=cpu
model=
build_dir=
csv=
export ATTNGRAD_SOAK_TRAINERS=${ATTNGRAD_SOAK_TRAINERS:-3}
export ATTNGRAD_SOAK_VICTIMS=${ATTNGRAD_SOAK_VICTIMS:-1}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --devices) devices=$2; shift 2 ;;
    --trainers) export ATTNGRAD_SOAK_TRAINERS=$2; shift 2 ;;
    --victims) export ATTNGRAD_SOAK_VICTIMS=$2; shift 2 ;;
    --batches) export ATTNGRAD_SOAK_BATCHES=$2; shift 2 ;;
    --seq-len) export ATTNGRAD_SOAK_SEQ_LEN=$2; shift 2 ;;
    --pause-ms) export ATTNGRAD_SOAK_PAUSE_MS=$2; shift 2 ;;
    --cpu-threads) export ATTNGRAD_SOAK_CPU_THREADS=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --csv) csv=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "soak: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ -z $model ]]; then
  if [[ $devices == cpu ]]; then model=gemma-3-270m; else model=spec; fi
fi
if [[ -z $build_dir ]]; then
  if [[ $devices == cpu && -d build-cpu ]]; then build_dir=build-cpu; else build_dir=build; fi
fi
csv=${csv:-soak-${devices//,/_}-$(date -u +%Y%m%dT%H%M%SZ).csv}
binary=$build_dir/tests/server/attngrad_soak_test
[[ -x $binary ]] || { echo "soak: $binary is not built (cmake --build $build_dir --target attngrad_soak_test)" >&2; exit 2; }

export ATTNGRAD_SOAK_SECONDS=$duration ATTNGRAD_SOAK_DEVICES=$devices ATTNGRAD_SOAK_MODEL=$model
export ATTNGRAD_SOAK_CSV=$csv
echo "soak: $duration s on $devices ($model), $ATTNGRAD_SOAK_TRAINERS trainers, RSS to $csv"
status=0
"$binary" --gtest_filter='SoakTest.*' || status=$?
if [[ -s $csv ]]; then
  awk -F, 'NR == 2 { start = $2 } NR > 1 { if ($2 > max) max = $2; end = $2; t = $1; acked = $3; windows = $4; errors = $5 }
    END { printf "soak summary: %.0f s, RSS start %.1f MiB, end %.1f MiB, max %.1f MiB; %d batches acknowledged and verified in %d windows; %d unexpected errors\n",
          t, start / 1024, end / 1024, max / 1024, acked, windows, errors }' "$csv"
fi
exit $status
