#!/usr/bin/env bash
# The README's main job: installs the system packages, builds, starts attngrad-server (on the GPU
# when one is present, else on the CPU backend) with random weights on loopback, streams batches to
# it with attngrad-cli (RETURN batches checked against the local CPU reference under SPEC section 4,
# ACCUMULATE batches, a fetch, a short benchmark), prints the server's metrics, and stops the server.
# Environment: ATTNGRAD_DEMO_BATCH / ATTNGRAD_DEMO_SEQ_LEN (default 2 x 16: small enough for the CPU
# backend; try 4 x 1024 on a GPU), ATTNGRAD_DEMO_PORT (50051), ATTNGRAD_DEMO_METRICS_PORT (9464).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target attngrad-server attngrad-cli

batch=${ATTNGRAD_DEMO_BATCH:-2}
seq_len=${ATTNGRAD_DEMO_SEQ_LEN:-16}
target=127.0.0.1:${ATTNGRAD_DEMO_PORT:-50051}
metrics=127.0.0.1:${ATTNGRAD_DEMO_METRICS_PORT:-9464}
server=build/server/attngrad-server
cli=build/client/attngrad-cli

step() { printf '\n==> %s\n' "$*"; }

step "starting $server on $target (metrics on http://$metrics/metrics)"
"$server" --listen="$target" --metrics_listen="$metrics" --weights=random --weights_seed=0 &
server_pid=$!
trap 'kill -TERM "$server_pid" 2>/dev/null || true' EXIT

"$cli" health --target="$target" --connect_timeout_seconds=120
step "model info"
"$cli" info --target="$target"
step "3 RETURN batches of ${batch}x${seq_len} tokens, each checked against the CPU reference (SPEC section 4)"
"$cli" backward --target="$target" --batch="$batch" --seq_len="$seq_len" --count=3 \
  --check --check_weights=server --weights_seed=0
step "4 ACCUMULATE batches, then fetch-and-zero the server's sums"
"$cli" backward --target="$target" --mode=accumulate --batch="$batch" --seq_len="$seq_len" --count=4
"$cli" fetch --target="$target" --zero_after
step "benchmark: 2 streams x 2 batches in flight"
"$cli" bench --target="$target" --streams=2 --in_flight=2 --count=4 --batch="$batch" --seq_len="$seq_len"
step "metrics summary"
"$cli" metrics --metrics_target="$metrics"

step "stopping the server (SIGTERM: in-flight batches finish, exit 0)"
kill -TERM "$server_pid"
trap - EXIT
wait "$server_pid"
echo "demo done"
