#!/bin/bash
# runtime-packages.sh BINARY...: prints, one a line and sorted, the Debian/Ubuntu packages that own the
# shared libraries the given binaries load (from ldd). The Dockerfile's runtime stage installs these
# and no other, so that the image has what the build linked against, whatever the distribution names
# its runtime packages (Ubuntu 24.04's libgrpc++1.51t64, Debian 12's libgrpc++1.51, ...), and nothing
# more. Libraries under /usr/local/cuda* are left out: the runtime base has them (nvidia/cuda's
# runtime image, or local-bases.sh's), and the driver's libcuda is mounted at run time.
# Fails when a library is not found or belongs to no package (the image would not start).
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: $0 BINARY..." >&2
  exit 64
fi

libraries=()
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
  # Lines look like "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)" or "/lib64/ld-linux...".
  while read -r library; do
    resolved=$(readlink -f "$library")
    case "$library:$resolved" in
      /usr/local/cuda*|*:/usr/local/cuda*) continue ;;
    esac
    libraries+=("$library")
  done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_output")
done

# dpkg records one spelling of each path; with merged /usr, ldd may print the other one (/lib/... vs
# /usr/lib/...), so ask for the path, its other spelling and its resolved target, in one query.
declare -A owner_of=()
candidates_of() {
  local library="$1" resolved
  resolved=$(readlink -f "$library")
  printf '%s\n' "$library" "/usr${library}" "${library#/usr}" "$resolved" "/usr${resolved}" "${resolved#/usr}"
}
mapfile -t all_candidates < <(for library in "${libraries[@]}"; do candidates_of "$library"; done | sort -u)
# "pkg:arch: /path" or "pkg1, pkg2: /path"; paths not owned by any package only print to stderr.
while IFS= read -r line; do
  path="${line##*: }"
  packages="${line%: *}"
  owner="${packages%%, *}"
  [[ -n "${owner_of[$path]:-}" ]] || owner_of["$path"]="${owner%%:*}"
done < <(dpkg-query -S "${all_candidates[@]}" 2>/dev/null || true)

declare -A packages=()
for library in "${libraries[@]}"; do
  owner=""
  while read -r candidate; do
    if [[ -n "${owner_of[$candidate]:-}" ]]; then owner="${owner_of[$candidate]}"; break; fi
  done < <(candidates_of "$library")
  if [[ -z "$owner" ]]; then
    echo "runtime-packages: no package owns $library" >&2
    exit 1
  fi
  packages["$owner"]=1
done
printf '%s\n' "${!packages[@]}" | LC_ALL=C sort
