#!/usr/bin/env bash
# cmake --install of this build tree into a temporary prefix, then what a user of the installed
# tree does: a separate CMake project (consumer/) finds it with find_package(attngrad CONFIG
# REQUIRED), builds and runs against it (the C ABI and the C++ API on the CPU backend; with the
# client, one round trip to the installed attngrad-server on loopback), and pkg-config gives the
# flags that compile and link a C program against libattngrad.
#
#   install_consumer_test.sh BUILD_DIR CONSUMER_SOURCE_DIR HAS_CLIENT(ON|OFF) CMAKE C_COMPILER
#                            CXX_COMPILER GENERATOR
# Exit status 0 when every step passes; the temporary prefix is removed either way.
set -euo pipefail

build_dir=$1
consumer_source=$2
has_client=$3
cmake=$4
c_compiler=$5
cxx_compiler=$6
generator=$7

work=$(mktemp -d "${TMPDIR:-/tmp}/attngrad-install-test.XXXXXX")
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

prefix=$work/prefix
unset DESTDIR # the install goes to $prefix itself, whatever the caller's environment says
step() { echo "--- $*"; }
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

step "cmake --install $build_dir --prefix $prefix"
"$cmake" --install "$build_dir" --prefix "$prefix" > "$work/install.log" ||
  { cat "$work/install.log" >&2; fail "cmake --install (are all targets built?)"; }

# What the install must hold, wherever GNUInstallDirs put lib/ (lib or lib64).
find_one() {
  local found
  found=$(find "$prefix" -path "$prefix/$1" -print -quit)
  [[ -n "$found" ]] || fail "the install has no $1"
  echo "$found"
}
find_one "include/attngrad/attngrad.h" > /dev/null
find_one "include/attngrad/backward.h" > /dev/null
library=$(find_one "lib*/libattngrad.so")
config=$(find_one "lib*/cmake/attngrad/attngradConfig.cmake")
find_one "lib*/cmake/attngrad/attngradConfigVersion.cmake" > /dev/null
pc_file=$(find_one "lib*/pkgconfig/attngrad.pc")
if [[ "$has_client" == "ON" ]]; then
  find_one "bin/attngrad-server" > /dev/null
  find_one "bin/attngrad-cli" > /dev/null
  find_one "include/attngrad/client.h" > /dev/null
  find_one "include/attngrad/sharded_client.h" > /dev/null
  find_one "include/attngrad/v1/attngrad.pb.h" > /dev/null
  find_one "include/attngrad/v1/tensor.pb.h" > /dev/null
  find_one "lib*/libattngrad_client.a" > /dev/null
else
  [[ -z "$(find "$prefix" -name client.h -o -name 'libattngrad_client*')" ]] ||
    fail "a kernels-only install holds client files"
fi
echo "installed: $library, $config"

step "configure the consumer project against $prefix"
consumer_build=$work/consumer-build
"$cmake" -S "$consumer_source" -B "$consumer_build" -G "$generator" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER="$c_compiler" -DCMAKE_CXX_COMPILER="$cxx_compiler" \
  -DCMAKE_PREFIX_PATH="$prefix" \
  -DATTNGRAD_CONSUMER_EXPECTED_PREFIX="$prefix" \
  -DATTNGRAD_CONSUMER_EXPECT_CLIENT="$has_client"

step "build the consumer project"
"$cmake" --build "$consumer_build" -j2

step "run the C ABI consumer"
"$consumer_build/attngrad_consumer_c"
step "run the C++ API consumer"
"$consumer_build/attngrad_consumer_cxx"

if [[ "$has_client" == "ON" ]]; then
  # A free loopback port: bound once by the kernel's choice, then released for the server. Another
  # process may take it in between: the server then exits at once, and the next attempt takes
  # another port.
  for attempt in 1 2 3; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    step "start the installed attngrad-server on 127.0.0.1:$port (CPU), attempt $attempt"
    "$prefix/bin/attngrad-server" --devices=cpu --listen="127.0.0.1:$port" --metrics_listen= \
      --shutdown_grace_seconds=5 > "$work/server.log" 2>&1 &
    server_pid=$!
    # Until the port accepts connections, or the server has exited (120 s at most).
    for _ in $(seq 1200); do
      if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
      if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
      sleep 0.1
    done
    if kill -0 "$server_pid" 2>/dev/null; then break; fi
    wait "$server_pid" || true
    server_pid=""
    echo "attngrad-server exited before serving:" >&2
    cat "$work/server.log" >&2
  done
  [[ -n "$server_pid" ]] || fail "attngrad-server did not start"

  step "client round trip"
  if ! "$consumer_build/attngrad_consumer_client" "127.0.0.1:$port"; then
    echo "server log:" >&2
    cat "$work/server.log" >&2
    fail "the client round trip"
  fi

  step "the installed attngrad-cli: info"
  "$prefix/bin/attngrad-cli" info --target="127.0.0.1:$port" ||
    { cat "$work/server.log" >&2; fail "attngrad-cli info"; }

  step "stop the server (SIGTERM)"
  kill -TERM "$server_pid"
  server_status=0
  wait "$server_pid" || server_status=$?
  server_pid=""
  if [[ "$server_status" -ne 0 ]]; then
    cat "$work/server.log" >&2
    fail "attngrad-server exited with status $server_status after SIGTERM"
  fi
fi

step "pkg-config --cflags --libs attngrad"
if ! command -v pkg-config > /dev/null; then
  fail "pkg-config is not installed (Debian: pkg-config or pkgconf)"
fi
pc_dir=$(dirname "$pc_file")
export PKG_CONFIG_PATH="$pc_dir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
flags=$(pkg-config --cflags --libs attngrad)
libdir=$(pkg-config --variable=libdir attngrad)
echo "pkg-config: $flags (version $(pkg-config --modversion attngrad))"
# shellcheck disable=SC2086  # the flags are words
"$c_compiler" -std=c99 -O1 -o "$work/c_abi_pkg_config" "$consumer_source/c_abi.c" $flags -lm \
  -Wl,-rpath,"$libdir"
"$work/c_abi_pkg_config"

echo "PASS: install, find_package consumer and pkg-config"
