#!/usr/bin/env bash
# One device call (H200) for the sliding window / Gemma-3 work: unpacks the carried binaries
# (.carry/binaries.tar.xz: build-h200's libattngrad.so, the two GPU test programs, attngrad_bench,
# the previous commit's attngrad_bench as .prev/attngrad_bench_<commit>, and .carry/lib/ with
# libopenblas.so.0, libgfortran.so.5, libquadmath.so.0), then
#   1. the GPU tests and the attention kernel tests (in the background) while
#   2. bench/check_gemma3.py checks every Gemma-3 layer the GPU computes against transformers,
#   3. times local/global layers (bench/check_gemma3.py --time), and
#   4. alternates attngrad_bench of this build and of the previous commit on the 16 SPEC workloads.
# Logs go to $OUT; a summary is printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
tar -xJf .carry/binaries.tar.xz || exit 1
# OpenBLAS (the CPU reference backend linked into the library) and its Fortran runtime travel too.
export LD_LIBRARY_PATH="$PWD/.carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +"start %F %T UTC" | tee "$OUT/times.txt"

(build-h200/tests/gpu/attngrad_gpu_tests > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log"
 build-h200/tests/gpu/attngrad_attention_tests > "$OUT/attention_tests.log" 2>&1
 echo "exit $?" >> "$OUT/attention_tests.log") &
TESTS=$!

python3 bench/check_gemma3.py --lib build-h200/kernels/libattngrad.so \
  --shapes "${SHAPES:-1:1,2:7,1:1000,2:2500}" > "$OUT/check_gemma3.log" 2>&1
echo "check exit $?" >> "$OUT/check_gemma3.log"
wait $TESTS
date -u +"checks done %T UTC" | tee -a "$OUT/times.txt"

python3 bench/check_gemma3.py --lib build-h200/kernels/libattngrad.so --no-check --time \
  --time-shapes "${TIME_SHAPES:-1:4096,4:1024}" ${TORCH_FLAG:---torch} > "$OUT/time_gemma3.log" 2>&1
date -u +"gemma3 timing done %T UTC" | tee -a "$OUT/times.txt"

PREV=$(ls .prev/attngrad_bench_* | head -1)
for round in 1 2; do
  build-h200/bench/attngrad_bench > "$OUT/bench_new_$round.log" 2>&1
  "$PREV" > "$OUT/bench_prev_$round.log" 2>&1
done
date -u +"bench done %T UTC" | tee -a "$OUT/times.txt"

echo "==== summary"
grep -E "^\[  (PASSED|FAILED) |FAILED|^exit" "$OUT/gpu_tests.log" "$OUT/attention_tests.log" | head -40
grep -E "FAIL|skipped|correctness" "$OUT/check_gemma3.log" | head -30
grep -c PASS "$OUT/check_gemma3.log"
tail -4 "$OUT/check_gemma3.log"
tail -8 "$OUT/time_gemma3.log"
for f in "$OUT"/bench_*.log; do echo "$f: $(grep -i geomean "$f" | head -1)"; done
