#!/usr/bin/env bash
# Checks the Python code with flake8 (pycodestyle + pyflakes, from Debian's flake8 package) and
# the repository's .flake8. Exit 0: clean; 1: violations (listed); 77: no flake8 here.
#   scripts/check-python.sh              the Python files tracked by git
#   scripts/check-python.sh FILE...      only these files
set -euo pipefail
cd "$(dirname "$0")/.."
linter=()
if command -v flake8 >/dev/null; then
  linter=(flake8)
elif command -v python3 >/dev/null && python3 -m flake8 --version >/dev/null 2>&1; then
  linter=(python3 -m flake8)
else
  echo "check-python: SKIPPED, flake8 not found (apt-get install flake8)" >&2
  exit 77
fi
if [[ $# -gt 0 ]]; then
  files=("$@")
elif git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.py')
else
  # A source tree without git (a tarball): the folders that hold the Python code.
  mapfile -t files < <(find bench client/python deploy tests/deploy tests/fixtures tests/python \
    -name '*.py' -not -path '*/__pycache__/*' | sort)
fi
if [[ ${#files[@]} -eq 0 ]]; then
  echo "check-python: no Python files found" >&2
  exit 1
fi
if ! "${linter[@]}" --config .flake8 -- "${files[@]}"; then
  echo "check-python: violations above (config .flake8)" >&2
  exit 1
fi
echo "check-python: ${#files[@]} files pass flake8"
