#!/usr/bin/env python3
"""Writes attngrad.json, the Grafana dashboard of attngrad-server, from the panel list below.

The dashboard is code so that panels stay uniform (same variables, selectors and legends everywhere)
and reviewable; the generated JSON is committed because Grafana provisioning reads it directly.
tests/deploy checks that attngrad.json is what this script writes, that it parses, and that every
metric it queries exists in a running server's /metrics.

    /usr/bin/python3 deploy/grafana/generate_dashboard.py            # rewrite attngrad.json
    /usr/bin/python3 deploy/grafana/generate_dashboard.py --check    # exit 1 if it is out of date
"""
import json
import pathlib
import sys

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Every query is narrowed by the dashboard's variables; device-level series also by $device.
SERVER = 'job=~"$job", instance=~"$instance"'
DEVICE = SERVER + ', device=~"$device"'
RATE = "$__rate_interval"


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new line."""

    def __init__(self):
        self.x = 0
        self.y = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, width, height):
        if self.x + width > 24:
            self.newline()
        position = {"x": self.x, "y": self.y, "w": width, "h": height}
        self.x += width
        self.row_height = max(self.row_height, height)
        return position

    def newline(self):
        self.y += self.row_height
        self.x = 0
        self.row_height = 0

    def identifier(self):
        self.next_id += 1
        return self.next_id - 1


def target(expression, legend, ref, instant=False):
    result = {"datasource": DATASOURCE, "expr": expression, "legendFormat": legend, "refId": ref,
              "range": not instant, "instant": instant}
    return result


def row(layout, title):
    layout.newline()
    panel = {"type": "row", "title": title, "id": layout.identifier(), "collapsed": False,
             "gridPos": layout.place(24, 1), "panels": []}
    layout.newline()
    return panel


def timeseries(layout, title, description, targets, unit, width=12, height=8, stack=False,
               draw="line", min_zero=True, stepped=False):
    custom = {"drawStyle": draw, "lineWidth": 1, "fillOpacity": 10 if not stack else 60,
              "showPoints": "never", "spanNulls": False,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"},
              "lineInterpolation": "stepAfter" if stepped else "linear"}
    defaults = {"unit": unit, "custom": custom}
    if min_zero:
        defaults["min"] = 0
    return {
        "type": "timeseries", "title": title, "description": description, "id": layout.identifier(),
        "datasource": DATASOURCE, "gridPos": layout.place(width, height),
        "targets": [target(expr, legend, chr(ord("A") + i))
                    for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def stat(layout, title, description, expression, unit, legend="", width=4, height=4,
         thresholds=None,
         decimals=None):
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute",
                               "steps": thresholds or [{"color": "green", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": description, "id": layout.identifier(),
        "datasource": DATASOURCE, "gridPos": layout.place(width, height),
        "targets": [target(expression, legend, "A", instant=True)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto",
                    "justifyMode": "auto",
                    "orientation": "auto"},
    }


def quantile(q, metric, by, selector):
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[{RATE}])))")


def panels():
    layout = Layout()
    result = []

    result.append(row(layout, "Overview"))
    result.append(stat(layout, "Servers up",
                       "Scrape targets of the selected job that answer /metrics.",
                       f'sum(up{{{SERVER}}})', "none",
                       thresholds=[{"color": "red", "value": None},
                                   {"color": "green", "value": 1}]))
    result.append(stat(layout, "Tokens/s",
                       "Tokens of all batches (B·S) computed per second, all devices.",
                       f"sum(rate(attngrad_tokens_total{{{DEVICE}}}[{RATE}]))", "short"))
    result.append(stat(layout, "Batches/s", "Batches computed per second, RETURN and ACCUMULATE.",
                       f"sum(rate(attngrad_batches_total{{{DEVICE}}}[{RATE}]))", "short"))
    result.append(stat(layout, "Error ratio",
                       "Failures (RPCs and batches in Backward streams) over successful batches "
                       "plus failures.",
                       f"sum(rate(attngrad_errors_total{{{SERVER}}}[{RATE}])) / "
                       f"(sum(rate(attngrad_errors_total{{{SERVER}}}[{RATE}])) + "
                       f"(sum(rate(attngrad_batches_total{{{SERVER}}}[{RATE}])) "
                       f"or sum(rate(attngrad_errors_total{{{SERVER}}}[{RATE}])) * 0))",
                       "percentunit",
                       thresholds=[{"color": "green", "value": None},
                                   {"color": "orange", "value": 0.01},
                                   {"color": "red", "value": 0.05}], decimals=2))
    result.append(stat(layout, "Weights version",
                       "Version of the resident weights, per instance; bumped by every "
                       "LoadWeights. Instances that differ serve different weights.",
                       f"attngrad_weights_version{{{SERVER}}}", "none", legend="{{instance}}"))
    result.append(stat(layout, "Build", "attngrad_build_info: the version label of each instance.",
                       f"count by (version) (attngrad_build_info{{{SERVER}}})", "none",
                       legend="{{version}}"))

    result.append(row(layout, "Throughput"))
    result.append(timeseries(layout, "Tokens/s per instance and device",
                             "rate(attngrad_tokens_total): tokens of computed batches per second.",
                             [(f"sum by (instance, device, mode) "
                               f"(rate(attngrad_tokens_total{{{DEVICE}}}[{RATE}]))",
                               "{{instance}} {{device}} {{mode}}")], "short", width=8))
    result.append(timeseries(layout, "Batches/s per instance and device",
                             "rate(attngrad_batches_total), by mode (RETURN / ACCUMULATE).",
                             [(f"sum by (instance, device, mode) "
                               f"(rate(attngrad_batches_total{{{DEVICE}}}[{RATE}]))",
                               "{{instance}} {{device}} {{mode}}")], "short", width=8))
    result.append(timeseries(layout, "Bytes/s received and sent",
                             "Message bytes received from and sent to clients, by RPC method.",
                             [(f"sum by (instance, method) "
                               f"(rate(attngrad_received_bytes_total{{{SERVER}}}[{RATE}]))",
                               "in {{instance}} {{method}}"),
                              (f"sum by (instance, method) "
                               f"(rate(attngrad_sent_bytes_total{{{SERVER}}}[{RATE}]))",
                               "out {{instance}} {{method}}")], "Bps", width=8))

    result.append(row(layout, "Latency"))
    result.append(timeseries(layout, "Batch latency p50 / p90 / p99 (end to end)",
                             "attngrad_batch_duration_seconds: from a batch's arrival to its "
                             "response, per instance, device and mode.",
                             [(quantile(q, "attngrad_batch_duration_seconds",
                                        "instance, device, mode", DEVICE),
                               f"p{int(q * 100)} {{{{instance}}}} {{{{device}}}} {{{{mode}}}}")
                              for q in (0.5, 0.9, 0.99)], "s"))
    result.append(timeseries(layout, "RPC latency p99 by method",
                             "attngrad_rpc_duration_seconds: whole RPCs (a Backward stream lasts "
                             "as long as the client keeps it open).",
                             [(quantile(0.99, "attngrad_rpc_duration_seconds", "instance, method",
                                        SERVER),
                               "p99 {{instance}} {{method}}")], "s"))
    result.append(timeseries(layout, "Stage latency p50 (queue, copy-in, compute, copy-out)",
                             "attngrad_stage_duration_seconds per stage: where a batch's time "
                             "goes. A growing queue stage means the device is saturated.",
                             [(quantile(0.5, "attngrad_stage_duration_seconds",
                                        "instance, device, stage", DEVICE),
                               "p50 {{stage}} {{instance}} {{device}}")], "s"))
    result.append(timeseries(layout, "Stage latency p99 (queue, copy-in, compute, copy-out)",
                             "attngrad_stage_duration_seconds per stage, 99th percentile.",
                             [(quantile(0.99, "attngrad_stage_duration_seconds",
                                        "instance, device, stage", DEVICE),
                               "p99 {{stage}} {{instance}} {{device}}")], "s"))

    result.append(row(layout, "Errors"))
    result.append(timeseries(layout, "Errors by code",
                             "attngrad_errors_total by gRPC status code and method. "
                             "INVALID_ARGUMENT and FAILED_PRECONDITION are the caller's; INTERNAL "
                             "is the server's.",
                             [(f"sum by (instance, method, code) "
                               f"(rate(attngrad_errors_total{{{SERVER}}}[{RATE}]))",
                               "{{code}} {{method}} {{instance}}")],
                             "reqps", width=24, stack=True, draw="bars"))

    result.append(row(layout, "Load"))
    result.append(timeseries(layout, "In-flight batches",
                             "attngrad_inflight_batches: batches accepted and not yet answered, "
                             "per device.",
                             [(f"sum by (instance, device) (attngrad_inflight_batches{{{DEVICE}}})",
                               "{{instance}} {{device}}")], "short"))
    result.append(timeseries(layout, "Queue depth and capacity",
                             "Batches waiting for each device (attngrad_queue_depth) against the "
                             "batches it computes at once (attngrad_queue_capacity); a backlog "
                             "that stays at or above capacity is the AttngradQueueSaturated alert.",
                             [(f"sum by (instance, device) (attngrad_queue_depth{{{DEVICE}}})",
                               "depth {{instance}} {{device}}"),
                              (f"sum by (instance, device) (attngrad_queue_capacity{{{DEVICE}}})",
                               "capacity {{instance}} {{device}}")], "short"))

    result.append(row(layout, "Device memory"))
    result.append(timeseries(layout, "Device memory used and total",
                             "attngrad_device_memory_used_bytes and _total_bytes per GPU.",
                             [(f"attngrad_device_memory_used_bytes{{{DEVICE}}}",
                               "used {{instance}} {{device}}"),
                              (f"attngrad_device_memory_total_bytes{{{DEVICE}}}",
                               "total {{instance}} {{device}}")],
                             "bytes"))
    result.append(timeseries(layout, "Device memory used (fraction)",
                             "used / total per GPU; the AttngradDeviceMemoryNearFull alert fires "
                             "above 95%.",
                             [(f"attngrad_device_memory_used_bytes{{{DEVICE}}} / "
                               f"(attngrad_device_memory_total_bytes{{{DEVICE}}} > 0)",
                               "{{instance}} {{device}}")],
                             "percentunit"))

    result.append(row(layout, "Weights and accumulation"))
    result.append(timeseries(layout, "Weights version",
                             "attngrad_weights_version per instance; a step is a LoadWeights.",
                             [(f"attngrad_weights_version{{{SERVER}}}", "{{instance}}")], "none",
                             width=6, stepped=True))
    result.append(timeseries(layout, "Accumulation window id",
                             "attngrad_accumulation_window_id: changes when gradients are zeroed "
                             "or fetched-and-zeroed.",
                             [(f"attngrad_accumulation_window_id{{{SERVER}}}", "{{instance}}")],
                             "none",
                             width=6, stepped=True))
    result.append(timeseries(layout, "Accumulated batches",
                             "attngrad_accumulated_batches: ACCUMULATE batches in the current "
                             "window.",
                             [(f"attngrad_accumulated_batches{{{SERVER}}}", "{{instance}}")],
                             "short",
                             width=6, stepped=True))
    result.append(timeseries(layout, "Accumulated tokens",
                             "attngrad_accumulated_tokens: tokens covered by the resident gradient "
                             "sums.",
                             [(f"attngrad_accumulated_tokens{{{SERVER}}}", "{{instance}}")],
                             "short",
                             width=6, stepped=True))
    return result


def variable(name, label, query, include_all=True, multi=True):
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
            "refresh": 2, "sort": 1, "includeAll": include_all, "multi": multi,
            "allValue": ".*" if include_all else None,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all
            else {},
            "options": [], "hide": 0}


def dashboard():
    return {
        "uid": "attngrad",
        "title": "attngrad",
        "description": "attngrad-server: throughput, latency per stage, errors, load, device "
                       "memory, weights and accumulation, per instance and device.",
        "tags": ["attngrad", "grpc", "gpu"],
        "timezone": "utc",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
             "enable": True,
             "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
             "type": "dashboard"},
            {"datasource": DATASOURCE, "enable": True, "iconColor": "purple",
             "name": "Weights loaded",
             "expr": f"changes(attngrad_weights_version{{{SERVER}}}[1m]) > 0",
             "titleFormat": "weights version changed", "textFormat": "{{instance}}", "step": "60s"},
        ]},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source",
             "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [],
             "refresh": 1,
             "regex": ""},
            variable("job", "Job", "label_values(attngrad_build_info, job)"),
            variable("instance", "Instance",
                     'label_values(attngrad_build_info{job=~"$job"}, instance)'),
            variable("device", "Device",
                     'label_values(attngrad_queue_capacity{job=~"$job", instance=~"$instance"}, '
                     'device)'),
        ]},
        "panels": panels(),
    }


def main():
    path = pathlib.Path(__file__).with_name("attngrad.json")
    text = json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"
    if "--check" in sys.argv[1:]:
        if path.read_text() != text:
            print(f"{path} is out of date: run {__file__}", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
