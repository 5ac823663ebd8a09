#!/usr/bin/env python3
"""Checks of deploy/ that run in CI without a Docker engine, a cluster or a GPU (tests/deploy).

Subcommands (each one ctest test; see tests/deploy/CMakeLists.txt):

  promtool     promtool check config / check rules / test rules on deploy/prometheus.
  dashboard    deploy/grafana/attngrad.json is what generate_dashboard.py writes, has the panels the
               issue asks for, and every PromQL expression in it parses (promtool).
  manifests    compose files and Kubernetes manifests parse, render (kubectl kustomize when
               present), and reference the image, the ports and only flags that `attngrad-server
               --helpfull` lists; the entrypoint's variable->flag table has only real flags.
  prometheus   Debian's Prometheus scrapes the real server with deploy/prometheus's job and alert
               rules: every dashboard query returns data (quantiles not all NaN), every rule
               evaluates with health "ok", AttngradErrorRatioHigh goes pending after failed batches
               and AttngradServerDown once the server is stopped.
  metrics      starts the real attngrad-server (CPU backend, loopback, free ports), sends one batch
               and one bad request with attngrad-cli, scrapes /metrics and checks that every metric
               family, label and legend the dashboard and the alert rules use is exported.
  entrypoint   starts the server through deploy/docker/entrypoint.sh with ATTNGRAD_* variables,
               checks that they took effect, runs deploy/docker/healthcheck.sh (attngrad-cli health)
               against it, then stops it with SIGTERM and expects exit 0.
  tls          the certificate and token plumbing: deploy/tls/make-dev-certificates.sh makes a CA,
               server and client certificates and a tokens file; the server started through the
               entrypoint with the ATTNGRAD_TLS_* / ATTNGRAD_TOKENS_FILE variables of
               compose.secure.yaml serves mutual TLS and tokens; healthcheck.sh with the arguments
               compose.secure.yaml and the secure Kubernetes overlay give it passes (and fails in
               plaintext); attngrad-cli with a token file works, without one is UNAUTHENTICATED.
  packages     deploy/docker/runtime-packages.sh names installed packages for the built binaries,
               among them the gRPC and protobuf runtime libraries.
  sharded      deploy/k8s/sharded (one model over several GPU nodes): a StatefulSet whose governing
               Service is headless (a stable address per replica), one GPU per pod and never two
               pods on a node, replicas = the ranges of ATTNGRAD_LAYER_RANGES, which cover the
               model's layers without gaps or overlaps; the entrypoint gives replica N the N-th
               range (--layers) from its hostname; the layer map documented in the kustomization and
               in deploy/README.md is the one these names give. Then one server per replica, started
               through the entrypoint as that replica (HOSTNAME attngrad-shard-N) on loopback, and
               `attngrad-cli info` with the documented map (hosts replaced by 127.0.0.1 ports) lists
               every layer of the model, merged from both.

Needs only the Python standard library and PyYAML (Debian: python3-yaml).
"""
import argparse
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "attngrad.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "attngrad.json"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.sh"
GRPC_PORT = 50051
METRICS_PORT = 9464
# Labels Prometheus adds to every scraped series (target labels), usable in by() and legends.
TARGET_LABELS = {"instance", "job"}

failures = []


def check(condition, message):
    """Records a failed check (all checks of a test run, then the test fails listing them)."""
    if not condition:
        failures.append(message)
        print(f"FAIL: {message}", flush=True)
    return condition


def finish(name):
    if failures:
        print(f"{name}: {len(failures)} check(s) failed", flush=True)
        return 1
    print(f"{name}: all checks passed", flush=True)
    return 0


def run(command, **kwargs):
    print("+ " + " ".join(str(part) for part in command), flush=True)
    return subprocess.run([str(part) for part in command], text=True, capture_output=True, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Expressions used by the dashboard and the alert rules
# ---------------------------------------------------------------------------------------------------

def rule_expressions():
    """(where, expression, annotation texts) of every rule in the alert rules file."""
    document = yaml.safe_load(RULES.read_text())
    result = []
    for group in document["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            texts = list((rule.get("annotations") or {}).values())
            result.append((f"rule {name}", rule["expr"], texts))
    return result


def dashboard_expressions(dashboard):
    """(where, expression, legend) of every query in the dashboard: panels, annotations,
    variables."""
    result = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                result.append((f"panel '{panel.get('title')}' {target.get('refId')}",
                               target["expr"],
                               target.get("legendFormat", "")))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            result.append((f"annotation '{annotation['name']}'", annotation["expr"],
                           annotation.get("textFormat", "")))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = (variable["query"]["query"] if isinstance(variable["query"], dict)
                     else variable["query"])
            result.append((f"variable ${variable['name']}", query, ""))
    return result


def grafana_to_promql(expression):
    """Replaces Grafana's macros so that promtool can parse the expression."""
    expression = expression.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    expression = expression.replace("$__range", "1h")
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expression, re.S)
    if match:  # a variable query: the selector inside is PromQL
        expression = match.group(1)
    return expression


METRIC_NAME = re.compile(r"\b(attngrad_[A-Za-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(attngrad_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
BY_CLAUSE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*\.?([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
TEMPLATE_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")


# ---------------------------------------------------------------------------------------------------
# promtool
# ---------------------------------------------------------------------------------------------------

def require_promtool(path):
    if not path or path.endswith("NOTFOUND") or not shutil.which(path):
        check(False, f"promtool not found ({path!r}): install Debian's 'prometheus' package "
                     "(scripts/install-deps.sh does)")
        return None
    return path


def command_promtool(arguments):
    promtool = require_promtool(arguments.promtool)
    if promtool:
        prometheus_dir = DEPLOY / "prometheus"
        for command in (["check", "config", prometheus_dir / "prometheus.yml"],
                        ["check", "rules", RULES],
                        ["test", "rules", prometheus_dir / "tests" / "attngrad.rules.test.yml"]):
            result = run([promtool, *command], cwd=prometheus_dir)
            print(result.stdout + result.stderr)
            check(result.returncode == 0,
                  f"promtool {' '.join(map(str, command))} exited {result.returncode}")
        result = run([sys.executable, prometheus_dir / "generate_prometheusrule.py", "--check"])
        print(result.stdout + result.stderr)
        check(result.returncode == 0,
              "the Kubernetes PrometheusRule is out of date with the alert rules")
        # Every alert has a promtool test case.
        tests = yaml.safe_load((prometheus_dir / "tests" / "attngrad.rules.test.yml").read_text())
        tested = {case["alertname"] for test in tests["tests"]
                  for case in test.get("alert_rule_test", [])}
        alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
                  for rule in group["rules"] if "alert" in rule}
        check(alerts <= tested, f"alerts without a promtool test: {sorted(alerts - tested)}")
        for required in ("AttngradServerDown", "AttngradErrorRatioHigh",
                         "AttngradBatchLatencyP99High",
                         "AttngradDeviceMemoryNearFull", "AttngradQueueSaturated"):
            check(required in alerts, f"alert {required} missing from {RULES.name}")
        queue_rule = [expr for where, expr, _ in rule_expressions()
                      if where == "rule AttngradQueueSaturated"]
        check(queue_rule and "attngrad_queue_depth" in queue_rule[0]
              and "attngrad_queue_capacity" in queue_rule[0],
              "AttngradQueueSaturated must compare attngrad_queue_depth with "
              "attngrad_queue_capacity")
    return finish("promtool")


# ---------------------------------------------------------------------------------------------------
# dashboard
# ---------------------------------------------------------------------------------------------------

def command_dashboard(arguments):
    result = run([sys.executable, DEPLOY / "grafana" / "generate_dashboard.py", "--check"])
    print(result.stdout + result.stderr)
    check(result.returncode == 0,
          "deploy/grafana/attngrad.json is not what generate_dashboard.py writes")

    dashboard = json.loads(DASHBOARD.read_text())
    check(dashboard.get("uid") == "attngrad", "dashboard uid should be 'attngrad'")
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    check({"datasource", "job", "instance", "device"} <= variables,
          f"dashboard variables {sorted(variables)} lack datasource/job/instance/device")

    panels = []

    def walk(items):
        for panel in items:
            panels.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    identifiers = [panel["id"] for panel in panels]
    check(len(identifiers) == len(set(identifiers)), "panel ids are not unique")
    for panel in panels:
        position = panel["gridPos"]
        check(position["x"] + position["w"] <= 24,
              f"panel '{panel['title']}' is wider than the grid")
        if panel["type"] != "row":
            check(panel.get("targets"), f"panel '{panel['title']}' has no query")
            check(panel["datasource"]["uid"] == "${datasource}",
                  f"panel '{panel['title']}' does not use the $datasource variable")
    expressions = dashboard_expressions(dashboard)
    joined = "\n".join(expression for _, expression, _ in expressions)
    # What the issue asks the dashboard to show.
    wanted = {
        "latency percentiles per stage":
            r"histogram_quantile\(.*?attngrad_stage_duration_seconds_bucket",
        "end-to-end latency percentiles":
            r"histogram_quantile\(.*?attngrad_batch_duration_seconds_bucket",
        "tokens/s": r"rate\(attngrad_tokens_total",
        "bytes/s in": r"rate\(attngrad_received_bytes_total",
        "bytes/s out": r"rate\(attngrad_sent_bytes_total",
        "errors by code": r"by \([^)]*code[^)]*\) \(rate\(attngrad_errors_total",
        "in-flight": r"attngrad_inflight_batches",
        "queue depth": r"attngrad_queue_depth",
        "GPU memory": r"attngrad_device_memory_used_bytes",
        "weights version": r"attngrad_weights_version",
        "accumulation state": r"attngrad_accumulated_batches",
        "per instance and device": r"by \(instance, device",
    }
    for what, pattern in wanted.items():
        check(re.search(pattern, joined), f"dashboard shows no {what} (/{pattern}/)")
    for where, expression, _ in expressions:
        if "attngrad_" in expression and "label_values" not in expression \
                and "up{" not in expression:
            check('instance=~"$instance"' in expression, f"{where}: not narrowed by $instance")

    # Every expression parses as PromQL: promtool checks them as recording rules.
    promtool = require_promtool(arguments.promtool)
    if promtool:
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:expression_{index}", "expr": grafana_to_promql(expression)}
            for index, (_, expression, _) in enumerate(expressions)]}]}
        with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as handle:
            yaml.safe_dump(rules, handle)
        try:
            result = run([promtool, "check", "rules", handle.name])
            print(result.stdout + result.stderr)
            check(result.returncode == 0,
                  "a dashboard expression does not parse as PromQL (see above)")
        finally:
            os.unlink(handle.name)

    # Provisioning points where compose mounts the dashboard.
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "attngrad.yaml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grafana_volumes = compose["services"]["grafana"]["volumes"]
    dashboard_mount = [volume.split(":")[1] for volume in grafana_volumes
                       if volume.startswith("./grafana/attngrad.json:")]
    check(dashboard_mount and pathlib.PurePosixPath(dashboard_mount[0]).parent ==
          pathlib.PurePosixPath(provider["providers"][0]["options"]["path"]),
          "compose mounts the dashboard outside the provisioned dashboards folder")
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    check(datasource["datasources"][0]["url"] == "http://prometheus:9090"
          and "prometheus" in compose["services"],
          "the provisioned datasource does not point at compose's prometheus service")
    return finish("dashboard")


# ---------------------------------------------------------------------------------------------------
# manifests
# ---------------------------------------------------------------------------------------------------

class ComposeLoader(yaml.SafeLoader):
    """Compose's YAML: knows the !reset and !override tags (Compose >= 2.24)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"__compose_tag__": "reset"})
ComposeLoader.add_constructor("!override", lambda loader, node: (
    loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
    else loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
    else loader.construct_scalar(node)))


def server_flags(server):
    """Flag names that the real server accepts, from `attngrad-server --helpfull`."""
    result = run([server, "--helpfull"], timeout=60)
    text = result.stdout + result.stderr
    flags = set(re.findall(r"^\s*--([A-Za-z0-9_]+)", text, re.M))
    check(flags,
          f"no flags found in `{server} --helpfull` output (exit "
          f"{result.returncode}):\n{text[:2000]}")
    return flags


def entrypoint_table():
    """ATTNGRAD_* variable -> flag, from the entrypoint's declare -A table."""
    return dict(re.findall(r"^\s*\[(ATTNGRAD_[A-Z0-9_]+)\]=([a-z0-9_]+)\s*$",
                           ENTRYPOINT.read_text(), re.M))


def render_kustomization(folder):
    """Documents of `kubectl kustomize folder`, or None when kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    result = run([kubectl, "kustomize", folder], timeout=120)
    check(result.returncode == 0, f"kubectl kustomize {folder} failed:\n{result.stderr}")
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def load_kustomization_by_hand(folder, seen=None):
    """Fallback without kubectl: the resources a kustomization lists, with its generated ConfigMaps'
    data (env files and literals), no patches. Enough to check names, ports and flags."""
    documents = []
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for entry in kustomization.get("resources", []) + kustomization.get("components", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            documents += load_kustomization_by_hand(path)
        else:
            documents += [document for document in yaml.safe_load_all(path.read_text()) if document]
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for env_file in generator.get("envs", []):
            for line in (folder / env_file).read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    key, _, value = line.partition("=")
                    data[key.strip()] = value
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value
        existing = [document for document in documents if document["kind"] == "ConfigMap"
                    and document["metadata"]["name"] == generator["name"]]
        if generator.get("behavior") == "merge" and existing:
            existing[0]["data"].update(data)
        else:
            documents.append({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": generator["name"]}, "data": data})
    return documents


def check_flag_variables(where, variables, table, flags):
    for variable in variables:
        if variable in ("ATTNGRAD_EXTRA_ARGS", "ATTNGRAD_IMAGE", "ATTNGRAD_WEIGHTS_DIR",
                        "ATTNGRAD_LAYER_RANGES", "ATTNGRAD_REPLICA_INDEX"):
            continue
        check(variable in table, f"{where}: {variable} is not mapped to a flag by the entrypoint")
        if variable in table:
            check(table[variable] in flags,
                  f"{where}: {variable} -> --{table[variable]}, which the server lacks")


def command_manifests(arguments):
    flags = server_flags(arguments.server)
    table = entrypoint_table()
    check(len(table) >= 12,
          f"entrypoint table has {len(table)} entries; expected every service flag")
    for variable, flag in sorted(table.items()):
        check(flag in flags,
              f"entrypoint maps {variable} to --{flag}, which `attngrad-server --helpfull` lacks")
        check(variable == "ATTNGRAD_" + flag.upper(),
              f"entrypoint: {variable} should be named ATTNGRAD_{flag.upper()}")
    for flag in ("listen", "metrics_listen", "devices", "weights", "weights_seed", "weights_layer",
                 "max_batch_tokens", "max_message_bytes", "max_concurrent_streams", "queue_depth",
                 "shutdown_grace_seconds", "cpu_threads"):
        check(flag in flags, f"the server lacks the conventional flag --{flag}")

    # Dockerfile: the binaries, ports, entrypoint, health check, user.
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    # The bases are build arguments whose defaults are NVIDIA's images (local-bases.sh makes
    # stand-ins where no registry is reachable).
    check(re.search(r"^ARG BUILD_BASE=nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu"
                    r"\$\{UBUNTU_VERSION\}$", dockerfile, re.M)
          and re.search(r"^ARG RUNTIME_BASE=nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu"
                        r"\$\{UBUNTU_VERSION\}$", dockerfile, re.M)
          and re.search(r"^FROM \$\{BUILD_BASE\} AS build$", dockerfile, re.M)
          and re.search(r"^FROM \$\{RUNTIME_BASE\} AS runtime$", dockerfile, re.M)
          and re.search(r"^ARG CUDA_VERSION=13\.0\.\d+$", dockerfile, re.M)
          and re.search(r"^ARG UBUNTU_VERSION=24\.04$", dockerfile, re.M),
          "Dockerfile: expected BUILD_BASE/RUNTIME_BASE arguments defaulting to nvidia/cuda 13.0.x "
          "devel -> runtime, Ubuntu 24.04")
    check("bash /tmp/install-deps.sh --image-build &&" in dockerfile
          and "xargs -a /tmp/runtime-packages.txt apt-get install" in dockerfile,
          "Dockerfile: expected scripts/install-deps.sh --image-build in the build stage and only "
          "runtime-packages.txt's packages in the runtime stage")
    check(re.search(r"^USER 10001", dockerfile, re.M),
          "Dockerfile does not switch to the non-root user")
    check(re.search(rf"^EXPOSE {GRPC_PORT} {METRICS_PORT}$", dockerfile, re.M),
          "Dockerfile EXPOSE ports")
    check("HEALTHCHECK" in dockerfile and "attngrad-healthcheck" in dockerfile,
          "Dockerfile HEALTHCHECK")
    check(re.search(r"--target attngrad-server attngrad-cli", dockerfile),
          "Dockerfile builds the two binaries")
    check(re.search(r"cmake --install /build .*--component binaries", dockerfile),
          "Dockerfile does not put the binaries in place with cmake --install (component binaries)")
    check(re.search(r'\bhealth --target="?127\.0\.0\.1:', HEALTHCHECK.read_text()),
          "healthcheck.sh does not call `attngrad-cli health`")
    for variable in re.findall(r"\b(ATTNGRAD_[A-Z0-9_]+)=", dockerfile):
        check_flag_variables("Dockerfile ENV", [variable], table, flags)
    scripts = [ENTRYPOINT, HEALTHCHECK, DEPLOY / "docker" / "runtime-packages.sh",
               DEPLOY / "docker" / "local-bases.sh"]
    for script in scripts:
        check(os.access(script, os.X_OK), f"{script.name} is not executable")
        result = run(["bash", "-n", script])
        check(result.returncode == 0, f"bash -n {script.name}: {result.stderr}")
    if shutil.which("shellcheck"):
        result = run(["shellcheck", *scripts])
        print(result.stdout + result.stderr)
        check(result.returncode == 0, "shellcheck found problems in deploy/docker/*.sh")
    else:
        print("shellcheck not installed: the scripts were only checked with bash -n")
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    for needed in ("kernels", "server", "client", "proto", "scripts", "cmake", "CMakeLists.txt"):
        check(needed not in dockerignore,
              f".dockerignore excludes {needed}, which the image build needs")

    # Compose.
    compose = yaml.load((DEPLOY / "compose.yaml").read_text(), Loader=ComposeLoader)
    services = compose["services"]
    check({"attngrad", "prometheus", "grafana"} <= set(services),
          f"compose services: {sorted(services)}")
    server = services["attngrad"]
    check(server["build"]["dockerfile"] == "deploy/docker/Dockerfile"
          and (DEPLOY / server["build"]["context"] / server["build"]["dockerfile"]).is_file(),
          "compose builds from a Dockerfile that does not exist")
    check(re.fullmatch(r"\$\{ATTNGRAD_IMAGE:-attngrad:[\w.]+\}", server["image"]),
          "compose image name")
    ports = {int(port.split(":")[-1]) for port in server["ports"]}
    check(ports == {GRPC_PORT, METRICS_PORT}, f"compose publishes {ports}")
    check_flag_variables("compose.yaml", server["environment"], table, flags)
    check(server["environment"]["ATTNGRAD_LISTEN"].endswith(f":{GRPC_PORT}")
          and server["environment"]["ATTNGRAD_METRICS_LISTEN"].endswith(f":{METRICS_PORT}"),
          "compose: listen addresses do not match the published ports")
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    check(devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"],
          "compose: no NVIDIA GPU reservation")
    prometheus_volumes = services["prometheus"]["volumes"]
    check("./prometheus:/etc/prometheus:ro" in prometheus_volumes,
          "compose: Prometheus does not mount deploy/prometheus")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [target for job in scrape["scrape_configs"] if job["job_name"] == "attngrad"
               for static in job["static_configs"] for target in static["targets"]]
    check(targets == [f"attngrad:{METRICS_PORT}"],
          f"Prometheus scrapes {targets}, not the compose server's metrics port")
    for volume in services["grafana"]["volumes"] + prometheus_volumes:
        source = volume.split(":")[0]
        if source.startswith("./"):
            check((DEPLOY / source).exists(), f"compose mounts {source}, which does not exist")
    override = yaml.load((DEPLOY / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)
    cpu_server = override["services"]["attngrad"]
    check(cpu_server["environment"]["ATTNGRAD_DEVICES"] == "cpu",
          "compose.cpu.yaml does not select the CPU backend")
    check(cpu_server.get("deploy") == {"__compose_tag__": "reset"},
          "compose.cpu.yaml does not !reset the GPU reservation")
    check_flag_variables("compose.cpu.yaml", cpu_server["environment"], table, flags)
    secure = yaml.load((DEPLOY / "compose.secure.yaml").read_text(), Loader=ComposeLoader)
    secure_server = secure["services"]["attngrad"]
    check_flag_variables("compose.secure.yaml", secure_server["environment"], table, flags)
    secret_paths = {f"/run/secrets/{name}" for name in secure.get("secrets", {})}
    for variable in ("ATTNGRAD_TLS_CERT", "ATTNGRAD_TLS_KEY", "ATTNGRAD_TLS_CLIENT_CA",
                     "ATTNGRAD_TOKENS_FILE"):
        check(secure_server["environment"].get(variable) in secret_paths,
              f"compose.secure.yaml: {variable} does not name a mounted secret")
    check(set(secure_server.get("secrets", [])) == set(secure.get("secrets", {})),
          "compose.secure.yaml: the server does not mount every secret")
    for name, secret in secure.get("secrets", {}).items():
        check(secret["file"].startswith("./secrets/"),
              f"compose.secure.yaml: secret {name} outside deploy/secrets")
    check("127.0.0.1:9464:9464" in secure_server["ports"],
          "compose.secure.yaml: /metrics published beyond loopback")
    health = secure_server["healthcheck"]["test"]
    check(health[:2] == ["CMD", "/usr/local/bin/attngrad-healthcheck"] and
          any(part.startswith("--tls_ca=/run/secrets/") for part in health),
          f"compose.secure.yaml: the health check is not a TLS client: {health}")
    check("/deploy/secrets/" in (ROOT / ".gitignore").read_text().split(),
          ".gitignore does not keep deploy/secrets out of git")

    # Kubernetes, each kustomization.
    k8s = DEPLOY / "k8s"
    for folder, expect_gpu, expect_monitor in ((k8s, True, True), (k8s / "base", True, False),
                                               (k8s / "overlays" / "cpu", False, False),
                                               (k8s / "overlays" / "secure", True, False)):
        expect_tls = folder.name == "secure"
        documents = render_kustomization(folder)
        rendered = documents is not None
        if not rendered:
            print(f"kubectl not found: checking {folder} by hand (no patches applied)")
            documents = load_kustomization_by_hand(folder)
        where = f"k8s {folder.relative_to(DEPLOY)}"
        kinds = {}
        for document in documents:
            check("apiVersion" in document and "kind" in document
                  and "name" in document.get("metadata", {}),
                  f"{where}: a document without apiVersion/kind/metadata.name")
            kinds.setdefault(document["kind"], []).append(document)
        deployments = kinds.get("Deployment", [])
        check(len(deployments) == 1, f"{where}: {len(deployments)} Deployments")
        if not deployments:
            continue
        pod = deployments[0]["spec"]["template"]
        container = pod["spec"]["containers"][0]
        check(container["image"].split(":")[0].split("/")[-1] == "attngrad",
              f"{where}: image {container['image']}")
        container_ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        check(container_ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT},
              f"{where}: container ports {container_ports}")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if expect_tls and rendered:  # native gRPC probes speak plaintext only
                command = container.get(probe, {}).get("exec", {}).get("command", [])
                check(command[:1] == ["/usr/local/bin/attngrad-healthcheck"]
                      and "grpc" not in container[probe]
                      and any(part.startswith("--tls_ca=") for part in command),
                      f"{where}: {probe} is not the TLS health check: {container.get(probe)}")
            elif not expect_tls:
                check(container.get(probe, {}).get("grpc", {}).get("port") == GRPC_PORT,
                      f"{where}: {probe} is not a gRPC probe on {GRPC_PORT}")
        resources = container["resources"]
        if rendered:  # patches are applied only by kustomize
            gpu = resources.get("limits", {}).get("nvidia.com/gpu")
            check((gpu is not None) == expect_gpu,
                  f"{where}: nvidia.com/gpu limit {gpu}, GPU expected: {expect_gpu}")
        check("requests" in resources and "limits" in resources and "memory" in resources["limits"],
              f"{where}: resource requests/limits")
        check(pod["spec"]["securityContext"].get("runAsNonRoot") is True,
              f"{where}: not runAsNonRoot")
        annotations = pod["metadata"].get("annotations", {})
        check(annotations.get("prometheus.io/scrape") == "true"
              and annotations.get("prometheus.io/port") == str(METRICS_PORT)
              and annotations.get("prometheus.io/path") == "/metrics",
              f"{where}: prometheus.io annotations")
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        # Flags: the ConfigMap the container reads.
        config_maps = {document["metadata"]["name"]: document
                       for document in kinds.get("ConfigMap", [])}
        reference = container["envFrom"][0]["configMapRef"]["name"]
        check(reference in config_maps,
              f"{where}: the container reads ConfigMap {reference}, which is not there")
        data = config_maps.get(reference, {}).get("data", {})
        check_flag_variables(f"{where} ConfigMap", data, table, flags)
        security = ("ATTNGRAD_TLS_CERT", "ATTNGRAD_TLS_KEY", "ATTNGRAD_TLS_CLIENT_CA",
                    "ATTNGRAD_TOKENS_FILE")
        if expect_tls and rendered:
            mounts = {mount["name"]: mount["mountPath"]
                      for mount in container.get("volumeMounts", [])}
            secrets = {volume["name"] for volume in pod["spec"].get("volumes", [])
                       if "secret" in volume}
            for variable in security:
                path = data.get(variable, "")
                owner = [name for name, mounted in mounts.items() if path.startswith(mounted + "/")]
                check(owner and owner[0] in secrets,
                      f"{where}: {variable}={path!r} is not in a mounted Secret")
        elif not expect_tls:
            check(not any(variable in data for variable in security),
                  f"{where}: TLS or tokens set outside the secure overlay")
        check(data.get("ATTNGRAD_LISTEN", "").endswith(f":{GRPC_PORT}")
              and data.get("ATTNGRAD_METRICS_LISTEN", "").endswith(f":{METRICS_PORT}"),
              f"{where}: ConfigMap listen addresses do not match the container ports")
        if rendered:
            check((data.get("ATTNGRAD_DEVICES") == "cpu") == (not expect_gpu),
                  f"{where}: ATTNGRAD_DEVICES={data.get('ATTNGRAD_DEVICES')!r}")
        shutdown = int(data.get("ATTNGRAD_SHUTDOWN_GRACE_SECONDS", "30"))
        check(grace > shutdown + 5,
              f"{where}: terminationGracePeriodSeconds {grace} leaves no room for the {shutdown} s "
              f"drain")
        # Services: one ClusterIP with grpc+metrics, one headless with grpc; both select the pods.
        labels = pod["metadata"]["labels"]
        services = kinds.get("Service", [])
        check(len(services) == 2, f"{where}: {len(services)} Services")
        headless = [service for service in services if service["spec"].get("clusterIP") == "None"]
        check(len(headless) == 1, f"{where}: expected one headless Service")
        for service in services:
            selector = service["spec"]["selector"]
            check(all(labels.get(key) == value for key, value in selector.items()),
                  f"{where}: Service {service['metadata']['name']} does not select the "
                  f"Deployment's pods")
            for port in service["spec"]["ports"]:
                check(port["targetPort"] in container_ports
                      or port["targetPort"] in container_ports.values(),
                      f"{where}: Service {service['metadata']['name']} targets unknown port "
                      f"{port['targetPort']}")
                check(port["port"] in (GRPC_PORT, METRICS_PORT),
                      f"{where}: Service port {port['port']}")
        prometheus_rules = kinds.get("PrometheusRule", [])
        check(bool(prometheus_rules) == expect_monitor,
              f"{where}: {len(prometheus_rules)} PrometheusRules")
        for resource in prometheus_rules:
            check(resource["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"],
                  f"{where}: the PrometheusRule differs from {RULES.name}")
        monitors = kinds.get("ServiceMonitor", [])
        check(bool(monitors) == expect_monitor, f"{where}: {len(monitors)} ServiceMonitors")
        for monitor in monitors:
            selected = [service for service in services if all(
                service["metadata"].get("labels", {}).get(key) == value
                for key, value in monitor["spec"]["selector"]["matchLabels"].items())]
            check(len(selected) == 1 and selected[0]["spec"].get("clusterIP") != "None",
                  f"{where}: the ServiceMonitor must select exactly the ClusterIP Service (got "
                  f"{len(selected)})")
            check(monitor["spec"]["endpoints"][0]["port"] == "metrics" and
                  monitor["spec"]["endpoints"][0]["path"] == "/metrics",
                  f"{where}: ServiceMonitor endpoint")
            if selected:
                check(selected[0]["metadata"]["name"] == "attngrad",
                      f"{where}: the job label (Service name) must be 'attngrad' for the alert "
                      f"rules")
    return finish("manifests")


# ---------------------------------------------------------------------------------------------------
# A real server on loopback
# ---------------------------------------------------------------------------------------------------

def free_port():
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def scrape(metrics_port, timeout=5.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                timeout=timeout) as response:
        return response.read().decode()


class RunningServer:
    """attngrad-server (or the entrypoint that execs it) on loopback; stopped with SIGTERM on
    exit."""

    def __init__(self, command, environment, metrics_port, cli, grpc_port, log, health_args=()):
        self.command = [str(part) for part in command]
        self.health_args = [str(part) for part in health_args]
        self.environment = environment
        self.metrics_port = metrics_port
        self.grpc_port = grpc_port
        self.cli = cli
        self.log = log
        self.process = None
        self.exit_code = None

    def __enter__(self):
        print("+ " + " ".join(self.command), flush=True)
        self.process = subprocess.Popen(self.command, env=self.environment, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} while starting")
            result = subprocess.run([self.cli, "health", f"--target=127.0.0.1:{self.grpc_port}",
                                     *self.health_args], capture_output=True, text=True)
            if result.returncode == 0:
                return self
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy within 120 s")

    def stop(self, timeout=60):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                self.exit_code = "killed after SIGTERM timeout"
        elif self.process:
            self.exit_code = self.process.returncode
        return self.exit_code

    def __exit__(self, *exception):
        self.stop()
        return False


def server_environment():
    environment = dict(os.environ)
    # Keep the CPU backend small on a 2-core CI machine.
    environment.setdefault("OPENBLAS_NUM_THREADS", "1")
    return environment


def drive_traffic(cli, grpc_port):
    """One small batch in each mode (histograms, counters and per-device gauges get series) and one
    request the server must refuse (attngrad_errors_total gets a series)."""
    target = f"--target=127.0.0.1:{grpc_port}"
    for mode in ("return", "accumulate"):
        result = run([cli, "backward", target, "--batch=1", "--seq_len=8", f"--mode={mode}"],
                     timeout=300)
        print(result.stdout[-2000:] + result.stderr[-2000:])
        check(result.returncode == 0,
              f"attngrad-cli backward --mode={mode} failed ({result.returncode})")
    # A stale weights version: FAILED_PRECONDITION, counted in attngrad_errors_total.
    result = run([cli, "backward", target, "--batch=1", "--seq_len=8",
                  "--expected_weights_version=987654"], timeout=300)
    print(result.stdout[-2000:] + result.stderr[-2000:])
    check(result.returncode != 0, "a batch naming a wrong weights version was accepted")
    result = run([cli, "info", target], timeout=60)
    check(result.returncode == 0,
          f"attngrad-cli info failed ({result.returncode}): {result.stderr[-500:]}")


def parse_exposition(text):
    """{family: {"type": t, "labels": set of label names, "values": {label: set of values}}} from
    the Prometheus text format, with _bucket/_sum/_count samples folded into their histogram
    family."""
    families = {}
    for line in text.splitlines():
        match = re.match(r"# TYPE (\S+) (\S+)", line)
        if match:
            families[match.group(1)] = {"type": match.group(2), "labels": set(), "values": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s", line)
        if not match:
            continue
        name, label_text = match.group(1), match.group(2) or ""
        family = name
        if family not in families:
            family = re.sub(r"_(bucket|sum|count)$", "", name)
        if family not in families:
            continue
        for label, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', label_text):
            families[family]["labels"].add(label)
            families[family]["values"].setdefault(label, set()).add(value)
    return families


def family_of(name, families):
    if name in families:
        return name
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    if base != name and families.get(base, {}).get("type") in ("histogram", "summary"):
        return base
    return None


def check_expressions_against(families, items, where_prefix=""):
    """Every attngrad_* name, label and legend/template label in items exists in families."""
    used = set()
    for where, expression, texts in items:
        texts = [texts] if isinstance(texts, str) else texts
        names = set(METRIC_NAME.findall(expression))
        available = set(TARGET_LABELS)
        for name in names:
            family = family_of(name, families)
            check(family is not None,
                  f"{where_prefix}{where}: uses {name}, which the server does not export")
            if family is None:
                continue
            used.add(family)
            available |= families[family]["labels"]
            if name.endswith("_bucket"):
                available.add("le")
        for name, matchers in SELECTOR.findall(expression):
            family = family_of(name, families)
            if family is None:
                continue
            labels = families[family]["labels"] | TARGET_LABELS | ({"le"}
                                                                   if name.endswith("_bucket")
                                                                   else set())
            for label, operator, value in MATCHER.findall(matchers):
                check(label in labels, f"{where_prefix}{where}: {name} has no label '{label}' "
                                       f"(it has {sorted(families[family]['labels'])})")
                if operator == "=" and "$" not in value and label in families[family]["values"]:
                    check(value in families[family]["values"][label],
                          f"{where_prefix}{where}: "
                          f"{name}{{{label}=\"{value}\"}} matches no exported value "
                          f"({sorted(families[family]['values'][label])})")
        grouped = set()
        for clause in BY_CLAUSE.findall(expression):
            for label in (part.strip() for part in clause.split(",")):
                if label:
                    grouped.add(label)
                    check(label in available,
                          f"{where_prefix}{where}: by/without label '{label}' is on none of "
                          f"{sorted(names)}")
        label_values = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expression, re.S)
        if label_values:
            check(label_values.group(2) in available,
                  f"{where_prefix}{where}: label_values on '{label_values.group(2)}', which "
                  f"{sorted(names)} lack")
        for text in texts:
            for label in LEGEND_LABEL.findall(text) + TEMPLATE_LABEL.findall(text):
                check(label in (available | grouped),
                      f"{where_prefix}{where}: template uses label '{label}', "
                      f"which the result does not have")
    return used


def command_metrics(arguments):
    grpc_port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryFile("w+") as log:
        try:
            server = RunningServer(
                [arguments.server, f"--listen=127.0.0.1:{grpc_port}",
                 f"--metrics_listen=127.0.0.1:{metrics_port}",
                 f"--devices={arguments.devices}", "--weights=random", "--weights_seed=7",
                 "--cpu_threads=2",
                 "--queue_depth=2", "--shutdown_grace_seconds=20"],
                server_environment(), metrics_port, arguments.cli, grpc_port, log)
            with server:
                drive_traffic(arguments.cli, grpc_port)
                text = scrape(metrics_port)
            check(server.exit_code == 0, f"server exit code after SIGTERM: {server.exit_code}")
        except Exception as error:  # the server's log explains most failures
            check(False, f"running the server failed: {error}")
            text = ""
        log.seek(0)
        print("--- server log (tail) ---\n" + log.read()[-4000:])
    if not text:
        return finish("metrics")
    families = parse_exposition(text)
    print(f"server exports {len(families)} families: {', '.join(sorted(families))}")

    # Everything the conventions name is exported after one batch and one error.
    conventions = {
        "attngrad_batch_duration_seconds": ("histogram", {"mode", "device"}),
        "attngrad_stage_duration_seconds": ("histogram", {"stage", "device"}),
        "attngrad_rpc_duration_seconds": ("histogram", {"method", "code"}),
        "attngrad_batches_total": ("counter", {"mode", "device"}),
        "attngrad_tokens_total": ("counter", {"mode", "device"}),
        "attngrad_received_bytes_total": ("counter", {"method"}),
        "attngrad_sent_bytes_total": ("counter", {"method"}),
        "attngrad_errors_total": ("counter", {"method", "code"}),
        "attngrad_inflight_batches": ("gauge", {"device"}),
        "attngrad_queue_depth": ("gauge", {"device"}),
        "attngrad_queue_capacity": ("gauge", {"device"}),
        "attngrad_device_memory_used_bytes": ("gauge", {"device"}),
        "attngrad_device_memory_total_bytes": ("gauge", {"device"}),
        "attngrad_weights_version": ("gauge", set()),
        "attngrad_accumulated_batches": ("gauge", set()),
        "attngrad_accumulated_tokens": ("gauge", set()),
        "attngrad_accumulation_window_id": ("gauge", set()),
        "attngrad_build_info": ("gauge", {"version"}),
    }
    for name, (kind, labels) in conventions.items():
        family = families.get(name)
        check(family is not None, f"the server does not export {name}")
        if family:
            check(family["type"] == kind, f"{name} is a {family['type']}, expected {kind}")
            check(labels <= family["labels"],
                  f"{name} lacks labels {sorted(labels - family['labels'])}")
    if "attngrad_stage_duration_seconds" in families:
        stages = families["attngrad_stage_duration_seconds"]["values"].get("stage", set())
        check(stages == {"queue", "copy_in", "compute", "copy_out"},
              f"stage label values {sorted(stages)}")
    for family in families.values():
        for device in family["values"].get("device", set()):
            check(re.fullmatch(r"cpu|cuda:\d+", device), f"device label value {device!r}")
    if arguments.devices != "cpu":  # a GPU run (on a GPU machine): the GPU's own series
        devices = families.get("attngrad_batches_total", {}).get("values", {}).get("device", set())
        check(devices and all(device.startswith("cuda:") for device in devices),
              f"batches ran on {devices}")
        totals = re.findall(r'^attngrad_device_memory_total_bytes\{device="(cuda:\d+)"\} (\S+)$',
                            text, re.M)
        check(totals and all(float(value) > 0 for _, value in totals),
              f"GPU memory totals {totals}")
        print("GPU memory:",
              re.findall(r'^attngrad_device_memory_\w+_bytes\{device="cuda:\d+"\} \S+$', text,
                         re.M))

    dashboard = json.loads(DASHBOARD.read_text())
    used = check_expressions_against(families, dashboard_expressions(dashboard), "dashboard ")
    used |= check_expressions_against(families, rule_expressions(), "alerts ")
    print(f"dashboard and alerts use {len(used)} exported families: {', '.join(sorted(used))}")
    check(set(conventions) <= used,
          f"families no panel or alert shows: {sorted(set(conventions) - used)}")

    # promtool accepts the exposition (format lint), when present.
    if arguments.promtool and shutil.which(arguments.promtool):
        result = subprocess.run([arguments.promtool, "check", "metrics"], input=text, text=True,
                                capture_output=True)
        print("promtool check metrics:", result.stdout + result.stderr)
        check(result.returncode == 0, "promtool check metrics rejected the exposition")
    return finish("metrics")


def command_entrypoint(arguments):
    grpc_port, metrics_port = free_port(), free_port()
    environment = server_environment()
    environment.update({
        "ATTNGRAD_SERVER_BINARY": str(arguments.server),
        "ATTNGRAD_CLI_BINARY": str(arguments.cli),
        "ATTNGRAD_LISTEN": f"127.0.0.1:{grpc_port}",
        "ATTNGRAD_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
        "ATTNGRAD_DEVICES": "cpu",
        "ATTNGRAD_WEIGHTS": "random",
        "ATTNGRAD_CPU_THREADS": "1",
        "ATTNGRAD_WEIGHTS_SEED": "11",         # visible in `attngrad-cli info` (weights source)
        "ATTNGRAD_MAX_BATCH_TOKENS": "4096",   # visible in `attngrad-cli info` (limits)
        "ATTNGRAD_QUEUE_DEPTH": "3",
        "ATTNGRAD_SHUTDOWN_GRACE_SECONDS": "10",
    })
    # The command line the entrypoint builds: mapped variables, extra args, then container args
    # last.
    dry = dict(environment, ATTNGRAD_ENTRYPOINT_DRY_RUN="1",
               ATTNGRAD_EXTRA_ARGS="--weights_seed=5  --weights_layer=0")
    result = run(["bash", ENTRYPOINT, "--queue_depth=6"], env=dry)
    lines = result.stdout.splitlines()
    check(result.returncode == 0 and lines[0] == str(arguments.server),
          f"entrypoint dry run: {result}")
    check("--devices=cpu" in lines and f"--listen=127.0.0.1:{grpc_port}" in lines,
          f"entrypoint flags: {lines}")
    check(lines[-3:] == ["--weights_seed=5", "--weights_layer=0", "--queue_depth=6"],
          f"entrypoint order (extra args, then container args, last): {lines}")
    unset = {key: value for key, value in dry.items()
             if key not in ("ATTNGRAD_WEIGHTS_SEED", "ATTNGRAD_EXTRA_ARGS")}
    unset_lines = run(["bash", ENTRYPOINT], env=unset).stdout.splitlines()
    check(unset_lines and not any(line.startswith("--weights_seed") for line in unset_lines),
          f"an unset variable produced a flag: {unset_lines}")
    empty_lines = run(["bash", ENTRYPOINT], env=dict(unset,
                                                     ATTNGRAD_DEVICES="")).stdout.splitlines()
    check("--devices=" in empty_lines,
          f"a variable set to '' was not passed as an empty flag: {empty_lines}")
    newline = dict(dry, ATTNGRAD_WEIGHTS="random\n--devices=0")
    check(run(["bash", ENTRYPOINT], env=newline).returncode != 0,
          "a value with a newline was accepted")

    with tempfile.TemporaryFile("w+") as log:
        try:
            server = RunningServer(["bash", ENTRYPOINT], environment, metrics_port, arguments.cli,
                                   grpc_port, log)
            with server:
                # The health check script, as Docker runs it (port from ATTNGRAD_LISTEN).
                result = run(["bash", HEALTHCHECK], env=environment, timeout=30)
                print(result.stdout + result.stderr)
                check(result.returncode == 0,
                      f"healthcheck.sh against a serving server exited {result.returncode}")
                result = run([arguments.cli, "info", f"--target=127.0.0.1:{grpc_port}"], timeout=60)
                print(result.stdout + result.stderr)
                check(re.search(r"random:seed=11\b", result.stdout),
                      "ATTNGRAD_WEIGHTS_SEED=11 did not reach the server (attngrad-cli info)")
                check(re.search(r"max_batch_tokens=4096\b", result.stdout),
                      "ATTNGRAD_MAX_BATCH_TOKENS=4096 did not reach the server (attngrad-cli info)")
                check("attngrad_build_info" in scrape(metrics_port),
                      "ATTNGRAD_METRICS_LISTEN did not reach the server (no /metrics there)")
                # The entrypoint's process became the server (exec): SIGTERM goes straight to it.
                with open(f"/proc/{server.process.pid}/cmdline", "rb") as handle:
                    argv0 = handle.read().split(b"\0")[0].decode()
                check(argv0 == str(arguments.server),
                      f"the entrypoint did not exec the server (pid runs {argv0})")
            check(server.exit_code == 0,
                  f"server exit code after SIGTERM through the entrypoint: {server.exit_code}")
            # Unhealthy when nothing listens.
            result = run(["bash", HEALTHCHECK], env=environment, timeout=60)
            check(result.returncode != 0, "healthcheck.sh succeeded with no server running")
        except Exception as error:
            check(False, f"running the server through the entrypoint failed: {error}")
        log.seek(0)
        print("--- server log (tail) ---\n" + log.read()[-3000:])
    return finish("entrypoint")


MODELS = ROOT / "proto" / "models" / "gemma3.json"


def parse_ranges(text, where):
    """[(first, last)] of "0-12,13-25" in the client's layer-map grammar (a failed check naming
    WHERE, and [], otherwise)."""
    sys.path.insert(0, str(ROOT / "client" / "python"))
    from attngrad.sharded import parse_layer_spans

    try:
        return parse_layer_spans(text)
    except ValueError as error:
        check(False, f"{where}: ATTNGRAD_LAYER_RANGES={text!r} is not a list of ranges A-B,C-D "
                     f"({error})")
        return []


def sharded_layout():
    """(StatefulSet, its governing Service, the flags ConfigMap data, namespace) of
    deploy/k8s/sharded, rendered with kubectl kustomize (by hand without kubectl)."""
    folder = DEPLOY / "k8s" / "sharded"
    documents = render_kustomization(folder)
    if documents is None:
        print(f"kubectl not found: checking {folder} by hand")
        documents = load_kustomization_by_hand(folder)
    kinds = {}
    for document in documents:
        kinds.setdefault(document["kind"], []).append(document)
    return kinds


def command_sharded(arguments):
    flags = server_flags(arguments.server)
    table = entrypoint_table()
    kinds = sharded_layout()
    where = "k8s sharded"
    check(not kinds.get("Deployment"), f"{where}: a Deployment next to the StatefulSet")
    statefulsets = kinds.get("StatefulSet", [])
    check(len(statefulsets) == 1, f"{where}: {len(statefulsets)} StatefulSets")
    if len(statefulsets) != 1:
        return finish("sharded")
    statefulset = statefulsets[0]
    name = statefulset["metadata"]["name"]
    namespace = statefulset["metadata"].get("namespace", "default")
    spec = statefulset["spec"]
    pod = spec["template"]
    labels = pod["metadata"]["labels"]
    check(all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()),
          f"{where}: the selector does not match the pod labels")
    services = {service["metadata"]["name"]: service for service in kinds.get("Service", [])}
    governing = services.get(spec.get("serviceName"))
    check(governing is not None,
          f"{where}: serviceName {spec.get('serviceName')!r} is not a Service here")
    if governing:
        check(governing["spec"].get("clusterIP") == "None",
              f"{where}: the governing Service {governing['metadata']['name']} is not headless (no "
              f"per-replica address)")
        check(all(labels.get(k) == v for k, v in governing["spec"]["selector"].items()),
              f"{where}: the governing Service does not select the StatefulSet's pods")
        check(any(port["port"] == GRPC_PORT for port in governing["spec"]["ports"]),
              f"{where}: the governing Service has no gRPC port {GRPC_PORT}")
    container = pod["spec"]["containers"][0]
    check(container["image"].split(":")[0].split("/")[-1] == "attngrad",
          f"{where}: image {container['image']}")
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    check(ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT},
          f"{where}: container ports {ports}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        check(container.get(probe, {}).get("grpc", {}).get("port") == GRPC_PORT,
              f"{where}: {probe}")
    gpu = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    check(str(gpu) == "1", f"{where}: nvidia.com/gpu limit {gpu}, expected one GPU per server")
    anti = pod["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", [])
    check(any(term.get("topologyKey") == "kubernetes.io/hostname" and all(
              labels.get(k) == v for k, v in term["labelSelector"]["matchLabels"].items())
              for term in anti),
          f"{where}: no required pod anti-affinity on kubernetes.io/hostname (one server per GPU "
          f"node)")
    check(pod["spec"]["securityContext"].get("runAsNonRoot") is True, f"{where}: not runAsNonRoot")
    config_maps = {document["metadata"]["name"]: document
                   for document in kinds.get("ConfigMap", [])}
    reference = container["envFrom"][0]["configMapRef"]["name"]
    data = config_maps.get(reference, {}).get("data", {})
    check(data, f"{where}: the container reads ConfigMap {reference}, which is not there")
    check_flag_variables(f"{where} ConfigMap", data, table, flags)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    check(grace > int(data.get("ATTNGRAD_SHUTDOWN_GRACE_SECONDS", "30")) + 5,
          f"{where}: terminationGracePeriodSeconds {grace} leaves no room for the drain")

    # The ranges: one per replica, covering the model's layers in order.
    ranges = parse_ranges(data.get("ATTNGRAD_LAYER_RANGES", ""), where)
    check(len(ranges) == spec["replicas"],
          f"{where}: {spec['replicas']} replicas but {len(ranges)} layer ranges")
    expected_first = 0
    for first, last in ranges:
        check(first == expected_first and last >= first,
              f"{where}: ATTNGRAD_LAYER_RANGES {data.get('ATTNGRAD_LAYER_RANGES')} has a gap or an "
              f"overlap at {first}-{last}")
        expected_first = last + 1
    model = data.get("ATTNGRAD_MODEL")
    if data.get("ATTNGRAD_WEIGHTS") == "random":
        models = json.loads(MODELS.read_text())["models"]
        check(model in models, f"{where}: ATTNGRAD_MODEL={model!r} is not one of {sorted(models)}")
        if model in models:
            layers = models[model]["num_hidden_layers"]
            check(expected_first == layers,
                  f"{where}: the ranges end at layer {expected_first - 1}, "
                  f"{model} has {layers} layers (0-{layers - 1})")

    # The entrypoint gives each replica its range, from the hostname Kubernetes gives it.
    for index, (first, last) in enumerate(ranges):
        dry = dict(os.environ, ATTNGRAD_ENTRYPOINT_DRY_RUN="1", HOSTNAME=f"{name}-{index}",
                   ATTNGRAD_SERVER_BINARY=str(arguments.server), **data)
        dry.pop("ATTNGRAD_REPLICA_INDEX", None)
        lines = run(["bash", ENTRYPOINT], env=dry).stdout.splitlines()
        check(f"--layers={first}-{last}" in lines,
              f"{where}: replica {index} does not get --layers={first}-{last}: {lines}")
    beyond = dict(os.environ, ATTNGRAD_ENTRYPOINT_DRY_RUN="1", HOSTNAME=f"{name}-{len(ranges)}",
                  **data)
    check(run(["bash", ENTRYPOINT], env=beyond).returncode != 0,
          f"{where}: a replica beyond the ranges ({name}-{len(ranges)}) was started anyway")

    # The map the trainer uses, as documented.
    service = spec.get("serviceName")
    documented = ",".join(f"{first}-{last}={name}-{index}.{service}.{namespace}"
                          f".svc.cluster.local:{GRPC_PORT}"
                          for index, (first, last) in enumerate(ranges))
    for document in (DEPLOY / "k8s" / "sharded" / "kustomization.yaml", DEPLOY / "README.md"):
        check(documented in document.read_text(),
              f"{document.relative_to(ROOT)} does not give the trainer's layer map {documented}")

    # One server per replica on loopback, started through the entrypoint as that replica, and the
    # documented map (hosts replaced by the loopback ports) seen by attngrad-cli as one model.
    servers, loopback_map = [], []
    with contextlib.ExitStack() as stack:
        try:
            for index, (first, last) in enumerate(ranges):
                grpc_port, metrics_port = free_port(), free_port()
                environment = server_environment()
                environment.update(data)
                environment.update({"ATTNGRAD_SERVER_BINARY": str(arguments.server),
                                    "HOSTNAME": f"{name}-{index}",
                                    "ATTNGRAD_LISTEN": f"127.0.0.1:{grpc_port}",
                                    "ATTNGRAD_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
                                    "ATTNGRAD_DEVICES": "cpu", "ATTNGRAD_CPU_THREADS": "1"})
                log = stack.enter_context(tempfile.TemporaryFile("w+"))
                servers.append(stack.enter_context(RunningServer(["bash", ENTRYPOINT], environment,
                                                                 metrics_port,
                                                                 arguments.cli, grpc_port, log)))
                loopback_map.append(f"{first}-{last}=127.0.0.1:{grpc_port}")
            result = run([arguments.cli, "info", "--target=" + ",".join(loopback_map)], timeout=120)
            print(result.stdout + result.stderr)
            check(result.returncode == 0,
                  f"attngrad-cli info with the layer map exited {result.returncode}")
            held = sorted(int(index) for index in re.findall(r"^layer (\d+) ", result.stdout, re.M))
            check(held == list(range(expected_first)),
                  f"attngrad-cli info over the map lists layers {held}, expected "
                  f"0-{expected_first - 1}")
            check(len(re.findall(r"^server ", result.stdout, re.M)) == len(ranges),
                  f"attngrad-cli info does not list the {len(ranges)} servers")
        except Exception as error:
            check(False, f"running the replicas through the entrypoint failed: {error}")
    for index, server in enumerate(servers):
        check(server.exit_code == 0, f"replica {index}: exit code after SIGTERM {server.exit_code}")
    return finish("sharded")


def substitute_variables(expression):
    """A dashboard query as Grafana would send it with job=attngrad and every instance and
    device."""
    expression = expression.replace('"$job"', '"attngrad"').replace('"$instance"', '".*"')
    expression = expression.replace('"$device"', '".*"').replace("$__rate_interval", "1m")
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expression, re.S)
    if match:
        expression = f"group by ({match.group(2)}) ({match.group(1)})"
    return expression


def prometheus_get(port, path, **parameters):
    query = urllib.parse.urlencode(parameters)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?{query}", timeout=10) as response:
        return json.loads(response.read().decode())


def wait_for(description, predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except OSError:
            pass
        time.sleep(0.5)
    check(False, f"timed out after {timeout} s waiting for {description}")
    return False


def command_prometheus(arguments):
    """A real Prometheus (Debian's) scrapes the real server with deploy/prometheus's scrape job and
    alert rules; every dashboard query must return data and every rule must evaluate cleanly."""
    prometheus = arguments.prometheus
    if not prometheus or not shutil.which(prometheus):
        check(False,
              f"prometheus not found ({prometheus!r}): install Debian's 'prometheus' package")
        return finish("prometheus")
    grpc_port, metrics_port, web_port = free_port(), free_port(), free_port()
    work = pathlib.Path(tempfile.mkdtemp(prefix="attngrad-deploy-prometheus-"))
    # deploy/prometheus/prometheus.yml, pointed at loopback and scraping every second.
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
    config["rule_files"] = [str((DEPLOY / "prometheus" / path).resolve())
                            for path in config["rule_files"]]
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == "attngrad"]
    check(len(jobs) == 1, "prometheus.yml has no attngrad job")
    jobs[0].update({"scrape_interval": "1s", "scrape_timeout": "1s"})
    jobs[0]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    config["scrape_configs"] = jobs
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    instance = f"127.0.0.1:{metrics_port}"

    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as prometheus_log:
        prometheus_process = subprocess.Popen(
            [prometheus, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=prometheus_log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for("Prometheus to be ready", lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{web_port}/-/ready", timeout=2).status == 200, 60)
            server = RunningServer(
                [arguments.server, f"--listen=127.0.0.1:{grpc_port}",
                 f"--metrics_listen={instance}",
                 "--devices=cpu", "--weights=random", "--cpu_threads=2",
                 "--shutdown_grace_seconds=10"],
                server_environment(), metrics_port, arguments.cli, grpc_port, log)
            with server:
                def up():
                    result = prometheus_get(web_port, "/api/v1/query",
                                            query='up{job="attngrad"}')["data"]["result"]
                    return result and result[0]["value"][1] == "1"
                wait_for("Prometheus to scrape the server", up, 60)

                # Two rounds of traffic, each seen by Prometheus before the next, so that rate()
                # over the series the first round created is > 0. Each round computes 2 batches.
                def scraped_batches(expected):
                    result = prometheus_get(
                        web_port, "/api/v1/query",
                        query='sum(attngrad_batches_total{job="attngrad"})')["data"]["result"]
                    return result and float(result[0]["value"][1]) == expected
                drive_traffic(arguments.cli, grpc_port)
                wait_for("Prometheus to scrape the first round", lambda: scraped_batches(2), 60)
                time.sleep(1.5)
                drive_traffic(arguments.cli, grpc_port)
                wait_for("Prometheus to scrape the second round", lambda: scraped_batches(4), 60)
                time.sleep(1.5)

                dashboard = json.loads(DASHBOARD.read_text())
                queried = 0
                for where, expression, _ in dashboard_expressions(dashboard):
                    if where.startswith("annotation"):
                        continue  # weights changes: none happened
                    queried += 1
                    query = substitute_variables(expression)
                    answer = prometheus_get(web_port, "/api/v1/query", query=query)
                    result = answer.get("data", {}).get("result", [])
                    check(answer.get("status") == "success",
                          f"dashboard {where}: {answer.get('error')}")
                    check(result, f"dashboard {where} shows no data from a real server: {query}")
                    if "histogram_quantile" in expression and result:
                        finite = [series for series in result
                                  if series["value"][1] not in ("NaN", "+Inf", "-Inf")]
                        check(finite, f"dashboard {where}: every quantile is NaN: {query}")

                print(f"{queried} dashboard queries answered by Prometheus")
                check(queried >= 25, f"only {queried} dashboard queries were tried")

                def evaluated():
                    groups = prometheus_get(web_port, "/api/v1/rules")["data"]["groups"]
                    return groups and all(group["lastEvaluation"] > "2000" for group in groups)
                wait_for("the rules to be evaluated", evaluated, 30)
                groups = prometheus_get(web_port, "/api/v1/rules")["data"]["groups"]
                for group in groups:
                    for rule in group["rules"]:
                        check(rule["health"] == "ok",
                              f"rule {rule['name']}: {rule['health']} {rule.get('lastError')}")

                # One batch in three failed (the stale-version batch of each round): the error ratio
                # alert goes pending for this instance; no availability alert.
                def error_ratio_pending():
                    alerts = prometheus_get(web_port, "/api/v1/alerts")["data"]["alerts"]
                    return any(alert["labels"]["alertname"] == "AttngradErrorRatioHigh" and
                               alert["labels"].get("instance") == instance for alert in alerts)
                wait_for("AttngradErrorRatioHigh to be pending after 1 in 3 batches failed",
                         error_ratio_pending, 30)
                alerts = prometheus_get(web_port, "/api/v1/alerts")["data"]["alerts"]
                print("alerts with the server up:",
                      [(a["labels"]["alertname"], a["state"]) for a in alerts])
                check(not any(alert["labels"]["alertname"] in ("AttngradServerDown",
                                                               "AttngradNoTargets")
                              for alert in alerts), "an availability alert with the server up")
            check(server.exit_code == 0, f"server exit code after SIGTERM: {server.exit_code}")

            def down_alert():
                alerts = prometheus_get(web_port, "/api/v1/alerts")["data"]["alerts"]
                return any(alert["labels"]["alertname"] == "AttngradServerDown" and
                           alert["labels"].get("instance") == instance for alert in alerts)
            wait_for("AttngradServerDown to be pending once the server stopped", down_alert, 30)
        except Exception as error:
            check(False, f"the Prometheus check failed: {error!r}")
        finally:
            prometheus_process.send_signal(signal.SIGTERM)
            try:
                prometheus_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prometheus_process.kill()
                prometheus_process.wait()
            shutil.rmtree(work, ignore_errors=True)
            if failures:
                log.seek(0)
                prometheus_log.seek(0)
                print("--- server log (tail) ---\n" + log.read()[-3000:])
                print("--- prometheus log (tail) ---\n" + prometheus_log.read()[-3000:])
    return finish("prometheus")


def command_packages(arguments):
    script = DEPLOY / "docker" / "runtime-packages.sh"
    result = run(["bash", script, arguments.server, arguments.cli], timeout=120)
    print(result.stdout + result.stderr)
    check(result.returncode == 0, f"runtime-packages.sh exited {result.returncode}")
    packages = result.stdout.split()
    check(any(package.startswith("libgrpc++") for package in packages),
          f"no gRPC C++ runtime package in {packages}")
    check(any(package.startswith("libprotobuf") for package in packages),
          f"no protobuf runtime package in {packages}")
    check(not any(package.endswith("-dev") for package in packages),
          f"a -dev package in {packages}")
    for package in packages:
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                                text=True)
        check(status.stdout == "install ok installed", f"{package} is not an installed package")
    result = run(["bash", script, "/nonexistent-binary"])
    check(result.returncode != 0, "runtime-packages.sh succeeded on a missing binary")
    return finish("packages")


def command_tls(arguments):
    grpc_port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="attngrad-deploy-tls-") as directory:
        secrets = pathlib.Path(directory)
        result = run(["bash", DEPLOY / "tls" / "make-dev-certificates.sh", secrets, "localhost",
                      "attngrad",
                      "127.0.0.1"], timeout=120)
        print(result.stdout + result.stderr)
        check(result.returncode == 0, "make-dev-certificates.sh failed")
        for name in ("ca.crt", "tls.crt", "tls.key", "client.crt", "client.key", "tokens.txt",
                     "trainer.token", "admin.token"):
            check((secrets / name).is_file(), f"make-dev-certificates.sh did not write {name}")
        if failures:
            return finish("tls")
        # The variables compose.secure.yaml sets, pointing at the files made above.
        environment = server_environment()
        environment.update({
            "ATTNGRAD_SERVER_BINARY": str(arguments.server),
            "ATTNGRAD_CLI_BINARY": str(arguments.cli),
            "ATTNGRAD_LISTEN": f"127.0.0.1:{grpc_port}",
            "ATTNGRAD_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
            "ATTNGRAD_DEVICES": "cpu",
            "ATTNGRAD_CPU_THREADS": "1",
            "ATTNGRAD_SHUTDOWN_GRACE_SECONDS": "5",
            "ATTNGRAD_TLS_CERT": str(secrets / "tls.crt"),
            "ATTNGRAD_TLS_KEY": str(secrets / "tls.key"),
            "ATTNGRAD_TLS_CLIENT_CA": str(secrets / "ca.crt"),
            "ATTNGRAD_TOKENS_FILE": str(secrets / "tokens.txt"),
        })
        secure = yaml.load((DEPLOY / "compose.secure.yaml").read_text(), Loader=ComposeLoader)
        names = {f"/run/secrets/{name}": pathlib.Path(entry["file"]).name
                 for name, entry in secure["secrets"].items()}
        for variable, value in secure["services"]["attngrad"]["environment"].items():
            check(names.get(value) == pathlib.Path(environment[variable]).name,
                  f"compose.secure.yaml: {variable} names {value}, not the file the script writes")
        # The health check's arguments in compose.secure.yaml, with the secrets' paths here.
        health_args = []
        for part in secure["services"]["attngrad"]["healthcheck"]["test"][2:]:
            flag, _, value = part.partition("=")
            health_args.append(f"{flag}={secrets / names[value]}" if value in names else part)
        with tempfile.TemporaryFile("w+") as log:
            try:
                server = RunningServer(["bash", ENTRYPOINT], environment, metrics_port,
                                       arguments.cli,
                                       grpc_port, log, health_args=health_args)
                with server:
                    result = run(["bash", HEALTHCHECK, *health_args], env=environment, timeout=30)
                    check(result.returncode == 0,
                          f"healthcheck.sh with TLS arguments: {result.stdout}{result.stderr}")
                    result = run(["bash", HEALTHCHECK, "--connect_timeout_seconds=2"],
                                 env=environment, timeout=30)
                    check(result.returncode != 0,
                          "healthcheck.sh in plaintext passed against a TLS server")
                    client = [f"--target=127.0.0.1:{grpc_port}", f"--tls_ca={secrets / 'ca.crt'}",
                              f"--tls_cert={secrets / 'client.crt'}",
                              f"--tls_key={secrets / 'client.key'}",
                              "--tls_server_name=localhost", "--retries=1"]
                    result = run([arguments.cli, "info", *client,
                                  f"--token_file={secrets / 'trainer.token'}"], timeout=60)
                    check(result.returncode == 0,
                          f"attngrad-cli info with the trainer token: "
                          f"{result.stdout}{result.stderr}")
                    result = run([arguments.cli, "info", *client], timeout=60)
                    check(result.returncode != 0
                          and "UNAUTHENTICATED" in result.stdout + result.stderr,
                          f"attngrad-cli info without a token: {result.stdout}{result.stderr}")
                    result = run([arguments.cli, "zero", *client,
                                  f"--token_file={secrets / 'trainer.token'}"], timeout=60)
                    check(result.returncode != 0
                          and "PERMISSION_DENIED" in result.stdout + result.stderr,
                          f"attngrad-cli zero as a trainer: {result.stdout}{result.stderr}")
                    result = run([arguments.cli, "zero", *client,
                                  f"--token_file={secrets / 'admin.token'}"], timeout=60)
                    check(result.returncode == 0,
                          f"attngrad-cli zero as the admin: {result.stdout}{result.stderr}")
                check(server.exit_code == 0, f"server exit code after SIGTERM: {server.exit_code}")
            except Exception as error:
                check(False, f"running the server with TLS and tokens failed: {error}")
            log.seek(0)
            text = log.read()
            print("--- server log (tail) ---\n" + text[-3000:])
            check("mutual TLS" in text and "authentication: bearer tokens" in text,
                  "the server log does not say mutual TLS and tokens are on")
    return finish("tls")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["promtool", "dashboard", "manifests", "metrics",
                                            "prometheus",
                                            "entrypoint", "tls", "packages", "sharded"])
    parser.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    parser.add_argument("--server", help="path of attngrad-server")
    parser.add_argument("--devices", default="cpu",
                        help="--devices of the server in `metrics` (cpu in CI)")
    parser.add_argument("--cli", help="path of attngrad-cli")
    arguments = parser.parse_args()
    if arguments.command in ("manifests", "metrics", "prometheus", "entrypoint", "tls", "packages",
                             "sharded") and not arguments.server:
        parser.error("--server is required")
    if arguments.command in ("metrics", "prometheus", "entrypoint", "tls", "packages",
                             "sharded") and not arguments.cli:
        parser.error("--cli is required")
    return globals()[f"command_{arguments.command}"](arguments)


if __name__ == "__main__":
    sys.exit(main())
