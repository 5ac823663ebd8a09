#!/usr/bin/env bash
# Stages a build's binaries for bench/device/run.sh, on the machine that built them; carry the
# folder it makes (inside the checkout and ignored by git: build-*).
#   bench/device/stage.sh kernels BUILD BASE DIR [NAME=BUILD ...]
#       DIR/bundle.tar.xz for the kernels and ncu suites: libattngrad.so, the GPU, attention and
#       wgmma tests, attngrad_bench and attngrad_attention_bench of BUILD; base/ with the two
#       benches of BASE (the build to compare with); one folder per NAME=BUILD with that build's
#       attngrad_bench (and attngrad_attention_bench with ATTENTION_VARIANTS=1) and its
#       attngrad_gpu_tests and attngrad_hopper_wgmma_tests where it has them; lib/ with the
#       libraries the benches load that a device lacks (OpenBLAS). Packed with xz -9, whose
#       dictionary holds a whole binary, so builds that share most of their code cost little more
#       than one (a 64 MiB carry holds five builds). Then e.g.
#       K=DIR VARIANTS="NAME ..." bash bench/device/run.sh kernels
#   bench/device/stage.sh service [BUILD] [DIR]   (in the checkout; default build-h200s build-final)
#       DIR/svc.tar.xz for the service suites: stripped attngrad-server, attngrad-cli,
#       attngrad_wire_ceiling, the server, wire, soak and GPU tests, their shared libraries in lib/
#       and build_dir.txt (BUILD's absolute path, where the carried tests look for the server);
#       generates the Python client's stubs (carry client/python/attngrad/v1 too). Then e.g.
#       B=DIR bash bench/device/run.sh service:service
#   bench/device/stage.sh libs BINARY [BINARY ...] DIR
#       copies the shared libraries the binaries need and a GPU machine may lack (gRPC, protobuf,
#       Abseil, prometheus-cpp, OpenSSL, OpenBLAS, ...) into DIR; the C runtime, libstdc++, zlib
#       and the CUDA and driver libraries are left to the machine. run.sh puts a carried folder's
#       lib/ (or LIBS) on LD_LIBRARY_PATH.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
repo=$(dirname "$(dirname "$(dirname "$self")")")

usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$self"; }

libs() {  # BINARY... DIR
  [ $# -ge 2 ] || { usage >&2; exit 2; }
  local dir="${!#}" bin lib real
  mkdir -p "$dir"
  for bin in "${@:1:$#-1}"; do
    ldd "$bin" | awk '/=>/ {print $3}' | while read -r lib; do
      [ -n "$lib" ] || continue
      real=$(readlink -f "$lib")
      case "$real" in
        /usr/local/cuda*|*/libcuda.so*|*/libnvidia*|*/libc.so*|*/libm.so*|*/libpthread*|\
        */libdl.so*|*/librt.so*|*/libgcc_s*|*/libstdc++*|*/libz.so*|*/ld-linux*) ;;
        *) cp -Ln "$lib" "$dir/" 2> /dev/null || true ;;
      esac
    done
  done
  echo "bundled $(find "$dir" -mindepth 1 -maxdepth 1 | wc -l) libraries ($(du -sh "$dir" | cut -f1)) into $dir"
}

find_binary() {  # $1 build, $2 name: the file of that name under the build
  local found
  found=$(find "$1" -name "$2" -type f | head -1)
  [ -n "$found" ] || { echo "stage: no $2 under $1" >&2; exit 1; }
  echo "$found"
}

kernels() {  # BUILD BASE DIR [NAME=BUILD ...]
  [ $# -ge 3 ] || { usage >&2; exit 2; }
  local build=$1 base=$2 dir=$3 stage variant name binary tests
  shift 3
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  cp "$(find_binary "$build" libattngrad.so.0.1.0)" "$stage/libattngrad.so"
  for binary in attngrad_gpu_tests attngrad_attention_tests attngrad_hopper_wgmma_tests \
    attngrad_bench attngrad_attention_bench; do
    cp "$(find_binary "$build" "$binary")" "$stage/"
  done
  mkdir -p "$stage/base" "$stage/lib"
  cp "$(find_binary "$base" attngrad_bench)" "$(find_binary "$base" attngrad_attention_bench)" \
    "$stage/base/"
  for variant in "$@"; do
    name=${variant%%=*}
    mkdir -p "$stage/$name"
    cp "$(find_binary "${variant#*=}" attngrad_bench)" "$stage/$name/"
    if [ "${ATTENTION_VARIANTS:-0}" = 1 ]; then
      cp "$(find_binary "${variant#*=}" attngrad_attention_bench)" "$stage/$name/"
    fi
    # The variant's own GPU and wgmma tests too, where its build has them.
    for binary in attngrad_gpu_tests attngrad_hopper_wgmma_tests; do
      tests=$(find "${variant#*=}" -name "$binary" -type f | head -1)
      if [ -n "$tests" ]; then cp "$tests" "$stage/$name/"; fi
    done
  done
  libs "$stage/attngrad_bench" "$stage/lib" > /dev/null
  mkdir -p "$dir"
  tar -cf - -C "$stage" . | xz -T2 -9 > "$dir/bundle.tar.xz"
  echo "staged $(du -h "$dir/bundle.tar.xz" | cut -f1) into $dir/bundle.tar.xz"
}

service() {  # [BUILD] [DIR], relative to the checkout's root
  cd "$repo"
  local build=${1:-build-h200s} dir=${2:-build-final} stage binary
  local binaries=(server/attngrad-server client/attngrad-cli bench/wire_ceiling/attngrad_wire_ceiling
                  tests/server/attngrad_server_test tests/server/attngrad_server_wire_test
                  tests/server/attngrad_server_gpu_test tests/server/attngrad_soak_test
                  tests/gpu/attngrad_gpu_tests)
  stage="$dir/stage"
  rm -rf "$dir" && mkdir -p "$stage"
  for binary in "${binaries[@]}"; do
    strip -o "$stage/$(basename "$binary")" "$build/$binary"
  done
  (cd "$build" && pwd) > "$stage/build_dir.txt"
  libs "${binaries[@]/#/$build/}" "$stage/lib"
  bash client/python/generate_stubs.sh > /dev/null
  tar -cJf "$dir/svc.tar.xz" -C "$stage" .
  rm -rf "$stage"
  echo "staged $(du -sh "$dir/svc.tar.xz" | cut -f1) into $dir/svc.tar.xz"
}

what=${1:-}
[ $# -gt 0 ] && shift
case "$what" in
  kernels) kernels "$@" ;;
  service) service "$@" ;;
  libs) libs "$@" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
