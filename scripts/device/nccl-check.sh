#!/usr/bin/env bash
# Runs the NCCL cross-GPU gradient-sum test on a machine with two GPUs and prints its result.
# The caller sets LD_LIBRARY_PATH so that libnccl.so.2 loads (the server dlopen()s it at run time)
# and the binaries find their libraries (the same ones attngrad-server needs; GoogleTest is static).
#   scripts/device/nccl-check.sh [DIR]   # DIR: a CUDA build directory (default build-server-gpu),
#                                        # or a folder holding attngrad_server_test and
#                                        # attngrad_server_gpu_test themselves (a carried bundle)
# Runs: the dlopen wrapper's tests (NcclLibrary*, no GPU needed) and ServerNcclSumTest (two GPUs,
# the server in-process with --devices=0,1 --nccl=on). Exit status 0 only when the GPU test ran and
# passed (a skip, e.g. fewer than two GPUs or no libnccl.so.2, exits 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-server-gpu}
# NVLink multicast stays off (it can take a shared host's GPUs out of service; ncclReduce needs none).
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

echo "nccl-check: $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') build=$build"
command -v nvidia-smi >/dev/null && nvidia-smi -L
echo "nccl-check: LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

status=0
bindir="$build/tests/server"
[[ -x "$bindir/attngrad_server_gpu_test" ]] || bindir="$build"
unit="$bindir/attngrad_server_test"
if [[ -x "$unit" ]]; then
  "$unit" --gtest_filter='NcclLibraryTest.*' --gtest_color=no || status=1
else
  echo "nccl-check: $unit not built (cmake --build $build --target attngrad_server_test)"
  status=1
fi

gpu="$bindir/attngrad_server_gpu_test"
if [[ ! -x "$gpu" ]]; then
  echo "nccl-check: $gpu not built (cmake --build $build --target attngrad_server_gpu_test)"
  echo "nccl-check: RESULT FAIL (not built)"
  exit 1
fi
log=$(mktemp)
"$gpu" --gtest_filter='ServerNcclSumTest.*' --gtest_color=no 2>&1 | tee "$log"
gpu_rc=${PIPESTATUS[0]}
if [[ $gpu_rc -ne 0 ]]; then
  result="FAIL (exit $gpu_rc)"
  status=1
elif grep -q '^\[  SKIPPED \]' "$log"; then
  result="SKIPPED: $(grep -m1 -A1 ': Skipped$' "$log" | tail -1)"
  [[ $status -eq 0 ]] && status=2
elif grep -q '^\[  PASSED  \] 1 test' "$log"; then
  result="PASS"
else
  result="UNKNOWN (no test ran?)"
  status=1
fi
rm -f "$log"
[[ $status -eq 1 && $result == PASS ]] && result="PASS (but NcclLibraryTest failed)"
echo "nccl-check: RESULT $result"
exit $status
