#!/bin/bash
# The container tests (ctest label `container`): deploy/docker/Dockerfile built on the local Debian
# bases of deploy/docker/local-bases.sh, run with podman, and deploy/compose.yaml brought up with
# podman-compose. No registry is needed: every image is built here.
#
#   container_test.sh build    SOURCE_DIR  builds the bases (if missing), the attngrad image and the
#                                          Prometheus image from Debian's package; prints the time
#                                          and the image sizes
#   container_test.sh run      SOURCE_DIR CLI   runs the image (ATTNGRAD_DEVICES=cpu, read-only root,
#                                          all capabilities dropped): the image's health check passes,
#                                          `CLI backward --check` from outside passes, the server runs
#                                          as uid 10001 and cannot write its root file system,
#                                          `podman stop` -> exit 0 within the grace; prints the time
#                                          from `podman run` to SERVING
#   container_test.sh compose  SOURCE_DIR CLI   podman-compose up of compose.yaml's server and
#                                          Prometheus: the scrape target is up, attngrad metrics have
#                                          samples; then down
#   container_test.sh grafana  SOURCE_DIR CLI   the same with Grafana: its API lists the provisioned
#                                          dashboard. Needs a Grafana image already in local storage
#                                          (GRAFANA_IMAGE, default compose.yaml's); skips without one
#   container_test.sh clean    SOURCE_DIR  removes the image tags `build` made
#
# Exit 77 (ctest SKIP_RETURN_CODE) with the reason when podman, runc, mmdebstrap or podman-compose is
# missing, when not root, or when the kernel refuses the namespaces a container needs.
# ATTNGRAD_CONTAINER_VARIANT=cpu (default) builds the CPU-only image on the CPU base; =cuda builds the
# CUDA image (CUDA_ARCHITECTURES, default 90a-real) on the CUDA bases, which needs /usr/local/cuda.
# Either image is run on its CPU backend (ATTNGRAD_DEVICES=cpu): no GPU is needed.
# Everything the tests start carries the name prefix attngrad-ctest-<pid> and is removed at the end;
# nothing else in podman's storage is touched.
set -euo pipefail

action="${1:?usage: container_test.sh build|run|compose|grafana|clean SOURCE_DIR [CLI]}"
source_dir="$(cd "${2:?source directory}" && pwd)"
cli="${3:-}"
variant="${ATTNGRAD_CONTAINER_VARIANT:-cpu}"
image="localhost/attngrad:ctest-$variant"
prometheus_image="localhost/attngrad-prometheus:ctest"
grafana_image="${GRAFANA_IMAGE:-grafana/grafana:11.1.0}"
suite=bookworm
base_prefix=localhost/attngrad-base
name="attngrad-ctest-$$"

skip() {
  echo "SKIPPED: $*" >&2
  exit 77
}
fail() {
  echo "FAILED: $*" >&2
  exit 1
}

# --- preconditions -------------------------------------------------------------------------------
for tool in podman runc mmdebstrap podman-compose curl python3; do
  command -v "$tool" >/dev/null ||
    skip "$tool is not installed (scripts/install-deps.sh installs podman, runc, mmdebstrap, podman-compose)"
done
[[ $(id -u) -eq 0 ]] || skip "not root: these tests use rootful podman (rootless needs /etc/subuid ranges)"
if ! unshare --mount --uts --ipc --net --pid --fork true 2>/dev/null; then
  skip "the kernel refuses new namespaces (unshare --mount --uts --ipc --net --pid failed)"
fi

# podman's settings for these tests only (the system's containers.conf is left alone): runc (crun
# fails on these cgroup v1 hosts), cgroupfs (no systemd), events to a file, and resource limits below
# the hard limits of this shell: podman asks for more than it is allowed to raise them to otherwise.
work=$(mktemp -d /var/tmp/attngrad-ctest.XXXXXX)
cleanup_actions=()
cleanup() {
  local status=$?
  for ((index = ${#cleanup_actions[@]} - 1; index >= 0; index--)); do
    eval "${cleanup_actions[index]}" >/dev/null 2>&1 || true
  done
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
limit() {
  local hard="$1"
  if [[ "$hard" == unlimited || "$hard" -gt 16384 ]]; then echo 16384; else echo $((hard - 1)); fi
}
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(limit "$(ulimit -Hn)"):$(limit "$(ulimit -Hn)")", "nproc=$(limit "$(ulimit -Hu)"):$(limit "$(ulimit -Hu)")"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$work/containers.conf"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# wait_for SECONDS COMMAND...: runs COMMAND every 0.2 s until it succeeds; fails after SECONDS.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}
megabytes() {
  echo "$(($1 / 1000000)) MB"
}
image_size() {
  podman image inspect --format '{{.Size}}' "$1"
}
require_image() {
  podman image exists "$1" || fail "image $1 is missing: the test container.build makes it"
}
require_cli() {
  [[ -x "$cli" ]] || fail "attngrad-cli not given or not executable: '$cli'"
}

# --- build ---------------------------------------------------------------------------------------
build() {
  local started=$SECONDS
  local build_base runtime_base arguments=()
  if [[ "$variant" == cuda ]]; then
    [[ -x /usr/local/cuda/bin/nvcc ]] || skip "ATTNGRAD_CONTAINER_VARIANT=cuda and no /usr/local/cuda/bin/nvcc"
    "$source_dir/deploy/docker/local-bases.sh" --suite="$suite" --prefix="$base_prefix"
    build_base="$base_prefix:$suite-cuda-devel"
    runtime_base="$base_prefix:$suite-cuda-runtime"
    arguments+=(--build-arg "CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90a-real}")
  else
    "$source_dir/deploy/docker/local-bases.sh" --cpu-only --suite="$suite" --prefix="$base_prefix"
    build_base="$base_prefix:$suite-cpu"
    runtime_base="$base_prefix:$suite-cpu"
    arguments+=(--build-arg CUDA_BACKEND=OFF)
  fi
  echo "bases ready in $((SECONDS - started)) s"
  local image_started=$SECONDS
  # --format docker keeps the HEALTHCHECK (the OCI format has none); chroot isolation and the host's
  # network for the RUN steps (apt-get), as these build machines allow; --layers=false leaves no
  # intermediate images behind (gigabytes per build of the CUDA image), only the tagged one.
  podman build --format docker --isolation=chroot --network=host --layers=false \
    -f "$source_dir/deploy/docker/Dockerfile" \
    --build-arg "BUILD_BASE=$build_base" --build-arg "RUNTIME_BASE=$runtime_base" \
    --build-arg "BUILD_JOBS=${BUILD_JOBS:-2}" "${arguments[@]}" \
    -t "$image" "$source_dir"
  echo "image $image built in $((SECONDS - image_started)) s: $(megabytes "$(image_size "$image")")" \
    "(runtime base $runtime_base: $(megabytes "$(image_size "$runtime_base")"))"
  local prometheus_started=$SECONDS
  podman build --format docker --isolation=chroot --network=host --layers=false \
    -f "$source_dir/deploy/docker/prometheus.Dockerfile" \
    --build-arg "BASE=$base_prefix:$suite-cpu" -t "$prometheus_image" "$source_dir/deploy/docker"
  echo "image $prometheus_image built in $((SECONDS - prometheus_started)) s:" \
    "$(megabytes "$(image_size "$prometheus_image")")"

  # The runtime image holds no library that the binaries do not load: every shared library under
  # /usr/local/cuda is one ldd lists for the binaries, or NCCL (loaded by the server at start-up).
  local listing
  listing=$(podman run --rm --entrypoint /bin/sh "$image" -c '
    ldd /usr/local/bin/attngrad-server /usr/local/bin/attngrad-cli
    echo "--- cuda libraries"
    find /usr/local/cuda/ -name "lib*.so*" 2>/dev/null || true')
  if grep -q 'not found' <<<"$listing"; then fail "a library of the binaries is missing: $listing"; fi
  local loaded library
  loaded=$(sed -n '/^--- cuda libraries/q; s/^[[:space:]]*\(lib[^ ]*\) => .*/\1/p' <<<"$listing" | sort -u)
  while read -r library; do
    [[ -n "$library" ]] || continue
    library=$(basename "$library")
    [[ "$library" == libnccl.so* ]] && continue
    grep -qxF "$library" <<<"$loaded" || fail "the runtime image carries $library, which the binaries do not load"
  done < <(sed -n '/^--- cuda libraries/,$p' <<<"$listing" | tail -n +2)
  if [[ "$variant" == cuda ]]; then
    grep -q '^libcudart\.so' <<<"$loaded" || fail "the cuda image's server does not load the CUDA runtime"
  fi
  echo "libraries: $(tr '\n' ' ' <<<"$loaded")"
  echo "build: total $((SECONDS - started)) s"
}

# --- run -----------------------------------------------------------------------------------------
run_image() {
  require_image "$image"
  require_cli
  local port container="$name-run" grace=30
  port=$(free_port)
  cleanup_actions+=("podman rm -f -t 0 $container")
  local started
  started=$(date +%s%N)
  # As Kubernetes runs it (deploy/k8s/base): read-only root, /tmp a tmpfs, no capabilities. The
  # bridge network: host connections arrive from the bridge, so they are allowed explicitly, as
  # compose.yaml does.
  podman run -d --name "$container" --health-interval=disable \
    --read-only --read-only-tmpfs=false --tmpfs /tmp --cap-drop=ALL \
    -p "127.0.0.1:$port:50051" -e ATTNGRAD_DEVICES=cpu -e ATTNGRAD_ALLOW_UNAUTHENTICATED=true \
    -e "ATTNGRAD_SHUTDOWN_GRACE_SECONDS=$grace" "$image" >/dev/null
  if ! wait_for 120 "$cli" health --target="127.0.0.1:$port"; then
    podman logs "$container" >&2 || true
    fail "the server in the container did not answer SERVING on 127.0.0.1:$port within 120 s"
  fi
  local serving_ms=$((($(date +%s%N) - started) / 1000000))
  echo "podman run to SERVING: $((serving_ms / 1000)).$(printf '%03d' $((serving_ms % 1000))) s"
  podman healthcheck run "$container" || fail "the image's HEALTHCHECK fails against the running server"
  echo "image HEALTHCHECK: healthy"
  "$cli" backward --target="127.0.0.1:$port" --batch=1 --seq_len=8 --count=2 --check ||
    fail "attngrad-cli backward --check against the container failed"

  local status
  status=$(podman exec "$container" cat /proc/1/status)
  grep -Eq '^Uid:\s+10001\s+10001\s+10001\s+10001$' <<<"$status" ||
    fail "the server (PID 1) does not run as uid 10001: $(grep '^Uid:' <<<"$status")"
  grep -Eq '^Gid:\s+10001\s+10001\s+10001\s+10001$' <<<"$status" ||
    fail "the server (PID 1) does not run as gid 10001: $(grep '^Gid:' <<<"$status")"
  grep -q 'attngrad-serve' <<<"$(podman exec "$container" cat /proc/1/comm)" ||
    fail "PID 1 is not attngrad-server (the entrypoint must exec it)"
  local path
  for path in /var/lib/attngrad/probe /usr/local/bin/probe /etc/probe; do
    if podman exec "$container" /bin/sh -c "echo x > $path" 2>/dev/null; then
      fail "the server's user could write $path: the root file system is not read-only"
    fi
  done
  podman exec "$container" /bin/sh -c 'echo x > /tmp/probe' || fail "/tmp (a tmpfs) is not writable"
  [[ $(podman inspect --format '{{.HostConfig.ReadonlyRootfs}}' "$container") == true ]] ||
    fail "podman does not report a read-only root file system"
  echo "runs as uid/gid 10001 (PID 1 = attngrad-server), root file system read-only, /tmp writable"

  local stop_started exit_code
  stop_started=$(date +%s%N)
  podman stop -t $((grace + 15)) "$container" >/dev/null
  local stop_ms=$((($(date +%s%N) - stop_started) / 1000000))
  exit_code=$(podman inspect --format '{{.State.ExitCode}}' "$container")
  local stop_seconds=$((stop_ms / 1000))
  [[ "$exit_code" == 0 ]] || { podman logs --tail 20 "$container" >&2; fail "the server exited $exit_code after podman stop"; }
  ((stop_seconds <= grace)) || fail "podman stop took $stop_seconds s, beyond the grace of $grace s"
  local log
  log=$(podman logs "$container" 2>&1)
  grep -q 'serving on port' <<<"$log" || fail "the container's log lacks the server's start-up line"
  echo "podman stop: exit 0 after $stop_seconds.$(printf '%03d' $((stop_ms % 1000))) s (grace $grace s)"
}

# --- compose -------------------------------------------------------------------------------------
# http_get CURL_ARGUMENTS...: the body of a GET, failing on an HTTP error.
http_get() {
  curl -fsS --max-time 5 "$@"
}
compose_stack() {
  local with_grafana="$1"
  require_image "$image"
  require_image "$prometheus_image"
  local project="$name-compose"
  local grpc_port metrics_port prometheus_port grafana_port services=(attngrad prometheus)
  grpc_port=$(free_port)
  metrics_port=$(free_port)
  prometheus_port=$(free_port)
  grafana_port=$(free_port)
  [[ $with_grafana == 1 ]] && services+=(grafana)
  # compose.yaml's own services, with this test's images and host ports; its GPU reservation is
  # ignored by podman-compose 1.0 and ATTNGRAD_DEVICES=cpu picks the CPU backend.
  export ATTNGRAD_IMAGE="$image" PROMETHEUS_IMAGE="$prometheus_image" GRAFANA_IMAGE="$grafana_image"
  export ATTNGRAD_DEVICES=cpu ATTNGRAD_MAX_BATCH_TOKENS=8192 ATTNGRAD_GRPC_PORT="$grpc_port"
  export ATTNGRAD_METRICS_PORT="$metrics_port" PROMETHEUS_PORT="$prometheus_port" GRAFANA_PORT="$grafana_port"
  local compose=(podman-compose --project-name "$project" -f "$source_dir/deploy/compose.yaml")
  # Tear down only this project: its containers, then its network and volumes by their labels.
  cleanup_actions+=("podman volume rm -f \$(podman volume ls -q --filter label=io.podman.compose.project=$project)")
  cleanup_actions+=("podman network rm -f \$(podman network ls -q --filter label=io.podman.compose.project=$project)")
  cleanup_actions+=("podman rm -f -t 0 \$(podman ps -aq --filter label=io.podman.compose.project=$project)")
  cleanup_actions+=("${compose[*]} down -t 5")
  "${compose[@]}" up -d --no-build "${services[@]}" >"$work/compose-up.log" 2>&1 ||
    { cat "$work/compose-up.log" >&2; fail "podman-compose up failed"; }
  podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}} {{.Image}} {{.Status}}'

  if ! wait_for 120 "$cli" health --target="127.0.0.1:$grpc_port"; then
    podman ps -a --filter "label=io.podman.compose.project=$project"
    podman logs --tail 20 "${project}_attngrad_1" >&2 || true
    fail "the compose server did not answer SERVING on 127.0.0.1:$grpc_port within 120 s"
  fi
  "$cli" backward --target="127.0.0.1:$grpc_port" --batch=1 --seq_len=8 --count=2 --check ||
    fail "attngrad-cli backward --check against the compose server failed"
  http_get "http://127.0.0.1:$metrics_port/metrics" | grep -q '^attngrad_build_info' ||
    fail "the server's published /metrics port does not serve attngrad_build_info"

  # Prometheus scrapes attngrad:9464 over the compose network (prometheus/prometheus.yml, every 5 s).
  target_up() {
    http_get "http://127.0.0.1:$prometheus_port/api/v1/targets" | python3 -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
up = [t for t in targets if t["labels"].get("job") == "attngrad" and t["health"] == "up"]
print(json.dumps([(t["scrapeUrl"], t["health"]) for t in targets]))
sys.exit(0 if up else 1)'
  }
  if ! wait_for 90 target_up; then
    target_up || true
    podman logs --tail 20 "${project}_prometheus_1" >&2 || true
    fail "Prometheus's targets API does not show the attngrad job up"
  fi
  echo "Prometheus target: $(target_up)"
  has_sample() {
    http_get "http://127.0.0.1:$prometheus_port/api/v1/query" --data-urlencode \
      'query=attngrad_batches_total or attngrad_build_info' | python3 -c '
import json, sys
result = json.load(sys.stdin)["data"]["result"]
print(json.dumps([(r["metric"]["__name__"], r["metric"].get("instance"), r["value"][1]) for r in result]))
sys.exit(0 if result and all(r["metric"].get("job") == "attngrad" for r in result) else 1)'
  }
  wait_for 30 has_sample || fail "Prometheus has no sample of an attngrad metric"
  echo "Prometheus samples: $(has_sample)"

  if [[ $with_grafana == 1 ]]; then
    dashboard_listed() {
      http_get -u "admin:${GRAFANA_ADMIN_PASSWORD:-admin}" \
        "http://127.0.0.1:$grafana_port/api/search?type=dash-db&query=attngrad" | python3 -c '
import json, sys
found = [d for d in json.load(sys.stdin) if d.get("uid") == "attngrad"]
print(json.dumps([(d["uid"], d["title"]) for d in found]))
sys.exit(0 if found else 1)'
    }
    wait_for 120 dashboard_listed || fail "Grafana's API does not list the provisioned dashboard (uid attngrad)"
    echo "Grafana dashboards: $(dashboard_listed)"
  fi

  "${compose[@]}" down -t 35 >"$work/compose-down.log" 2>&1 || { cat "$work/compose-down.log" >&2; fail "podman-compose down failed"; }
  [[ -z $(podman ps -aq --filter "label=io.podman.compose.project=$project") ]] ||
    fail "podman-compose down left containers of $project"
  echo "compose stack up, checked and down"
}

case "$action" in
  build) build ;;
  run) run_image ;;
  compose)
    compose_stack 0
    echo "NOTE: Grafana is not part of this test: see the test container.grafana"
    ;;
  grafana)
    if ! podman image exists "$grafana_image"; then
      skip "NO GRAFANA IMAGE: $grafana_image is not in local storage and cannot be pulled here (no" \
        "registry reachable), and Debian has no grafana package. The Grafana part of the compose" \
        "stack (provisioned dashboard listed by Grafana's API) is NOT TESTED on this machine." \
        "Load an image (podman load) or set GRAFANA_IMAGE to one in local storage to run it."
    fi
    compose_stack 1
    ;;
  clean)
    for tag in "$image" "$prometheus_image"; do
      if podman image exists "$tag"; then
        podman rmi "$tag" >/dev/null
        echo "removed $tag"
      fi
    done
    ;;
  *) fail "unknown action $action" ;;
esac
