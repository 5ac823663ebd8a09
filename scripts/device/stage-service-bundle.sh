#!/usr/bin/env bash
# Stages the service's binaries of a CUDA build for a device call: stripped copies of
# attngrad-server, attngrad-cli, attngrad_wire_ceiling, the server, wire, soak and GPU tests, their
# shared libraries (shared/tools/bundle-libs.sh) and the Python client's generated stubs, packed as
# DIR/svc.tar.xz (what bench/h200_service_run.sh and bench/h200_cuda_ipc_run.sh ARCHIVE=svc.tar.xz
# unpack). Carry DIR and client/python/attngrad/v1.
#   scripts/device/stage-service-bundle.sh [BUILD] [DIR]   # defaults build-h200s build-final
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-h200s}
dir=${2:-build-final}
binaries=(server/attngrad-server client/attngrad-cli bench/wire_ceiling/attngrad_wire_ceiling
          tests/server/attngrad_server_test tests/server/attngrad_server_wire_test
          tests/server/attngrad_server_gpu_test tests/server/attngrad_soak_test
          tests/gpu/attngrad_gpu_tests)
stage="$dir/stage"
rm -rf "$dir" && mkdir -p "$stage"
for binary in "${binaries[@]}"; do
  strip -o "$stage/$(basename "$binary")" "$build/$binary"
done
shared=/work/shared/tools/bundle-libs.sh
[ -x "$shared" ] || shared="$(dirname "$PWD")/shared/tools/bundle-libs.sh"
"$shared" "${binaries[@]/#/$build/}" "$stage/lib"
bash client/python/generate_stubs.sh > /dev/null
tar -cJf "$dir/svc.tar.xz" -C "$stage" .
rm -rf "$stage"
echo "staged $(du -sh "$dir/svc.tar.xz" | cut -f1) into $dir/svc.tar.xz"
