#!/usr/bin/env bash
# One device call (H200) for the head_dim 256 kernels. The carried folder $K
# (default build-k256) holds bundle.tar.xz: libattngrad.so, attngrad_gpu_tests,
# attngrad_attention_tests and attngrad_bench of this build, attngrad_bench_prev (the previous
# build, for the same-call A/B of the 16 SPEC workloads), lib/ (libopenblas.so.0, libgfortran.so.5,
# libquadmath.so.0) and check_gemma3.py. PHASE selects what runs:
#   check: the GPU tests and the attention kernel tests (in the background) while
#          check_gemma3.py checks every Gemma-3 layer against transformers; then one A/B round.
#   time:  check_gemma3.py --time (attngrad, eager TF32, then torch.compile) on TIME_SHAPES, then
#          ROUNDS A/B rounds of attngrad_bench.
#   compile: one check_gemma3.py process per (model, B×S) of COMPILE_MODELS × TIME_SHAPES, all at
#          once: each compiles the layer with torch.compile for its shape (in parallel with the
#          others), waits until all have compiled, then times attngrad, eager TF32 and the compiled
#          module while holding one lock (check_gemma3.py --timing-lock), so that no two processes
#          time at once and none times while another compiles.
#   all:   check and time, in that order.
# Logs go to $OUT (at most 8 files come back); a summary is printed last.
set -u
K=${K:-build-k256}
PHASE=${PHASE:-check}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$K" bundle.tar.xz

bench_ab() {  # $1 rounds: this build, then the previous one, alternating
  for round in $(seq 1 "$1"); do
    echo "==== new round $round" >> "$OUT/bench_ab.log"
    "$K/attngrad_bench" >> "$OUT/bench_ab.log" 2>&1
    echo "==== prev round $round" >> "$OUT/bench_ab.log"
    "$K/attngrad_bench_prev" >> "$OUT/bench_ab.log" 2>&1
  done
}

if [ "$PHASE" = check ] || [ "$PHASE" = all ]; then
  # head_dim 256 cases and the rest in separate processes (each test's float64 / CPU reference
  # takes seconds; 16 cores).
  run_test() {  # $1 binary, $2 gtest filter, $3 log
    (timeout "${TEST_LIMIT:-300}" "$K/$1" --gtest_filter="$2" > "$OUT/$3" 2>&1
     echo "exit $?" >> "$OUT/$3") &
  }
  run_test attngrad_attention_tests '*D256*' attention_tests_256.log
  run_test attngrad_attention_tests '-*D256*' attention_tests_128.log
  run_test attngrad_gpu_tests '*Gemma3HeadDim256*' gpu_tests_256.log
  run_test attngrad_gpu_tests '-*Gemma3HeadDim256*' gpu_tests_128.log
  timeout "${CHECK_LIMIT:-280}" python3 "$K/check_gemma3.py" --lib "$K/libattngrad.so" \
    --shapes "${SHAPES:-1:1,2:7,1:1000,2:2500}" ${MODELS:+--models $MODELS} \
    > "$OUT/check_gemma3.log" 2>&1
  echo "check exit $?" >> "$OUT/check_gemma3.log"
  wait
  date -u +"checks done %T UTC" | tee -a "$INFO"
  bench_ab 1
fi
if [ "$PHASE" = time ] || [ "$PHASE" = all ]; then
  # attngrad and eager TF32 for every model first (quick), then torch.compile (one compilation per
  # model) for as many models as TIME_LIMIT allows.
  for variant in --torch --compile; do
    echo "==== $variant" >> "$OUT/time_gemma3.log"
    timeout "${TIME_LIMIT:-330}" python3 "$K/check_gemma3.py" --lib "$K/libattngrad.so" \
      --no-check --time --time-shapes "${TIME_SHAPES:-1:4096,4:1024,8:2048}" $variant \
      --models "${TIME_MODELS:-gemma-3-270m,gemma-3-1b,gemma-3-4b,gemma-3-12b}" \
      >> "$OUT/time_gemma3.log" 2>&1
    echo "time $variant exit $?" >> "$OUT/time_gemma3.log"
  done
  date -u +"gemma3 timing done %T UTC" | tee -a "$INFO"
  bench_ab "${ROUNDS:-1}"
fi
if [ "$PHASE" = compile ]; then
  rm -rf /tmp/compile && mkdir -p /tmp/compile
  export TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2}
  models=${COMPILE_MODELS:-gemma-3-270m,gemma-3-1b,gemma-3-4b,gemma-3-12b,gemma-3-27b}
  shapes=${TIME_SHAPES:-1:4096,4:1024,8:2048}
  jobs=$(( $(echo "$models" | tr , '\n' | wc -l) * $(echo "$shapes" | tr , '\n' | wc -l) ))
  # All jobs at once: each waits for every other to have compiled before it times.
  for model in $(echo "$models" | tr , ' '); do
    for shape in $(echo "$shapes" | tr , ' '); do
      echo "$model $shape"
    done
  done | xargs -P "$jobs" -L 1 sh -c \
    'left=$(($0 - $(date +%s))); [ "$left" -gt 30 ] || exit 0
     timeout "$left" python3 "$1/check_gemma3.py" --lib "$1/libattngrad.so" \
       --no-check --time --torch --compile --models "$3" --time-shapes "$4" \
       --timing-lock /tmp/compile/lock --ready-dir /tmp/compile --ready-count "$2" \
       > "/tmp/compile/$3-$4.log" 2>&1
     echo "exit $?" >> "/tmp/compile/$3-$4.log"' $(($(date +%s) + ${TIME_LIMIT:-500})) "$K" "$jobs"
  cat /tmp/compile/*.log > "$OUT/time_compile.log"
  date -u +"compile timing done %T UTC" | tee -a "$INFO"
fi
date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
for f in "$OUT"/attention_tests_*.log "$OUT"/gpu_tests_*.log; do
  [ -f "$f" ] && grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit" "$f" | head -30
done
[ -f "$OUT/check_gemma3.log" ] && grep -E "FAIL|correctness|exit" "$OUT/check_gemma3.log" | head -30
[ -f "$OUT/check_gemma3.log" ] && echo "PASS lines: $(grep -c PASS "$OUT/check_gemma3.log")"
[ -f "$OUT/time_gemma3.log" ] && grep -E "^\||exit|====" "$OUT/time_gemma3.log"
[ -f "$OUT/time_compile.log" ] && grep -E "^\| gemma|^compiled|exit|Error" "$OUT/time_compile.log"
[ -f "$OUT/bench_ab.log" ] && grep -E "^====|geomean" "$OUT/bench_ab.log"
