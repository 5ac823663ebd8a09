#!/usr/bin/env bash
# One device call (H200) for the service's TCP throughput: checks a service build's batch path on
# the GPU worker, then times attngrad beside the bare gRPC stream of the same bytes
# (attngrad_wire_ceiling, ByteBuffer transport), with an A/B of the server binaries in the same
# call. Prints one compact line per run (the call's output keeps only its last 12,000 characters)
# and leaves at most 4 files in $OUT.
#
# The carried folder $B (default build-wire) holds svc.tar.xz (scripts/device/stage-service-bundle.sh),
# optionally old-attngrad-server.xz (a previous build's server, same libraries) and py/ (client/python
# with its generated stubs, tests/python and bench/cuda_ipc_bench.py, laid out as the repository).
#   ROOT        the build directory the tests were compiled in (they start attngrad-server from there)
#   TEST_LIMIT  seconds for the checks (in parallel; default 75)
#   D           seconds per timed run (default 3)
#   CHECKS=0    skips the checks; REGION_TESTS=1 runs the regions tests on the GPU worker last
#   SHORT=1     only the 8-connection fp32/bf16 ACCUMULATE, fp32 RETURN and latency settings on
#               the new server, and fp32 ACCUMULATE on the others; no bridge
#   CEILINGS=main  times the ceiling for the 8-connection ACCUMULATE and fp32 RETURN settings and
#               the latency only (default: every setting)
set -u
B=${B:-build-wire}
PY=${PY:-$B/py}
D=${D:-3}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$B" svc.tar.xz
W=/tmp/wire_logs
mkdir -p "$W"
CLI="$PWD/$B/attngrad-cli"
CEILING="$PWD/$B/attngrad_wire_ceiling"
NEW="$PWD/$B/attngrad-server"
OLD="$PWD/$B/old-attngrad-server"
[ -f "$OLD.xz" ] && xz -dc "$OLD.xz" > "$OLD" && chmod +x "$OLD"
echo "cores $(nproc), perf: $(command -v perf || echo none)" | tee -a "$INFO"

# 1. Checks, in parallel: the copy-free path, regions and memory budget tests, the server tests and
#    the GPU server tests on the GPU worker, and the CUDA IPC tests of the Python client.
ROOT=${ROOT:-/work/wt-wire/build-h200w}
mkdir -p "$ROOT/server" "$ROOT/client/cli"
cp "$NEW" "$ROOT/server/"
cp "$CLI" "$ROOT/client/cli/"
if [ "${CHECKS:-1}" = 1 ]; then
LIMIT=${TEST_LIMIT:-75}
for test in attngrad_server_wire_test attngrad_server_test attngrad_server_gpu_test; do
  (ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/$test" > "$W/$test.log" 2>&1
   echo "exit $?" >> "$W/$test.log") &
done
(cd "$PY/tests/python" && ATTNGRAD_SERVER="$NEW" timeout "$LIMIT" \
   python3 -m unittest -v test_cuda_ipc > "$W/test_cuda_ipc.log" 2>&1
 echo "exit $?" >> "$W/test_cuda_ipc.log") &
wait
date -u +"checks done %T UTC" | tee -a "$INFO"
for f in "$W"/*.log; do
  echo "--- $(basename "$f")"
  grep -E "^\[  PASSED|^\[  FAILED|^exit|^Ran |^OK|^FAILED|Error:" "$f" | head -20
done | tee "$OUT/checks.txt"
cat "$W"/*.log > "$OUT/checks_full.log"
fi

# 2. Timing. One server at a time on GPU 0; attngrad-cli bench then the ceiling of the same bytes.
seconds_of() { awk '{ n = split($0, t, " "); s = 0; for (i = 1; i <= n; ++i) {
  split(t[i], p, "m"); sub("s", "", p[2]); s += p[1] * 60 + p[2] } print s }'; }
serve() {  # $1 label, $2 server binary, then its extra flags
  local label=$1 binary=$2
  shift 2
  "$binary" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= \
    --max_inflight_bytes=17179869184 "$@" > "$W/server_$label.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 80); do "$CLI" info > /dev/null 2>&1 && break; sleep 0.25; done
  SERVER=$label
}
unserve() { kill -TERM "$SERVER_PID"; wait "$SERVER_PID"; }
server_cpu() { awk '{print ($14 + $15) / 100}' "/proc/$SERVER_PID/stat"; }
A="--batch=4 --seq_len=1024 --in_flight=2 --count=0 --duration_seconds=$D"
bench() {  # $1 label, then the flags of both programs
  RUN=$((RUN + 1))
  local label=$1 before log=$W/bench_$RUN.log
  shift
  before=$(server_cpu)
  ( "$CLI" bench --progress=false "$@" > "$log" 2>&1; times > "$log.times" )
  local used client moved
  used=$(awk -v a="$(server_cpu)" -v b="$before" 'BEGIN { print a - b }')
  client=$(tail -1 "$log.times" | seconds_of)
  moved=$(awk '/^  moved /{print $2}' "$log")
  awk -v label="$SERVER $label" -v used="$used" -v client="$client" -v moved="${moved:-0}" '
    /throughput/ { tokens = $2 }
    /^  latency/ { p50 = $3 }
    /^  server / { gsub(",", ""); q = $7 * 1e3; ci = $9 * 1e3; c = $11 * 1e3; co = $13 * 1e3 }
    /^  errors/ { errors = $2 }
    END { printf "A %-34s %9.0f tok/s p50 %.4f s | ms queue %.1f in %.1f compute %.1f out %.1f | CPU s/GB server %.3f client %.3f | errors %s\n",
          label, tokens, p50, q, ci, c, co, (moved > 0 ? used / moved : -1),
          (moved > 0 ? client / moved : -1), errors }' "$log" | tee -a "$OUT/timing.txt"
  grep -E "^  (throughput|latency|server|errors)" "$log" | cut -c1-160 >> "$OUT/bench_raw.txt"
  if [ "${CEIL:-1}" = 1 ] && { [ "${CEILINGS:-all}" = all ] || [ "${MAIN:-0}" = 1 ]; }; then
    "$CEILING" "$@" --transport=bytebuffer 2>&1 | grep -o "[0-9]* batches in.*" |
      sed -E 's/ \(([0-9]+) B\/batch\)//g; s/, errors 0$//' |
      awk -v label="$label" '{ printf "C %-34s %s\n", "ceiling " label, $0 }' |
      tee -a "$OUT/timing.txt"
  fi
}
F8="--streams=8 --channels=8"
RUN=0
serve new "$NEW"
[ "${SHORT:-0}" = 1 ] || bench "fp32 ACC 4x1 conn" $A --streams=4 --channels=1
MAIN=1 bench "fp32 ACC 8/8" $A $F8
MAIN=1 bench "bf16 ACC 8/8" $A $F8 --input_dtype=bfloat16 --response_dtype=bfloat16
MAIN=1 bench "fp32 RET 8/8" $A $F8 --mode=return
[ "${SHORT:-0}" = 1 ] ||
  bench "bf16 RET 8/8" $A $F8 --mode=return --input_dtype=bfloat16 --response_dtype=bfloat16
MAIN=1 bench "RET 1x128 1 in flight" --mode=return --batch=1 --seq_len=128 --channels=1 \
  --streams=1 --in_flight=1 --count=100
if command -v perf > /dev/null; then  # where the server's CPU goes at 8 connections
  perf record -F 499 -g -p "$SERVER_PID" -o "$W/perf.data" -- sleep "$D" > /dev/null 2>&1 &
  PERF_PID=$!
  CEIL=0 bench "fp32 ACC 8/8 (perf)" $A $F8
  wait "$PERF_PID"
  perf report -i "$W/perf.data" --no-children --sort dso,sym --stdio 2> /dev/null |
    grep -vE "^#|^$" | grep -E "^ +[0-9]" | head -40 > "$OUT/perf.txt"
fi
bridge() {  # $1: what to time (cuda_ipc_bench.py --only)
  [ -d "$PY/bench" ] && [ "${SHORT:-0}" != 1 ] || return
  timeout 90 python3 "$PY/bench/cuda_ipc_bench.py" --only="$1" --count="${BRIDGE_COUNT:-40}" \
    2>&1 | grep -E "^\{|Error" | cut -c1-200 | sed "s/^/B $SERVER /" | tee -a "$OUT/timing.txt"
}
bridge "${BRIDGE:-bridge,bridge_tcp}"
unserve
CEIL=0
serve nostage "$NEW" --stage_on_arrival=false
bench "fp32 ACC 8/8" $A $F8
[ "${SHORT:-0}" = 1 ] || bench "fp32 RET 8/8" $A $F8 --mode=return
unserve
if [ -x "$OLD" ]; then
  serve old "$OLD"
  bench "fp32 ACC 8/8" $A $F8
  [ "${SHORT:-0}" = 1 ] || bench "fp32 RET 8/8" $A $F8 --mode=return
  bridge "${OLD_BRIDGE:-bridge}"
  unserve
fi
if [ "${REGION_TESTS:-0}" = 1 ]; then  # the regions tests on the GPU worker, in 3 shards
  for shard in 0 1 2; do
    (ATTNGRAD_TEST_DEVICES=0 GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$shard timeout 40 \
       "$B/attngrad_server_wire_test" --gtest_filter='Regions*' > "$W/regions_$shard.log" 2>&1
     echo "exit $?" >> "$W/regions_$shard.log") &
  done
  wait
  grep -hE "^\[       OK|^\[  FAILED|^exit|Failure" "$W"/regions_*.log | cut -c1-120 |
    tee -a "$OUT/checks.txt"
fi
date -u +"end %T UTC" | tee -a "$INFO"
for f in "$W"/server_*.log; do grep -iE "error|fatal|abort" "$f" | head -3; done
echo "==== checks"; cat "$OUT/checks.txt" 2> /dev/null
echo "==== timing"; cat "$OUT/timing.txt"
