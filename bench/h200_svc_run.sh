#!/usr/bin/env bash
# One device call (H200) for the service's throughput: a branch's service binaries against main's in
# the same call, each attngrad number beside the bare gRPC stream of the same bytes
# (attngrad_wire_ceiling, ByteBuffer transport, same flags), plus the shared-memory path and the
# autograd bridge (bench/cuda_ipc_bench.py), and a perf profile of the server when perf is carried.
# Prints one compact line per run (the call's output keeps only its last 12,000 characters).
#
# The carried folder $B (default build-svc2) holds svc.tar.xz (attngrad-server, attngrad-cli,
# attngrad_wire_ceiling and the server test programs with lib/), main-attngrad-server.xz and
# main-attngrad-cli.xz (main's binaries, same libraries), optionally perf.tar.xz (perf/perf and
# perf/lib/) and py/ (client/python with its stubs and bench/cuda_ipc_bench.py, laid out as the
# repository).
#   D           seconds per timed run (default 2)
#   CHECKS=0    skips the GPU checks of the server's batch path (TEST_LIMIT seconds, default 40)
#   SHM=0       skips the shared-memory path's throughput
#   AB_ROUNDS=2 each branch-CLI / main-CLI pair again in the other order (main's first), to tell the
#               binary from its place in the call (the first run after the server starts is slow)
#   PY_MAIN     a second client/python tree (default $B/py-main, when carried): the TCP bridge
#               timed with it too, right after this branch's (main's Python client against it)
#   ROOT        the build directory the tests were compiled in (they start attngrad-server there)
#   DEVICES, SHAPE, LATENCY_SHAPE  for a dry run against a CPU build (--devices=cpu, small shapes)
set -u
B=${B:-build-svc2}
PY=${PY:-$B/py}
PY_MAIN=${PY_MAIN:-$B/py-main}
D=${D:-2}
source bench/device_setup.sh  # (run from the repository root)
device_setup "$B" svc.tar.xz
W=/tmp/svc_logs
mkdir -p "$W"
CLI="$PWD/$B/attngrad-cli"
CEILING="$PWD/$B/attngrad_wire_ceiling"
NEW="$PWD/$B/attngrad-server"
for f in main-attngrad-server main-attngrad-cli; do
  [ -f "$B/$f.xz" ] && xz -dc "$B/$f.xz" > "$B/$f" && chmod +x "$B/$f"
done
MAIN_SERVER="$PWD/$B/main-attngrad-server"
MAIN_CLI="$PWD/$B/main-attngrad-cli"
PERF=()
if [ -f "$B/perf.tar.xz" ] && tar -xJf "$B/perf.tar.xz" -C "$B"; then
  PERF=(env "LD_LIBRARY_PATH=$PWD/$B/perf/lib" "$PWD/$B/perf/perf")
fi
echo "cores $(nproc), perf: ${PERF[*]:-none}" | tee -a "$INFO"

if [ "${CHECKS:-1}" = 1 ]; then  # the server's batch path on the GPU worker, in parallel
  ROOT=${ROOT:-/work/wt-svc/build-h200v}
  mkdir -p "$ROOT/server" && cp "$NEW" "$ROOT/server/"
  LIMIT=${TEST_LIMIT:-40}
  (ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_wire_test" \
     --gtest_filter='ServerCopyFreePathTest*:ServerWireIntegrityTest*:ReceivedBackward*' \
     > "$W/wire_test.log" 2>&1; echo "exit $?" >> "$W/wire_test.log") &
  (ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_test" \
     --gtest_filter='ServerBackwardTest*:ServerGradientsTest*:ServerBadInputTest*' \
     > "$W/server_test.log" 2>&1; echo "exit $?" >> "$W/server_test.log") &
  [ -x "$B/attngrad_server_gpu_test" ] && (ATTNGRAD_TEST_DEVICES=0 timeout "$LIMIT" "$B/attngrad_server_gpu_test" \
     > "$W/server_gpu_test.log" 2>&1; echo "exit $?" >> "$W/server_gpu_test.log") &
  wait
  for f in "$W"/*_test.log; do
    echo "--- $(basename "$f"): $(grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|^exit" "$f" |
      tr '\n' ' ')"
    grep -E "^\[  FAILED|Failure" "$f" | head -5
  done | tee "$OUT/checks.txt"
fi

seconds_of() { awk '{ n = split($0, t, " "); s = 0; for (i = 1; i <= n; ++i) {
  split(t[i], p, "m"); sub("s", "", p[2]); s += p[1] * 60 + p[2] } print s }'; }
serve() {  # $1 label, $2 server binary
  "$2" --devices="${DEVICES:-0}" --listen=127.0.0.1:50051 --metrics_listen= \
    --max_inflight_bytes=17179869184 > "$W/server_$1.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 80); do "$CLI" info > /dev/null 2>&1 && break; sleep 0.25; done
  SERVER=$1
}
unserve() { kill -TERM "$SERVER_PID"; wait "$SERVER_PID"; }
server_cpu() { awk '{print ($14 + $15) / 100}' "/proc/$SERVER_PID/stat"; }
A="${SHAPE:---batch=4 --seq_len=1024} --in_flight=2 --count=0 --duration_seconds=$D"
F8="--streams=8 --channels=8"
RUN=0
bench() {  # $1 label, $2 cli binary, then the flags of both programs; CEIL=1: the ceiling after
  RUN=$((RUN + 1))
  local label=$1 cli=$2 before log=$W/bench_$RUN.log
  shift 2
  before=$(server_cpu)
  ( "$cli" bench --progress=false "$@" > "$log" 2>&1; times > "$log.times" )
  local used client moved
  used=$(awk -v a="$(server_cpu)" -v b="$before" 'BEGIN { print a - b }')
  client=$(tail -1 "$log.times" | seconds_of)
  moved=$(awk '/^  moved /{print $2}' "$log")
  awk -v label="$SERVER $label" -v used="$used" -v client="$client" -v moved="${moved:-0}" '
    /throughput/ { tokens = $2 }
    /^  latency/ { p50 = $3 }
    /^  server / { gsub(",", ""); q = $7 * 1e3; ci = $9 * 1e3; c = $11 * 1e3; co = $13 * 1e3 }
    /^  client CPU/ { timed = $3 }
    /^  errors/ { errors = $2 }
    END { if (moved <= 0) moved = -1
          printf "A %-30s %8.0f tok/s p50 %.4f | ms q %.1f in %.1f c %.1f out %.1f | s/GB server %.3f client %.3f (timed %s) | err %s\n",
          label, tokens, p50, q, ci, c, co, used / moved, client / moved, timed, errors }' "$log" |
    tee -a "$OUT/timing.txt"
  if [ "${CEIL:-0}" = 1 ]; then
    "$CEILING" "$@" --transport=bytebuffer 2>&1 | grep -o "[0-9]* batches in.*" |
      sed -E 's/ \(([0-9]+) B\/batch\)//g; s/, errors 0$//' |
      awk -v label="$label" '{ printf "C %-30s %s\n", "ceiling " label, $0 }' |
      tee -a "$OUT/timing.txt"
  fi
}
python_bench() {  # $1 what (cuda_ipc_bench.py --only), then its flags; PY: the client tree
  local what=$1
  shift
  [ -d "$PY/bench" ] || return
  timeout 75 python3 "$PY/bench/cuda_ipc_bench.py" --only="$what" "$@" 2>&1 |
    grep -E "^\{|Error" | cut -c1-220 | sed "s|^|P $SERVER $(basename "$PY") |" |
    tee -a "$OUT/timing.txt"
}

ab() {  # $1 label, then the flags: the branch's CLI (the bare stream after it), then main's
  local label=$1
  shift
  CEIL=1 bench "$label" "$CLI" "$@"
  bench "$label main-cli" "$MAIN_CLI" "$@"
  if [ "${AB_ROUNDS:-1}" -ge 2 ]; then
    bench "$label main-cli (2nd)" "$MAIN_CLI" "$@"
    bench "$label (2nd)" "$CLI" "$@"
  fi
}
serve new "$NEW"
ab "fp32 ACC 8/8" $A $F8
ab "bf16 ACC 8/8" $A $F8 --input_dtype=bfloat16 --response_dtype=bfloat16
ab "fp32 RET 8/8" $A $F8 --mode=return
CEIL=1 bench "RET 1x128 1 in flight" "$CLI" --mode=return ${LATENCY_SHAPE:---batch=1 --seq_len=128} \
  --channels=1 --streams=1 --in_flight=1 --count=${LATENCY_COUNT:-100}
if [ ${#PERF[@]} -gt 0 ]; then  # where the server's CPU goes at 8 connections
  "${PERF[@]}" record -F 499 -g -p "$SERVER_PID" -o "$W/perf.data" -- sleep "$D" \
    > "$W/perf_record.log" 2>&1 &
  PERF_PID=$!
  bench "fp32 ACC 8/8 (perf)" "$CLI" $A $F8
  wait "$PERF_PID"
  tail -2 "$W/perf_record.log"
  "${PERF[@]}" report -i "$W/perf.data" --no-children --sort dso,sym --stdio 2> /dev/null |
    grep -E "^ +[0-9]" | head -45 > "$OUT/perf.txt"
  "${PERF[@]}" report -i "$W/perf.data" --no-children --sort sym -g caller,0.5,callee --stdio \
    2> /dev/null | grep -vE "^#|^$" | head -300 > "$OUT/perf_callers.txt"
fi
[ "${SHM:-1}" = 1 ] && python_bench shm --configs=8x2,4x2 --warmup=2 --duration=3
python_bench bridge,bridge_tcp --count=40
[ -d "$PY_MAIN/bench" ] && PY=$PY_MAIN python_bench bridge_tcp --count=40
unserve
serve main "$MAIN_SERVER"
bench "fp32 ACC 8/8 main-cli" "$MAIN_CLI" $A $F8
bench "fp32 RET 8/8 main-cli" "$MAIN_CLI" $A $F8 --mode=return
unserve
date -u +"end %T UTC" | tee -a "$INFO"
for f in "$W"/server_*.log; do grep -iE "error|fatal|abort" "$f" | head -3; done
echo "==== checks"; cat "$OUT/checks.txt" 2> /dev/null
echo "==== timing"; cat "$OUT/timing.txt"
echo "==== perf"; head -30 "$OUT/perf.txt" 2> /dev/null
