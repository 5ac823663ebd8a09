#!/usr/bin/env bash
# Device calls (H200) for the service (throughput, checks, offload). The carried folder $B (default
# build-svc) holds svc.tar.xz: attngrad-server, attngrad-cli, attngrad_wire_ceiling,
# attngrad_server_test, attngrad_server_wire_test, attngrad_soak_test, attngrad_gpu_tests (stripped, built sm_90a here) and
# lib/ (their shared libraries: shared/tools/bundle-libs.sh). PHASE selects what runs:
#   check:   in parallel: the server tests on the GPU workers (ATTNGRAD_TEST_DEVICES=0), the GPU
#            tests of the finite check, the offload end-to-end check
#            (client/python/examples/h200_check_offload.sh), a GPU soak (scripts/soak.sh) of
#            SOAK_SECONDS, then the SPEC section 4 check of each wire dtype choice (attngrad-cli
#            backward --check).
#   service: one server on GPU 0; attngrad-cli bench beside attngrad_wire_ceiling (protobuf and
#            ByteBuffer) for the same bytes, channels, streams and in-flight window: fp32 and bf16
#            ACCUMULATE, fp32 RETURN at 4x1024, and RETURN 1x128 with one batch in flight; the
#            server's CPU seconds per run (from /proc) and per GB moved (the bench's "moved" line).
# Logs go to $OUT; a summary is printed last.
set -u
B=${B:-build-svc}
PHASE=${PHASE:-check}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$B" svc.tar.xz

if [ "$PHASE" = check ]; then
  # The server and soak tests run attngrad-server and attngrad-cli from the paths of the build they
  # were compiled in ($ROOT, absolute): put the carried binaries there.
  ROOT=${ROOT:-/work/main/build-h200s}
  mkdir -p "$ROOT/server" "$ROOT/client/cli"
  cp "$B/attngrad-server" "$ROOT/server/"
  cp "$B/attngrad-cli" "$ROOT/client/cli/"
  (ATTNGRAD_TEST_DEVICES=0 timeout "${TEST_LIMIT:-420}" "$B/attngrad_server_test" \
     --gtest_filter="${SERVER_FILTER:-*}" > "$OUT/server_tests_gpu.log" 2>&1
   echo "exit $?" >> "$OUT/server_tests_gpu.log") &
  (ATTNGRAD_TEST_DEVICES=0 timeout 300 "$B/attngrad_server_wire_test" > "$OUT/wire_tests_gpu.log" 2>&1
   echo "exit $?" >> "$OUT/wire_tests_gpu.log") &
  (timeout 300 "$B/attngrad_gpu_tests" --gtest_filter='*Finite*' > "$OUT/finite_gpu.log" 2>&1
   echo "exit $?" >> "$OUT/finite_gpu.log") &
  (OUT="$OUT/offload" LIBS="$PWD/$B/lib" SERVER="$B/attngrad-server" DEVICES=0 \
     timeout "${OFFLOAD_LIMIT:-420}" bash client/python/examples/h200_check_offload.sh \
     > "$OUT/offload.log" 2>&1; echo "exit $?" >> "$OUT/offload.log") &
  if [ "${SOAK_SECONDS:-0}" -gt 0 ]; then
    mkdir -p build-soak/tests/server build-soak/server
    cp "$B/attngrad_soak_test" build-soak/tests/server/
    cp "$B/attngrad-server" build-soak/server/
    (timeout $((SOAK_SECONDS + 120)) scripts/soak.sh --duration "$SOAK_SECONDS" --devices 0 \
       --build-dir build-soak --csv "$OUT/soak_gpu.csv" > "$OUT/soak_gpu.log" 2>&1
     echo "exit $?" >> "$OUT/soak_gpu.log") &
  fi
  wait
  date -u +"checks done %T UTC" | tee -a "$INFO"
  # What each wire dtype does to SPEC section 4's check (the reference of the rounded input).
  "$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= \
    > "$OUT/dtype_server.log" 2>&1 &
  SERVER_PID=$!
  sleep 8
  for dtypes in float32:float32 bfloat16:float32 float16:float32 float32:bfloat16 \
                bfloat16:bfloat16 float16:float16; do
    echo "==== input ${dtypes%%:*} response ${dtypes##*:}" >> "$OUT/dtype_check.log"
    "$B/attngrad-cli" backward --check --batch=2 --seq_len=600 --mode=return \
      --input_dtype="${dtypes%%:*}" --response_dtype="${dtypes##*:}" \
      >> "$OUT/dtype_check.log" 2>&1
  done
  kill -TERM $SERVER_PID; wait $SERVER_PID
fi

if [ "$PHASE" = service ]; then
  # 16 GiB in-flight budget: 8 streams x 2 in flight of 4x1024 RETURN batches hold ~4 GB.
  "$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= \
    --max_inflight_bytes=17179869184 > "$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  sleep 8
  cpu_seconds() { awk '{print ($14 + $15) / 100}' "/proc/$SERVER_PID/stat"; }
  D=${DURATION:-10}
  A="--batch=4 --seq_len=1024 --in_flight=2 --count=0 --duration_seconds=$D"
  W="$B/attngrad_wire_ceiling"
  pair() {  # $1 label, then flags for both programs
    label=$1; shift
    echo "==== $label: $*" | tee -a "$OUT/service.log"
    before=$(cpu_seconds)
    "$B/attngrad-cli" bench "$@" >> "$OUT/service.log" 2>&1
    # Server CPU per GB moved: its CPU seconds over this bench / the bench's bytes (warm-up in both).
    used=$(awk -v a="$(cpu_seconds)" -v b="$before" 'BEGIN { print a - b }')
    moved=$(grep -E "^  moved " "$OUT/service.log" | tail -1 | awk '{print $2}')
    echo "server CPU seconds: $used, $(awk -v c="$used" -v g="${moved:-0}" \
      'BEGIN { if (g > 0) printf "%.3f", c / g; else print "?" }') CPU s per GB moved ($moved GB)" \
      >> "$OUT/service.log"
    "$W" "$@" --json >> "$OUT/service.log" 2>&1
    "$W" "$@" --transport=bytebuffer --json >> "$OUT/service.log" 2>&1
  }
  pair "fp32 ACCUMULATE 4 streams 1 channel" $A --streams=4 --channels=1
  pair "fp32 ACCUMULATE 8 streams 8 channels" $A --streams=8 --channels=8
  pair "bf16 ACCUMULATE 8 streams 8 channels" $A --streams=8 --channels=8 \
    --input_dtype=bfloat16 --response_dtype=bfloat16
  pair "fp32 RETURN 8 streams 8 channels" $A --streams=8 --channels=8 --mode=return
  pair "bf16 RETURN 8 streams 8 channels" $A --streams=8 --channels=8 --mode=return \
    --input_dtype=bfloat16 --response_dtype=bfloat16
  pair "latency RETURN 1x128, 1 in flight" --mode=return --batch=1 --seq_len=128 --channels=1 \
    --streams=1 --in_flight=1 --count=100
  kill -TERM $SERVER_PID; wait $SERVER_PID
fi
date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
for f in "$OUT"/server_tests_gpu.log "$OUT"/wire_tests_gpu.log "$OUT"/finite_gpu.log; do
  [ -f "$f" ] && { echo "--- $f"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit|SKIPPED \]" "$f" | head -40; }
done
[ -f "$OUT/offload.log" ] && { echo "--- offload"; tail -30 "$OUT/offload.log"; }
[ -f "$OUT/soak_gpu.log" ] && { echo "--- soak"; tail -15 "$OUT/soak_gpu.log"; }
[ -f "$OUT/dtype_check.log" ] && grep -E "^====|check|PASS|FAIL" "$OUT/dtype_check.log" | head -40
# Compact: the bench's throughput, latency and server stage lines and the ceiling's tokens/s, p50
# and CPU (bench/h200_wire_run.sh prints one line per run).
[ -f "$OUT/service.log" ] && grep -vE "^\s*$" "$OUT/service.log" |
  grep -E "====|throughput|^  latency|^  server|server CPU|\{" |
  sed -E 's/"(channels|streams|in_flight|batch|seq_len|mode|input_dtype|response_dtype|rotary|hidden_size|num_heads|num_kv_heads|head_dim|batches|tokens|seconds|request_bytes|response_bytes|request_bytes_per_batch|response_bytes_per_batch|request_gb_per_second|response_gb_per_second|p90_seconds|p99_seconds|max_seconds|server_received_bytes|server_sent_bytes|server_batches|server_cpu_seconds|client_cpu_seconds|errors|first_error)":("[^"]*"|[^,}]*),?//g' |
  cut -c1-300
