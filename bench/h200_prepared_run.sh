#!/usr/bin/env bash
# One device call (H200) for resident (prepared) weights. The carried folder $K
# (default build-prep) holds bundle.tar.xz: attngrad_gpu_tests, attngrad_server_gpu_test,
# attngrad_bench, attngrad-server and attngrad-cli of this build, attngrad-server-prev (the commit
# before, for the same-call A/B of the server) and lib/ (shared/tools/bundle-libs.sh). It runs:
#   1. the GPU tests of prepared weights and of the finite check (plus the plain path's
#      correctness, determinism and graph tests) and the server's resident-weights GPU test;
#   2. attngrad_bench and attngrad_bench --prepared, alternated ROUNDS times (SPEC section 5
#      timing, the 16 workloads), then --stages of both at 1x128 and 4x1024;
#   3. one server at a time on GPU 0, this build's then the previous one's then this one's again:
#      attngrad-cli bench RETURN 1x128 with one batch in flight and ACCUMULATE 4x1024 (2 streams
#      x 2 in flight), fp32 on the wire; the server's stage means (compute is the GPU's part).
# Logs go to $OUT; a summary is printed last.
set -u
K=${K:-build-prep}
ROUNDS=${ROUNDS:-2}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$K" bundle.tar.xz

(timeout "${TEST_LIMIT:-150}" "$K/attngrad_gpu_tests" --gtest_filter='*Prepared*:FiniteCheck*:*MatchesCpuBackendOnSmall*:*TwoCalls*:*Graph*:*Concurrent*:*BadArguments*:*Errors*:*WithoutSoftCap*:*Accumulate*' \
   > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log") &
(timeout "${TEST_LIMIT:-150}" "$K/attngrad_server_gpu_test" --gtest_filter='*ResidentWeights*:*FiniteSumsGpu*' \
   > "$OUT/server_gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/server_gpu_tests.log") &
wait
date -u +"tests done %T UTC" | tee -a "$INFO"

for round in $(seq 1 "$ROUNDS"); do
  echo "==== plain round $round" >> "$OUT/bench.log"
  timeout 120 "$K/attngrad_bench" >> "$OUT/bench.log" 2>&1
  echo "==== prepared round $round" >> "$OUT/bench.log"
  timeout 120 "$K/attngrad_bench" --prepared >> "$OUT/bench.log" 2>&1
done
for variant in "" --prepared; do
  echo "==== stages $variant" >> "$OUT/bench.log"
  timeout 60 "$K/attngrad_bench" --stages --workloads=1:128,4:1024 $variant >> "$OUT/bench.log" 2>&1
done
date -u +"bench done %T UTC" | tee -a "$INFO"

serve() {  # $1 server binary, $2 label
  "$1" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= > "$OUT/server_$2.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 60); do
    "$K/attngrad-cli" info > /dev/null 2>&1 && break
    sleep 0.5
  done
  echo "==== $2: RETURN 1x128, 1 in flight" >> "$OUT/service.log"
  timeout 60 "$K/attngrad-cli" bench --mode=return --batch=1 --seq_len=128 --channels=1 \
    --streams=1 --in_flight=1 --count=30 --warmup=3 --progress=false >> "$OUT/service.log" 2>&1
  echo "==== $2: ACCUMULATE 4x1024, 2 streams x 2 in flight" >> "$OUT/service.log"
  timeout 60 "$K/attngrad-cli" bench --batch=4 --seq_len=1024 --channels=2 --streams=2 \
    --in_flight=2 --count=0 --duration_seconds="${DURATION:-5}" --progress=false \
    >> "$OUT/service.log" 2>&1
  kill -TERM "$pid"; wait "$pid"
}
serve "$K/attngrad-server" new
serve "$K/attngrad-server-prev" prev
serve "$K/attngrad-server" new2
date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
for f in "$OUT"/gpu_tests.log "$OUT"/server_gpu_tests.log; do
  echo "--- $f"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit|SKIPPED \]" "$f" | head -30
done
grep -E "^====|geomean|^ +1 +128|^ +4 +1024" "$OUT/bench.log"
grep -E "^====|server +mean|throughput|errors" "$OUT/service.log"
