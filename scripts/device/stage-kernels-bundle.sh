#!/usr/bin/env bash
# Stages a CUDA build's kernel binaries for bench/h200_kernels_run.sh: libattngrad.so, the GPU,
# attention and wgmma tests, attngrad_bench and attngrad_attention_bench of BUILD; base/ with the
# two benches of BASE (the build to compare with); one folder per VARIANT=BUILD with that build's
# attngrad_bench (the script's VARIANTS; add the attention bench with ATTENTION_VARIANTS=1) and
# its attngrad_gpu_tests and attngrad_hopper_wgmma_tests where the build has them; lib/
# with the libraries the benches load that a device lacks (OpenBLAS; shared/tools/bundle-libs.sh).
# Packed as DIR/bundle.tar.xz with xz -9, whose dictionary holds a whole binary, so builds that
# share most of their code cost little more than one (a 64 MiB carry limit holds five builds).
#   scripts/device/stage-kernels-bundle.sh BUILD BASE DIR [NAME=BUILD ...]
#   e.g. scripts/device/stage-kernels-bundle.sh build-h200s ../main/build-h200s build-x tanh=build-t
# Then: K=DIR VARIANTS="NAME ..." bash bench/h200_kernels_run.sh (carry DIR; DIR inside the
# checkout, ignored by git: build-*).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,/^set -euo/{/^#/p}' "$0"
  exit 2
fi
build=$1 base=$2 dir=$3
shift 3
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
find_binary() {  # $1 build, $2 name: the file of that name under the build
  local found
  found=$(find "$1" -name "$2" -type f | head -1)
  [ -n "$found" ] || { echo "stage-kernels-bundle: no $2 under $1" >&2; exit 1; }
  echo "$found"
}
cp "$(find_binary "$build" libattngrad.so.0.1.0)" "$stage/libattngrad.so"
for binary in attngrad_gpu_tests attngrad_attention_tests attngrad_hopper_wgmma_tests attngrad_bench \
  attngrad_attention_bench; do
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
# shared/ lies beside the checkout (the script is scripts/device/ of it).
"$(cd "$(dirname "$0")/../.." && pwd)/../shared/tools/bundle-libs.sh" "$stage/attngrad_bench" \
  "$stage/lib" > /dev/null
mkdir -p "$dir"
tar -cf - -C "$stage" . | xz -T2 -9 > "$dir/bundle.tar.xz"
echo "staged $(du -h "$dir/bundle.tar.xz" | cut -f1) into $dir/bundle.tar.xz"
