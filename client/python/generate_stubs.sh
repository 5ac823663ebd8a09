#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/attngrad/v1/*.proto into OUT_DIR/attngrad/v1/
# (default: this package's own attngrad/v1/, which is git-ignored). Uses grpcio-tools when the
# Python interpreter has it, else Debian's protoc + grpc_python_plugin.
# Usage: generate_stubs.sh [OUT_DIR] [PYTHON]     (PYTHON defaults to /usr/bin/python3 or python3)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here}"
python="${2:-$( [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3 )}"
exec "$python" "$here/attngrad/_proto.py" "$out"
