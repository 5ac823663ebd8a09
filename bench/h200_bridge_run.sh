#!/usr/bin/env bash
# One device call (H200) for the Python autograd bridge: one 1x1024 ACCUMULATE
# loss.backward() of attngrad.torch.RemoteGemma3Attention in a loop, zero_copy=True (CUDA IPC) and
# over TCP, with two Python client trees against ONE server on GPU 0, alternated (TREES, default
# "py-main py-new py-main py-new"), so that both see the same server and machine.
# The carried folder $B (default build-bridge) holds bridge.tar.xz: attngrad-server (stripped,
# built sm_90a), lib/ (its shared libraries: shared/tools/bundle-libs.sh) and one folder per tree
# (py-main/, py-new/), each with client/python (generated stubs in attngrad/v1), tests/python and
# bench/cuda_ipc_bench.py. In order:
#   1. the server on GPU 0, then for each tree in TREES its own bench/cuda_ipc_bench.py
#      --only=bridge,bridge_tcp --count=COUNT (default 40; --phases for trees named py-new*),
#      each within BENCH_LIMIT seconds (default 60);
#   2. TESTS (default "test_cuda_ipc test_torch_bridge test_offload") of the last tree in TREES,
#      from its tests/python, each within TEST_LIMIT seconds (default 70; test_cuda_ipc starts a
#      server of its own on GPU 0, the others on the CPU backend).
# Logs and JSON go to $OUT; a summary (p50/p90 per tree and path) is printed last.
#   B=build-bridge bash build-bridge/h200_bridge_run.sh      (run from the repository root)
set -u
B=${B:-build-bridge}
TREES=${TREES:-"py-main py-new py-main py-new"}
COUNT=${COUNT:-40}
source bench/device_setup.sh  # (run from the repository root)
device_setup_with_torch_clients "$B" "${ARCHIVE:-bridge.tar.xz}"

"$SERVER_BINARY" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= \
  --shutdown_grace_seconds=2 > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
run=0
for tree in $TREES; do
  run=$((run + 1))
  phases=()
  case "$tree" in py-new*) phases=(--phases) ;; esac
  timeout "${BENCH_LIMIT:-60}" python3 "$B/$tree/bench/cuda_ipc_bench.py" \
    --target=127.0.0.1:50051 --client_id="bridge-$tree" --only=bridge,bridge_tcp \
    --count="$COUNT" "${phases[@]}" --json="$OUT/bridge-$run-$tree.json" \
    > "$OUT/bridge-$run-$tree.log" 2>&1
  echo "exit $?" >> "$OUT/bridge-$run-$tree.log"
done
kill -TERM $SERVER_PID; wait $SERVER_PID
last_tree=${TREES##* }
for suite in ${TESTS-test_cuda_ipc test_torch_bridge test_offload}; do
  (cd "$B/$last_tree/tests/python" && ATTNGRAD_SERVER="$SERVER_BINARY" \
     timeout "${TEST_LIMIT:-70}" python3 -m unittest -v "$suite" > "$OUT/$suite.log" 2>&1
   echo "exit $?" >> "$OUT/$suite.log")
done

date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
for suite in ${TESTS-test_cuda_ipc test_torch_bridge test_offload}; do
  echo "-- $suite"
  grep -E "^test_.*(ok|FAIL|ERROR|skipped.*)$|^Ran|^OK|^FAILED|^exit" "$OUT/$suite.log" | head -30
done
run=0
for tree in $TREES; do
  run=$((run + 1))
  echo "-- run $run $tree"
  grep -vE "^\s*$" "$OUT/bridge-$run-$tree.log" | tail -6
done
