#!/bin/bash
# local-bases.sh: makes local stand-ins for the base images of deploy/docker/Dockerfile on a machine
# that cannot pull nvidia/cuda (no registry reachable), from the Debian mirrors and the CUDA Toolkit
# installed on this host. Needs root, mmdebstrap and podman.
#
#   deploy/docker/local-bases.sh              the CPU base and the two CUDA bases
#   deploy/docker/local-bases.sh --cpu-only   only the CPU base (no CUDA Toolkit needed)
#
# Images (PREFIX defaults to localhost/attngrad-base, SUITE to bookworm):
#   PREFIX:SUITE-cpu           Debian minbase + passwd + ca-certificates: build and run base of the
#                              CPU-only image (build argument CUDA_BACKEND=OFF)
#   PREFIX:SUITE-cuda-devel    the CPU base + this host's CUDA Toolkit (the whole of /usr/local/cuda,
#                              nvcc on PATH): stands in for nvidia/cuda:*-devel-*
#   PREFIX:SUITE-cuda-runtime  the CPU base + only the CUDA libraries the binaries load: the CUDA
#                              runtime and cuBLASLt (linked) and NCCL (dlopen()ed by the server for
#                              sums over several GPUs): stands in for nvidia/cuda:*-runtime-*
# Then, from the repository root:
#   podman build --format docker -f deploy/docker/Dockerfile \
#     --build-arg BUILD_BASE=localhost/attngrad-base:bookworm-cuda-devel \
#     --build-arg RUNTIME_BASE=localhost/attngrad-base:bookworm-cuda-runtime -t attngrad:latest .
#
# Options: --cpu-only, --suite=SUITE, --prefix=PREFIX, --cuda=DIR (default /usr/local/cuda),
# --rebuild (replace images that exist; by default an existing image is kept).
# PODMAN may name the podman command with its options, e.g. "podman --runtime runc".
set -euo pipefail

suite=bookworm
prefix=localhost/attngrad-base
cuda=/usr/local/cuda
cpu_only=0
rebuild=0
for argument in "$@"; do
  case "$argument" in
    --cpu-only) cpu_only=1 ;;
    --rebuild) rebuild=1 ;;
    --suite=*) suite="${argument#*=}" ;;
    --prefix=*) prefix="${argument#*=}" ;;
    --cuda=*) cuda="${argument#*=}" ;;
    *) echo "local-bases: unknown argument $argument (see the comment at the top)" >&2; exit 64 ;;
  esac
done
read -r -a podman <<<"${PODMAN:-podman}"
for tool in mmdebstrap tar "${podman[0]}"; do
  command -v "$tool" >/dev/null || { echo "local-bases: $tool not found (Debian: apt-get install podman mmdebstrap)" >&2; exit 69; }
done

cpu_image="$prefix:$suite-cpu"
devel_image="$prefix:$suite-cuda-devel"
runtime_image="$prefix:$suite-cuda-runtime"
wanted=("$cpu_image")
[[ $cpu_only == 1 ]] || wanted+=("$devel_image" "$runtime_image")
missing=()
for image in "${wanted[@]}"; do
  if [[ $rebuild == 1 ]] || ! "${podman[@]}" image exists "$image"; then missing+=("$image"); fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "local-bases: ${wanted[*]} already exist (--rebuild replaces them)"
  exit 0
fi

if [[ $cpu_only == 0 ]]; then
  cuda_root=$(readlink -f "$cuda")
  # The toolkit's library folder: lib64 in NVIDIA's packages, lib in some installs (lib64 -> lib).
  cuda_library_dir=""
  for candidate in lib64 lib targets/x86_64-linux/lib; do
    if compgen -G "$cuda_root/$candidate/libcudart.so.*" >/dev/null; then
      cuda_library_dir="$cuda_root/$candidate"
      break
    fi
  done
  if [[ ! -x "$cuda_root/bin/nvcc" || -z "$cuda_library_dir" ]]; then
    echo "local-bases: no CUDA Toolkit at $cuda (nvcc and libcudart.so.*); use --cpu-only" >&2
    exit 69
  fi
  # Where the image puts the toolkit: /usr/local/<the host's folder name>, /usr/local/cuda pointing
  # at it, as NVIDIA's images have it (so the binaries' RUNPATH, the toolkit's library folder at
  # build time, is the same folder in the runtime image).
  cuda_name=$(basename "$cuda_root")
  cuda_library_relative="${cuda_library_dir#"$cuda_root"/}"
fi

work=$(mktemp -d /var/tmp/attngrad-bases.XXXXXX)
trap 'rm -rf "$work"' EXIT

started=$SECONDS
# minbase: the Essential packages and apt. passwd (useradd) and ca-certificates are in NVIDIA's
# Ubuntu images too, and the Dockerfile uses both. Slimmed as Docker's Debian and Ubuntu images are:
# merged /usr made by mmdebstrap's hook instead of the usrmerge package (which brings perl, ~50 MB),
# no documentation, manual pages or translations from any package installed later either (copyright
# files kept), and apt keeps neither downloaded packages nor its caches.
# The hooks' "$1" (the new root) is expanded by mmdebstrap's shell, not here.
# shellcheck disable=SC2016
mmdebstrap_options=(--variant=minbase --include=passwd --include=ca-certificates
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias'
  --customize-hook='printf "%s\n" "APT::Keep-Downloaded-Packages \"false\";" "Dir::Cache::pkgcache \"\";" "Dir::Cache::srcpkgcache \"\";" >"$1/etc/apt/apt.conf.d/90slim-image"'
  --customize-hook='rm -f "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb')
if [[ -d /usr/share/mmdebstrap/hooks/merged-usr ]]; then
  mmdebstrap_options+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
fi
mmdebstrap --quiet "${mmdebstrap_options[@]}" "$suite" "$work/rootfs"
echo "local-bases: Debian $suite minbase in $((SECONDS - started)) s"

# import IMAGE FOLDER [tar arguments...]: FOLDER (a root file system) and the further tar members as
# one layer (each path once: the layer may not name a path twice).
import() {
  local image="$1" folder="$2"
  shift 2
  local changes=(--change 'CMD ["/bin/bash"]')
  if [[ "$image" == "$devel_image" ]]; then
    changes+=(--change "ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
  fi
  tar --numeric-owner -C "$folder" -c . "$@" -f "$work/layer.tar"
  "${podman[@]}" import "${changes[@]}" "$work/layer.tar" "$image" >/dev/null
  rm -f "$work/layer.tar"
  echo "local-bases: $image ($("${podman[@]}" image inspect --format '{{.Size}}' "$image") bytes)"
}

if [[ " ${missing[*]} " == *" $cpu_image "* ]]; then
  import "$cpu_image" "$work/rootfs"
fi

if [[ $cpu_only == 0 ]]; then
  # Both CUDA bases: /usr/local/cuda -> the toolkit folder, and the library folder known to ld.so.
  for flavour in devel runtime; do
    cp -a "$work/rootfs" "$work/$flavour"
    ln -s "$cuda_name" "$work/$flavour/usr/local/cuda"
    echo "/usr/local/$cuda_name/$cuda_library_relative" >"$work/$flavour/etc/ld.so.conf.d/attngrad-cuda.conf"
  done
  if [[ " ${missing[*]} " == *" $devel_image "* ]]; then
    # The toolkit's members renamed into usr/local/ (S: not the targets of symbolic links, such as
    # /usr/local/cuda's).
    import "$devel_image" "$work/devel" -C "$(dirname "$cuda_root")" \
      --transform="s,^$cuda_name,usr/local/$cuda_name,S" "$cuda_name"
  fi
  if [[ " ${missing[*]} " == *" $runtime_image "* ]]; then
    runtime_libraries="$work/runtime/usr/local/$cuda_name/$cuda_library_relative"
    mkdir -p "$runtime_libraries"
    # Each by its SONAME (libcudart.so.13, ...), the name the loader asks for, dereferenced.
    for stem in cudart cublasLt nccl; do
      found=""
      for library in "$cuda_library_dir/lib$stem.so".*; do
        [[ -e "$library" ]] || continue
        soname=$(objdump -p "$library" 2>/dev/null | awk '$1 == "SONAME" {print $2}')
        [[ -n "$soname" ]] || soname=$(basename "$library")
        if [[ ! -e "$runtime_libraries/$soname" ]]; then
          cp -L "$cuda_library_dir/$soname" "$runtime_libraries/$soname"
          found="$soname"
        fi
      done
      if [[ -z "$found" && ! -e "$runtime_libraries/lib$stem.so" ]]; then
        if [[ "$stem" == nccl ]]; then
          echo "local-bases: no libnccl in $cuda_library_dir: the image sums gradients over GPUs on the host" >&2
        else
          echo "local-bases: lib$stem.so.* not found in $cuda_library_dir" >&2
          exit 69
        fi
      fi
    done
    import "$runtime_image" "$work/runtime"
  fi
fi
echo "local-bases: done in $((SECONDS - started)) s"
