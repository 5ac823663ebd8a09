#!/usr/bin/env bash
# Installs attngrad's system packages on Debian 12+/Ubuntu 24.04+ with apt-get (idempotent: packages
# already present are skipped). The CUDA Toolkit is not installed here: it comes from NVIDIA
# (/usr/local/cuda); without it the project builds CPU-only.
#   scripts/install-deps.sh            build + test dependencies
#   scripts/install-deps.sh --runtime  only what the built server and CLI need to run
#   scripts/install-deps.sh --image-build  only what building the server and CLI needs (the image's
#                                          build stage, deploy/docker/Dockerfile)
set -euo pipefail

image_build_packages=(
  build-essential cmake pkg-config ca-certificates libssl-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libopenblas-dev nlohmann-json3-dev
)
build_packages=(
  "${image_build_packages[@]}" git curl
  libgtest-dev libgmock-dev
  prometheus                                         # prometheus + promtool for the metrics tests
  python3 python3-grpcio python3-numpy python3-yaml  # Python client and its tests
  python3-torch          # the autograd bridge's tests (tests/python/test_torch_bridge.py) on the CPU
  clang libclang-rt-dev  # libFuzzer targets (tests/fuzz); = libclang-rt-14-dev on Debian 12
  clang-format           # scripts/check-format.sh (ctest format.check)
  flake8                 # scripts/check-python.sh (ctest python.lint)
  openssl                # the TLS tests make their certificates with the openssl CLI
  # tests/container: builds the image on local Debian bases and runs it and the compose stack
  podman runc mmdebstrap podman-compose netavark aardvark-dns iptables
)
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
mode=build
[[ "${1:-}" == "--runtime" ]] && mode=runtime
[[ "${1:-}" == "--image-build" ]] && mode=image-build
if [[ "$mode" == runtime ]]; then
  # The shared libraries behind the -dev packages: their names carry SONAME versions that differ
  # between releases (libgrpc++1.51 on Debian 12, libgrpc++1.51t64 on Ubuntu 24.04), so they are
  # read off this release's package metadata.
  command -v apt-cache >/dev/null || { echo "install-deps: apt-cache not found" >&2; exit 1; }
  compgen -G '/var/lib/apt/lists/*_Packages' >/dev/null || $sudo apt-get update -qq
  packages=(ca-certificates)
  for dev in libgrpc++-dev libprotobuf-dev libabsl-dev prometheus-cpp-dev libopenblas-dev; do
    while read -r library; do packages+=("$library"); done < <(
      apt-cache depends "$dev" | awk '/^  Depends: lib/ {print $2}' | grep -v -- '-dev$' | grep -v '[<>]')
  done
elif [[ "$mode" == image-build ]]; then
  packages=("${image_build_packages[@]}")
else
  packages=("${build_packages[@]}")
fi

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
