#!/usr/bin/env bash
# The README's test command: installs the system packages, configures (CUDA backend when nvcc is
# found), builds everything and runs every test under ctest. GPU tests skip themselves without a GPU.
# Extra arguments go to ctest (e.g. -L cpu, -R Server).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default
cmake --build --preset default
ctest --preset default "$@"
