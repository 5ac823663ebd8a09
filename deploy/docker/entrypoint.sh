#!/bin/bash
# attngrad-entrypoint: the container's entrypoint. Maps ATTNGRAD_* environment variables to the
# server's Abseil flags (names as in `attngrad-server --helpfull`) and execs the server, so that the
# server is PID 1 of the container and gets SIGTERM itself (it then drains in-flight batches for
# --shutdown_grace_seconds and exits 0).
#
# A variable that is unset leaves the server's default; one that is set, even to "", is passed.
# Order on the command line (the last occurrence of an Abseil flag wins):
#   mapped variables, then ATTNGRAD_EXTRA_ARGS (split on whitespace), then the container's arguments
#   (`docker run IMAGE --queue_depth=8`, or `args:` in Kubernetes).
# ATTNGRAD_LAYER_RANGES ("0-12,13-25": one range of decoder layers per StatefulSet replica) gives
# replica N the N-th range as --layers (after the mapped variables, before the extra and container
# arguments); N is ATTNGRAD_REPLICA_INDEX, else the ordinal ending the pod's hostname
# (attngrad-shard-1 -> 1). An ordinal without a range is an error (exit 64), not a server of the
# wrong layers.
# ATTNGRAD_SERVER_BINARY overrides the server's path; ATTNGRAD_ENTRYPOINT_DRY_RUN=1 prints the command
# line, one argument per line, instead of running it (both used by tests/deploy).
set -euo pipefail

# ENVIRONMENT_VARIABLE -> flag name. tests/deploy reads this table and checks every flag against the
# real server's --helpfull, so keep one "[VARIABLE]=flag" entry per line.
declare -A flag_of=(
  [ATTNGRAD_LISTEN]=listen
  [ATTNGRAD_METRICS_LISTEN]=metrics_listen
  [ATTNGRAD_DEVICES]=devices
  [ATTNGRAD_WEIGHTS]=weights
  [ATTNGRAD_WEIGHTS_SEED]=weights_seed
  [ATTNGRAD_WEIGHTS_LAYER]=weights_layer
  [ATTNGRAD_MODEL]=model
  [ATTNGRAD_LAYERS]=layers
  [ATTNGRAD_MAX_BATCH_TOKENS]=max_batch_tokens
  [ATTNGRAD_MAX_MESSAGE_BYTES]=max_message_bytes
  [ATTNGRAD_MAX_CONCURRENT_STREAMS]=max_concurrent_streams
  [ATTNGRAD_QUEUE_DEPTH]=queue_depth
  [ATTNGRAD_SHUTDOWN_GRACE_SECONDS]=shutdown_grace_seconds
  [ATTNGRAD_CPU_THREADS]=cpu_threads
  [ATTNGRAD_NCCL]=nccl
  [ATTNGRAD_MAX_STREAMS_PER_CLIENT]=max_streams_per_client
  [ATTNGRAD_STREAM_IDLE_TIMEOUT_SECONDS]=stream_idle_timeout_seconds
  [ATTNGRAD_CONNECTION_IDLE_TIMEOUT_SECONDS]=connection_idle_timeout_seconds
  [ATTNGRAD_MAX_CLIENTS_WITH_SUMS]=max_clients_with_sums
  [ATTNGRAD_TLS_CERT]=tls_cert
  [ATTNGRAD_TLS_KEY]=tls_key
  [ATTNGRAD_TLS_CLIENT_CA]=tls_client_ca
  [ATTNGRAD_TLS_RELOAD_INTERVAL_SECONDS]=tls_reload_interval_seconds
  [ATTNGRAD_TOKENS_FILE]=tokens_file
  [ATTNGRAD_ALLOW_UNAUTHENTICATED]=allow_unauthenticated
  [ATTNGRAD_MAX_INFLIGHT_BYTES]=max_inflight_bytes
  [ATTNGRAD_MAX_INFLIGHT_SHARE_PER_CLIENT]=max_inflight_share_per_client
  [ATTNGRAD_REGION_SOCKET]=region_socket
)

server="${ATTNGRAD_SERVER_BINARY:-/usr/local/bin/attngrad-server}"
arguments=()
# Sorted so that the command line is the same from one run to the next.
for variable in $(printf '%s\n' "${!flag_of[@]}" | LC_ALL=C sort); do
  if [[ -v "$variable" ]]; then
    value="${!variable}"
    if [[ "$value" == *$'\n'* ]]; then
      echo "attngrad-entrypoint: $variable contains a newline; expected a single-line value" >&2
      exit 64
    fi
    arguments+=("--${flag_of[$variable]}=${value}")
  fi
done
if [[ -n "${ATTNGRAD_LAYER_RANGES:-}" ]]; then
  replica="${ATTNGRAD_REPLICA_INDEX:-${HOSTNAME##*-}}"
  IFS=',' read -r -a layer_ranges <<<"$ATTNGRAD_LAYER_RANGES"
  if ! [[ "$replica" =~ ^[0-9]+$ ]] || ((10#$replica >= ${#layer_ranges[@]})); then
    echo "attngrad-entrypoint: replica '$replica' (ATTNGRAD_REPLICA_INDEX, or the ordinal ending" \
      "the hostname '${HOSTNAME:-}') has no range in ATTNGRAD_LAYER_RANGES=$ATTNGRAD_LAYER_RANGES" \
      "(${#layer_ranges[@]} ranges)" >&2
    exit 64
  fi
  arguments+=("--layers=${layer_ranges[10#$replica]// /}")
fi
if [[ -n "${ATTNGRAD_EXTRA_ARGS:-}" ]]; then
  read -r -a extra <<<"$ATTNGRAD_EXTRA_ARGS"
  arguments+=("${extra[@]}")
fi
arguments+=("$@")

if [[ "${ATTNGRAD_ENTRYPOINT_DRY_RUN:-}" == "1" ]]; then
  printf '%s\n' "$server" "${arguments[@]}"
  exit 0
fi
exec "$server" "${arguments[@]}"
