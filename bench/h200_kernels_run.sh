#!/usr/bin/env bash
# One device call (H200) that checks and times the kernels of a build against SPEC sections 4 and
# 5 and the Gemma-3 oracle (issue 17). The carried folder $K (default build-kern) holds
# bundle.tar.xz: libattngrad.so, attngrad_gpu_tests, attngrad_attention_tests, attngrad_bench and
# attngrad_attention_bench of this build, base/attngrad_bench and base/attngrad_attention_bench
# (the build it is compared with) and lib/ (libopenblas.so.0, libgfortran.so.5, libquadmath.so.0);
# the checkers are the tree's bench/check_torch.py and bench/check_gemma3.py. In order:
#   1. in the background: the GPU tests and the attention kernel tests;
#   2. check_torch.py: AUTO in CHECK_ROUNDS rounds, FP16/TF32/FP32 in MODE_ROUNDS, AUTO at the
#      grad_output scales 1e-7 and 3e4 (2 rounds each), then check_gemma3.py against transformers;
#   3. timing once the checks are done: the attention kernels alone (this build, then base), then
#      attngrad_bench of this build and of base alternated ROUNDS times (SPEC section 5), the
#      per-stage view at STAGE_WORKLOADS, and check_torch.py's own timing with PyTorch (eager fp32,
#      eager TF32, torch.compile TF32) in the same call.
# Logs go to $OUT (at most 8 files come back); a compact summary is printed last.
set -u
K=${K:-build-kern}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$K" bundle.tar.xz

run_test() {  # $1 binary, $2 gtest filter, $3 log
  (timeout "${TEST_LIMIT:-300}" "$K/$1" --gtest_filter="$2" > "$OUT/$3" 2>&1
   echo "exit $?" >> "$OUT/$3") &
}
run_test attngrad_attention_tests '*' attention_tests.log
run_test attngrad_gpu_tests '*' gpu_tests.log

check() {  # extra check_torch.py arguments
  timeout "${CHECK_LIMIT:-300}" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-time "$@" \
    >> "$OUT/check.log" 2>&1
  echo "check $* exit $?" >> "$OUT/check.log"
}
check --rounds "${CHECK_ROUNDS:-10}" --modes AUTO,FP16,TF32,FP32 \
  --mode-rounds "${MODE_ROUNDS:-FP16=2,TF32=2,FP32=1}"
check --rounds 2 --modes AUTO --grad-output-scale 1e-7
check --rounds 2 --modes AUTO --grad-output-scale 3e4
timeout "${GEMMA_LIMIT:-200}" python3 bench/check_gemma3.py --lib "$K/libattngrad.so" \
  --shapes "${SHAPES:-1:1,2:7,1:1000,2:2500}" >> "$OUT/check.log" 2>&1
echo "gemma3 check exit $?" >> "$OUT/check.log"
wait
date -u +"checks done %T UTC" | tee -a "$INFO"

for build in "$K" "$K/base"; do
  echo "==== attention $build" >> "$OUT/attention_bench.log"
  timeout 120 "$build/attngrad_attention_bench" --time-only >> "$OUT/attention_bench.log" 2>&1
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for build in "$K" "$K/base"; do
    echo "==== bench $build round $round" >> "$OUT/bench.log"
    timeout 120 "$build/attngrad_bench" >> "$OUT/bench.log" 2>&1
  done
done
echo "==== stages" >> "$OUT/bench.log"
timeout 60 "$K/attngrad_bench" --stages --workloads="${STAGE_WORKLOADS:-1:128,2:2048,16:256}" \
  >> "$OUT/bench.log" 2>&1
timeout "${TORCH_LIMIT:-240}" python3 bench/check_torch.py --lib "$K/libattngrad.so" --no-check \
  > "$OUT/torch_time.log" 2>&1
echo "torch timing exit $?" >> "$OUT/torch_time.log"
date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
for f in "$OUT"/attention_tests.log "$OUT"/gpu_tests.log; do
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit" "$f" | head -20
done
grep -E "FAIL|exit|correctness" "$OUT/check.log" | head -40
echo "gemma3 PASS lines: $(grep -c PASS "$OUT/check.log")"
grep -E "^====|geomean|^time fp16 auto" "$OUT/attention_bench.log" | head -40
grep -E "^====|geomean" "$OUT/bench.log"
grep -E "geomean|speed-up|exit" "$OUT/torch_time.log" | head -20
