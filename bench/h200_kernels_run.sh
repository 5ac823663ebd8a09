#!/usr/bin/env bash
# One device call (H200) that checks and times the kernels of a build against SPEC sections 4 and
# 5 and the Gemma-3 oracle. The carried folder $K (default build-kern) holds
# bundle.tar.xz: libattngrad.so, attngrad_gpu_tests, attngrad_attention_tests,
# attngrad_hopper_wgmma_tests, attngrad_bench and attngrad_attention_bench of this build,
# base/attngrad_bench (the build it is compared with), optionally more builds' attngrad_bench in
# folders named by VARIANTS, and lib/ (libopenblas.so.0, libgfortran.so.5, libquadmath.so.0):
# scripts/device/stage-kernels-bundle.sh makes it. The checkers are the tree's bench/check_torch.py
# and bench/check_gemma3.py. In order, each phase's
# summary printed when it ends (a call cut short still reports the phases it finished):
#   1. checks, all at once: the GPU tests (in SHARDS shards), the attention tests (in
#      ATTENTION_SHARDS shards) and the wgmma tests,
#      check_torch.py (AUTO in CHECK_ROUNDS rounds, FP16/TF32/FP32 in MODE_ROUNDS, AUTO at the
#      grad_output scales 1e-7 and 3e4) and check_gemma3.py against transformers at SHAPES;
#   2. attngrad_bench (SPEC section 5) of this build, the variants and base, alternated ROUNDS
#      times, then the per-stage view at STAGE_WORKLOADS;
#   3. the attention kernels alone (--time-only --fp16-only: both forward kernels per workload);
#   4. check_torch.py's timing of PyTorch (TORCH variants; TORCH=none skips it) and attngrad in
#      the same call; torch.compile's compilations are started beside phase 1 to fill its caches.
# STAGE_WORKLOADS= (empty) skips the per-stage view. CHECKS=0 skips phase 1 (about two of a call's
# minutes; the benches of phase 2 take seconds): for A/B timing of builds already checked, never
# for a recorded run.
# Logs go to $OUT: info.txt, checks_full.log, bench.log, attention_bench.log, torch_time.log (a
# call returns at most 8 files).
set -u
K=${K:-build-kern}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$K" bundle.tar.xz
LIMIT=${CHECK_LIMIT:-150}
if [ "${TORCH:-}" != none ]; then
  # torch.compile's first compilations (batch 1 and batch > 1: dynamic shapes specialise 1) run
  # beside the checks and fill the inductor and Triton caches that phase 4 then hits.
  (timeout "$LIMIT" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-check \
     --torch compile_tf32 --workloads 1:128,2:128 --torch-warmup 1 --torch-iters 1 \
     > "$OUT/torch_prewarm.log" 2>&1) &
fi

if [ "${CHECKS:-1}" != 0 ]; then
  run_test() {  # $1 binary, $2 log, then the environment's shard variables
    (timeout "$LIMIT" env "${@:3}" "$K/$1" > "$OUT/$2" 2>&1; echo "exit $?" >> "$OUT/$2") &
  }
  SHARDS=${SHARDS:-4}
  for shard in $(seq 0 $((SHARDS - 1))); do
    run_test attngrad_gpu_tests "gpu_tests_$shard.log" GTEST_TOTAL_SHARDS="$SHARDS" \
      GTEST_SHARD_INDEX="$shard"
  done
  ATTENTION_SHARDS=${ATTENTION_SHARDS:-1}
  for shard in $(seq 0 $((ATTENTION_SHARDS - 1))); do
    run_test attngrad_attention_tests "attention_tests_$shard.log" \
      GTEST_TOTAL_SHARDS="$ATTENTION_SHARDS" GTEST_SHARD_INDEX="$shard"
  done
  run_test attngrad_hopper_wgmma_tests wgmma_tests.log
  check() {  # $1 log, then check_torch.py's arguments
    local log=$1
    shift
    (timeout "$LIMIT" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-time "$@" \
       > "$OUT/$log" 2>&1; echo "check $* exit $?" >> "$OUT/$log") &
  }
  check check_auto.log --rounds "${CHECK_ROUNDS:-3}" --modes AUTO
  check check_modes.log --rounds 1 --modes FP16,TF32,FP32 --mode-rounds "${MODE_ROUNDS:-FP32=1}"
  check check_scale_small.log --rounds 1 --modes AUTO --grad-output-scale 1e-7
  check check_scale_large.log --rounds 1 --modes AUTO --grad-output-scale 3e4
  (timeout "$LIMIT" python3 bench/check_gemma3.py --lib "$K/libattngrad.so" \
     --shapes "${SHAPES:-1:1000,2:7}" > "$OUT/gemma3.log" 2>&1; echo "gemma3 exit $?" >> "$OUT/gemma3.log") &
  wait
  date -u +"checks done %T UTC" | tee -a "$INFO"
  echo "==== checks"
  for f in "$OUT"/gpu_tests_*.log "$OUT"/attention_tests_*.log "$OUT"/wgmma_tests.log; do
    echo "-- $(basename "$f"): $(grep -E "^\[  PASSED|^exit" "$f" | tr '\n' ' ')"
    grep -E "^\[  FAILED  \]" "$f" | head -10
  done
  for f in "$OUT"/check_*.log "$OUT"/gemma3.log; do
    echo "-- $(basename "$f"): $(grep -E "^correctness|exit" "$f" | tr '\n' ' ')"
    grep -E "FAIL" "$f" | head -8
  done
  echo "gemma3 PASS lines: $(grep -c PASS "$OUT/gemma3.log")"
  tests=("$OUT"/gpu_tests_*.log "$OUT"/attention_tests_*.log "$OUT"/wgmma_tests.log "$OUT"/check_*.log
         "$OUT"/gemma3.log)
  cat "${tests[@]}" > "$OUT/checks_full.log"
  rm -f "${tests[@]}"
else
  wait  # the torch.compile warm-up, if any
  echo "==== checks skipped (CHECKS=0)"
fi

builds="$K ${VARIANTS:+$(for v in $VARIANTS; do printf '%s ' "$K/$v"; done)}$K/base"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for build in $builds; do
    echo "==== bench $build round $round" >> "$OUT/bench.log"
    timeout 90 "$build/attngrad_bench" >> "$OUT/bench.log" 2>&1
  done
done
if [ "${STAGE_WORKLOADS-1:128,2:2048,16:256}" != "" ]; then
  echo "==== stages" >> "$OUT/bench.log"
  timeout 60 "$K/attngrad_bench" --stages --workloads="${STAGE_WORKLOADS-1:128,2:2048,16:256}" \
    >> "$OUT/bench.log" 2>&1
fi
date -u +"bench done %T UTC" | tee -a "$INFO"
echo "==== bench"
grep -E "^====|geomean" "$OUT/bench.log"

timeout 60 "$K/attngrad_attention_bench" --time-only --fp16-only ${ATTENTION_FLAGS:-} \
  > "$OUT/attention_bench.log" 2>&1
echo "==== attention"
grep -E "geomean|^time fp16|^forward" "$OUT/attention_bench.log" | cut -c1-150 | head -40

[ "${TORCH:-}" = none ] && exit 0
timeout "${TORCH_LIMIT:-90}" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-check \
  --torch "${TORCH:-eager_tf32,compile_tf32}" --torch-warmup 3 --torch-iters 10 \
  > "$OUT/torch_time.log" 2>&1
echo "torch timing exit $?" >> "$OUT/torch_time.log"
date -u +"end %T UTC" | tee -a "$INFO"
echo "==== torch"
grep -vE "^$" "$OUT/torch_time.log" | tail -24
