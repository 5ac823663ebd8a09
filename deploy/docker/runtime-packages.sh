#!/bin/bash
# runtime-packages.sh BINARY...: prints, one a line and sorted, the Debian/Ubuntu packages that own the
# shared libraries the given binaries load (from ldd), so that the runtime image installs exactly
# what the build linked against, whatever the distribution names its runtime packages (Ubuntu 24.04's
# libgrpc++1.51t64 vs Debian 12's libgrpc++1.51, ...). Libraries under /usr/local/cuda* are left out:
# the nvidia/cuda runtime image already has them (and the driver's libcuda is mounted at run time).
# Fails when a library is not found or belongs to no package (the image would not start).
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: $0 BINARY..." >&2
  exit 64
fi
declare -A packages=()
for binary in "$@"; do
  if ! ldd_output=$(ldd "$binary"); then
    echo "runtime-packages: ldd failed on $binary" >&2
    exit 1
  fi
  if grep -q 'not found' <<<"$ldd_output"; then
    echo "runtime-packages: $binary has unresolved libraries:" >&2
    grep 'not found' <<<"$ldd_output" >&2
    exit 1
  fi
  # Lines look like "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)".
  while read -r library; do
    case "$library" in
      /usr/local/cuda*) continue ;;
    esac
    # dpkg records one spelling of each path; with merged /usr, ldd may print the other one
    # (/lib/... vs /usr/lib/...), so try the path, its other spelling and its resolved target.
    resolved=$(readlink -f "$library")
    case "$resolved" in
      /usr/local/cuda*) continue ;;
    esac
    owner=""
    for candidate in "$library" "/usr${library}" "${library#/usr}" "$resolved" "/usr${resolved}" "${resolved#/usr}"; do
      if owner=$(dpkg-query -S "$candidate" 2>/dev/null | head -n 1); then
        [[ -n "$owner" ]] && break
      fi
    done
    owner="${owner%%: *}"   # "pkg:arch: /path" or "pkg1, pkg2: /path"
    owner="${owner%%, *}"
    if [[ -z "$owner" ]]; then
      echo "runtime-packages: no package owns $library (needed by $binary)" >&2
      exit 1
    fi
    packages["${owner%%:*}"]=1
  done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_output")
done
printf '%s\n' "${!packages[@]}" | LC_ALL=C sort
