#!/usr/bin/env bash
# Checks that the C++ and CUDA sources follow .clang-format (clang-format 14 from Debian's
# clang-format package). Exit 0: formatted; 1: files to reformat (listed); 77: no clang-format here.
#   scripts/check-format.sh          check
#   scripts/check-format.sh --fix    reformat in place
set -euo pipefail
cd "$(dirname "$0")/.."
formatter=$(command -v clang-format-14 || command -v clang-format || true)
if [[ -z "$formatter" ]]; then
  echo "check-format: clang-format not found (apt-get install clang-format)" >&2
  exit 77
fi
mapfile -t files < <(git ls-files -- '*.h' '*.cc' '*.cpp' '*.cu' '*.cuh')
if [[ "${1:-}" == "--fix" ]]; then
  "$formatter" -i "${files[@]}"
  exit 0
fi
unformatted=()
for file in "${files[@]}"; do
  if ! "$formatter" --dry-run --Werror "$file" >/dev/null 2>&1; then unformatted+=("$file"); fi
done
if [[ ${#unformatted[@]} -gt 0 ]]; then
  echo "check-format: ${#unformatted[@]} files differ from .clang-format (scripts/check-format.sh --fix):"
  printf '  %s\n' "${unformatted[@]}"
  exit 1
fi
echo "check-format: ${#files[@]} files follow .clang-format"
