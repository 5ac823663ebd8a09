# A Prometheus image from Debian's `prometheus` package, for machines that cannot pull
# prom/prometheus (no registry reachable). Same entrypoint and storage folder as prom/prometheus, so
# compose.yaml's `command:` and volumes work unchanged:
#
#   podman build -f deploy/docker/prometheus.Dockerfile \
#     --build-arg BASE=localhost/attngrad-base:bookworm-cpu -t localhost/attngrad-prometheus deploy/docker
#   PROMETHEUS_IMAGE=localhost/attngrad-prometheus podman-compose -f deploy/compose.yaml up -d
#
# BASE: a Debian or Ubuntu image with apt (deploy/docker/local-bases.sh makes one).
ARG BASE=debian:bookworm
FROM ${BASE}
ARG DEBIAN_FRONTEND=noninteractive
# Only the server (no node exporter or other recommends); /prometheus is the data folder, owned by
# the unprivileged user the server runs as, so that a fresh named volume there is writable.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus \
 && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
