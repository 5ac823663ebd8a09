#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (a separate CMake project, our sources
# instrumented with ASan, UBSan and libFuzzer's coverage) and runs each for N seconds on its seed
# corpus (tests/fuzz/corpus/<target>/, read only: new inputs go to <build dir>/corpus/<target>/).
#   scripts/run-fuzz.sh [--seconds N] [--build-dir DIR] [--build-only|--no-build] [target...]
# Defaults: 60 s, build-fuzz/, every target. Exit status: 0 when every target ran its time without
# a finding; 1 otherwise (the crashing input is left in <build dir>/findings/<target>/); 77 when
# clang++ is missing (ctest counts that as skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

seconds=60
build_dir=$repo/build-fuzz
build=1
run=1
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-only) run=0; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    -*) echo "run-fuzz: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(tensor_decode_fuzzer safetensors_header_fuzzer json_fuzzer metrics_http_request_fuzzer
           backward_request_fuzzer received_request_fuzzer received_response_fuzzer
           region_socket_fuzzer)
fi

if [[ $build -eq 1 ]]; then
  if ! command -v clang++ >/dev/null; then
    echo "run-fuzz: clang++ not found (scripts/install-deps.sh installs clang and libclang-rt-14-dev)" >&2
    exit 77
  fi
  cmake -S tests/fuzz -B "$build_dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build_dir" -j "${FUZZ_JOBS:-2}" --target "${targets[@]}"
fi
[[ $run -eq 1 ]] || exit 0

failed=()
for target in "${targets[@]}"; do
  binary=$build_dir/$target
  if [[ ! -x $binary ]]; then
    command -v clang++ >/dev/null || { echo "run-fuzz: clang++ not found, $target not built" >&2; exit 77; }
    echo "run-fuzz: $binary not built (run without --no-build)" >&2
    exit 2
  fi
  corpus=$build_dir/corpus/$target
  findings=$build_dir/findings/$target
  mkdir -p "$corpus" "$findings"
  echo "run-fuzz: $target for ${seconds} s"
  # -rss_limit_mb: the targets allocate little; a runaway allocation is a finding.
  if ! "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$findings/" "$corpus" "$repo/tests/fuzz/corpus/$target" \
        >"$build_dir/$target.log" 2>&1; then
    echo "run-fuzz: $target FOUND a problem; input in $findings/, log $build_dir/$target.log" >&2
    grep -m 30 -E "ERROR|SUMMARY|runtime error|#[0-9]+ 0x" "$build_dir/$target.log" >&2 || true
    failed+=("$target")
  else
    grep -E "^stat::number_of_executed_units|^stat::new_units_added|^Done" "$build_dir/$target.log" | tr '\n' ' '
    echo
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run-fuzz: findings in ${failed[*]}" >&2
  exit 1
fi
echo "run-fuzz: ${#targets[@]} targets ran ${seconds} s each, nothing found"
