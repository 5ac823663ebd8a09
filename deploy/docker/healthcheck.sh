#!/bin/bash
# attngrad-healthcheck: the image's HEALTHCHECK. Asks the server's standard grpc.health.v1 service,
# through `attngrad-cli health`, on the port the server listens on (taken from ATTNGRAD_LISTEN, so the
# check follows a changed port). Exit 0 = SERVING, anything else = unhealthy.
set -euo pipefail
listen="${ATTNGRAD_LISTEN:-0.0.0.0:50051}"
port="${listen##*:}"
cli="${ATTNGRAD_CLI_BINARY:-/usr/local/bin/attngrad-cli}"
exec "$cli" health --target="127.0.0.1:${port}" "$@"
