#!/usr/bin/env bash
# One device call (H200) for CUDA IPC regions (same-host zero copy). The carried folder $B (default
# build-ipcr) holds ipcr.tar.xz: attngrad-server and attngrad_server_wire_test (stripped, built
# sm_90a), lib/ (their shared libraries: shared/tools/bundle-libs.sh) and py/ (client/python with
# its generated stubs, tests/python, bench/cuda_ipc_bench.py of the branch). In order:
#   1. the region tests on the GPU worker (ATTNGRAD_TEST_DEVICES=0): shared memory, and CUDA IPC
#      requests refused clearly (regions_test.cc);
#   2. tests/python/test_cuda_ipc.py: this interpreter's PyTorch as the trainer process, a server
#      on GPU 0: bit-for-bit equal to the bytes path, every bad reference INVALID_ARGUMENT;
#   3. bench/cuda_ipc_bench.py against one server on GPU 0: 4x1024 ACCUMULATE tokens/s with
#      several batches in flight, 1x128 round trips one in flight, the autograd bridge.
# ARCHIVE names another archive in $B (e.g. svc.tar.xz of bench/h200_service_run.sh, which holds
# these binaries too); PY=. takes the Python client, its tests and the bench from the checkout
# (then carry the generated stubs, client/python/attngrad/v1). Logs go to $OUT; a summary is
# printed last.
set -u
B=${B:-build-ipcr}
PY=${PY:-$B/py}
source bench/device_setup.sh  # (run from the repository root)
device_setup_with_torch_clients "$B" "${ARCHIVE:-ipcr.tar.xz}"

(ATTNGRAD_TEST_DEVICES=0 timeout 120 "$B/attngrad_server_wire_test" --gtest_filter='Regions*' \
   > "$OUT/regions_gpu.log" 2>&1; echo "exit $?" >> "$OUT/regions_gpu.log")
(cd "$PY/tests/python" && ATTNGRAD_SERVER="$SERVER_BINARY" timeout 180 \
   python3 -m unittest -v test_cuda_ipc > "$OUT/test_cuda_ipc.log" 2>&1
 echo "exit $?" >> "$OUT/test_cuda_ipc.log")
date -u +"tests done %T UTC" | tee -a "$INFO"

"$B/attngrad-server" --devices=0 --listen=127.0.0.1:50051 --metrics_listen= \
  > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
timeout "${BENCH_LIMIT:-150}" python3 "$PY/bench/cuda_ipc_bench.py" --target=127.0.0.1:50051 \
  --duration="${DURATION:-8}" --configs="${CONFIGS:-2x3,4x2}" \
  --json="$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "exit $?" >> "$OUT/bench.log"
kill -TERM $SERVER_PID; wait $SERVER_PID
date -u +"end %T UTC" | tee -a "$INFO"

echo "==== summary"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|^exit" "$OUT/regions_gpu.log"
grep -E "^test_|^Ran|^OK|^FAILED|Error|exit" "$OUT/test_cuda_ipc.log" | head -30
cat "$OUT/bench.log" | tail -20
