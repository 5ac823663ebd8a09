#!/usr/bin/env bash
# Runs a test binary with OpenBLAS forced to one of the kernel sets of its DYNAMIC_ARCH build
# (OPENBLAS_CORETYPE), so that a CPU backend tolerance that holds only for the kernels this
# machine's CPU selects fails here rather than on a user's machine with another CPU.
#   with_openblas_core.sh CORE CPU_FLAG BINARY [ARGS...]
# CPU_FLAG is the /proc/cpuinfo flag the core's kernels need (they would die of SIGILL without it):
# without it the run is skipped (exit 77). The run fails unless OpenBLAS reports that it selected
# CORE, so it can never pass while testing the default kernels instead.
set -euo pipefail
core=$1
flag=$2
shift 2
if ! grep -qw -- "$flag" /proc/cpuinfo; then
  echo "skipped: this CPU lacks '$flag', which OpenBLAS's $core kernels need"
  exit 77
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
OPENBLAS_CORETYPE=$core OPENBLAS_VERBOSE=2 "$@" 2>"$log" || status=$?
cat "$log" >&2
if ! grep -qx "Core: $core" "$log"; then
  echo "OpenBLAS did not report selecting the $core kernels (OPENBLAS_VERBOSE=2 said: $(grep '^Core' "$log" || echo nothing))" >&2
  exit 1
fi
exit "$status"
