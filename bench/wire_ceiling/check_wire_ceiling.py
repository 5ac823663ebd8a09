#!/usr/bin/env python3
"""ctest bench.wire_ceiling: brief loopback runs of attngrad_wire_ceiling (each forks its own
server), checked against what the flags imply.

The sizes of attngrad.v1.BackwardRequest / BackwardResponse are computed here from the protobuf
wire format by hand (not by the program's own code), for the fields attngrad-cli bench sends and
attngrad-server answers; every run must report exactly those per-batch sizes, totals equal to
batches x size on both the client's and the server's side, batches = streams x count, and
throughput and latency numbers consistent with them.

Usage: check_wire_ceiling.py PATH/TO/attngrad_wire_ceiling
"""
import json
import math
import re
import subprocess
import sys

DTYPES = {"float32": (1, 4), "float16": (2, 2), "bfloat16": (3, 2)}  # wire enum value, bytes
MODES = {"return": 1, "accumulate": 2}
PRECISION_AUTO = 1
BATCH_ID = 1 << 60  # every id the program uses encodes in 9 bytes, as this one
WINDOW_ID = (1 << 50) + 1
SPEC_LAYER = {"hidden_size": 3072, "num_heads": 24, "num_kv_heads": 8, "head_dim": 128}
SMALL_LAYER = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}


def varint_size(value):
    size = 1
    while value >= 128:
        value >>= 7
        size += 1
    return size


def varint_field(value):
    """A varint field (numbers below 16: one tag byte); proto3 leaves zero out."""
    return 0 if value == 0 else 1 + varint_size(value)


def length_field(length):
    """A length-delimited field (numbers below 16) of `length` bytes: tag, length, bytes."""
    return 1 + varint_size(length) + length


def tensor(dtype, shape):
    """attngrad.v1.Tensor: dtype (1), packed shape (2), raw_data (3)."""
    value, element = DTYPES[dtype]
    count = math.prod(shape)
    return (varint_field(value) + length_field(sum(varint_size(d) for d in shape)) +
            length_field(count * element))


def weight_shapes(layer):
    q_out = layer["num_heads"] * layer["head_dim"]
    kv_out = layer["num_kv_heads"] * layer["head_dim"]
    hidden = layer["hidden_size"]
    return [[q_out, hidden], [kv_out, hidden], [kv_out, hidden], [hidden, q_out],
            [layer["head_dim"]], [layer["head_dim"]]]


def request_bytes(B, S, layer, mode, input_dtype, response_dtype, rotary):
    H, D = layer["hidden_size"], layer["head_dim"]
    size = varint_field(BATCH_ID) + varint_field(MODES[mode]) + varint_field(PRECISION_AUTO)
    size += 2 * length_field(tensor(input_dtype, [B, S, H]))  # hidden_states, grad_output
    if rotary == "tables":  # rotary_tables (7): cos, sin fp32 [B,S,D]
        size += length_field(2 * length_field(tensor("float32", [B, S, D])))
    else:  # positions (8): packed position_ids 0..S-1
        size += length_field(length_field(sum(varint_size(s) for s in range(S))))
    size += varint_field(DTYPES[response_dtype][0])  # response_dtype (13)
    return size


def response_bytes(B, S, layer, mode, response_dtype):
    size = varint_field(BATCH_ID) + varint_field(1)  # batch_id, weights_version
    size += length_field(tensor(response_dtype, [B, S, layer["hidden_size"]]))
    if mode == "return":  # weight_gradients (5): six tensors
        size += length_field(
            sum(length_field(tensor(response_dtype, shape)) for shape in weight_shapes(layer)))
    size += length_field(5 * 9)  # timings: five doubles
    size += length_field(len("cuda:0")) + length_field(32)  # device, server_instance_id
    if mode == "accumulate":
        size += varint_field(WINDOW_ID)
    return size


class Failure(Exception):
    pass


def expect(condition, what):
    if not condition:
        raise Failure(what)


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def run(binary, flags):
    command = [binary] + flags
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    print(done.stdout.strip())
    if done.stderr.strip():
        print(done.stderr.strip())
    return done


def check_run(binary, *, transport, mode, B, S, channels, streams, in_flight, count,
              layer=SPEC_LAYER, input_dtype="float32", response_dtype="float32",
              rotary="tables", latency=False, duration=None):
    flags = [f"--transport={transport}", f"--channels={channels}", f"--streams={streams}",
             f"--in_flight={in_flight}", f"--batch={B}", f"--seq_len={S}", f"--mode={mode}",
             f"--input_dtype={input_dtype}", f"--response_dtype={response_dtype}",
             f"--rotary={rotary}", f"--count={count}", "--json"]
    flags += [f"--{name}={value}" for name, value in layer.items()]
    if latency:
        flags.append("--latency")
        mode, B, S, channels, streams, in_flight = "return", 1, 128, 1, 1, 1
    if duration is not None:
        flags.append(f"--duration_seconds={duration}")
    done = run(binary, flags)
    expect(done.returncode == 0, f"exit status {done.returncode}")
    result = json.loads(done.stdout)
    want_request = request_bytes(B, S, layer, mode, input_dtype, response_dtype, rotary)
    want_response = response_bytes(B, S, layer, mode, response_dtype)
    for key, value in [("transport", transport), ("mode", mode), ("batch", B), ("seq_len", S),
                       ("channels", channels), ("streams", streams), ("in_flight", in_flight),
                       ("errors", 0), ("request_bytes_per_batch", want_request),
                       ("response_bytes_per_batch", want_response)]:
        expect(result[key] == value, f"{key} is {result[key]}, expected {value}")
    batches = result["batches"]
    if count > 0:
        expect(batches == streams * count, f"{batches} batches, expected {streams} x {count}")
    else:
        expect(batches > 0, "no batch answered")
    for key, value in [("tokens", batches * B * S), ("request_bytes", batches * want_request),
                       ("response_bytes", batches * want_response),
                       ("server_received_bytes", batches * want_request),
                       ("server_sent_bytes", batches * want_response),
                       ("server_batches", batches)]:
        expect(result[key] == value, f"{key} is {result[key]}, expected {value}")
    seconds = result["seconds"]
    expect(seconds > 0, f"seconds {seconds}")
    if duration is not None:
        expect(seconds >= duration, f"ran {seconds} s of --duration_seconds={duration}")
    expect(close(result["tokens_per_second"], result["tokens"] / seconds), "tokens_per_second")
    expect(close(result["request_gb_per_second"], result["request_bytes"] / 1e9 / seconds),
           "request_gb_per_second")
    expect(close(result["response_gb_per_second"], result["response_bytes"] / 1e9 / seconds),
           "response_gb_per_second")
    expect(close(result["gb_per_second"],
                 (result["request_bytes"] + result["response_bytes"]) / 1e9 / seconds),
           "gb_per_second")
    expect(0 < result["p50_seconds"] <= result["p99_seconds"] <= result["max_seconds"] <= seconds,
           "latencies: need 0 < p50 <= p99 <= max <= seconds")
    moved_gb = (result["request_bytes"] + result["response_bytes"]) / 1e9
    for side in ["server", "client"]:
        cpu = result[f"{side}_cpu_seconds"]
        expect(cpu > 0, f"{side}_cpu_seconds {cpu}")
        expect(close(result[f"{side}_cpu_seconds_per_gb"], cpu / moved_gb),
               f"{side}_cpu_seconds_per_gb")


def check_text_line(binary):
    """The default output: one line naming the per-batch sizes and no errors."""
    done = run(binary, ["--batch=2", "--seq_len=8", "--count=3", "--streams=2", "--channels=2"])
    expect(done.returncode == 0, f"exit status {done.returncode}")
    lines = done.stdout.strip().splitlines()
    expect(len(lines) == 1, f"{len(lines)} lines of output, expected 1")
    sizes = [int(size) for size in re.findall(r"\((\d+) B/batch\)", lines[0])]
    want = [request_bytes(2, 8, SPEC_LAYER, "accumulate", "float32", "float32", "tables"),
            response_bytes(2, 8, SPEC_LAYER, "accumulate", "float32")]
    expect(sizes == want, f"B/batch {sizes}, expected {want}")
    expect(" 6 batches in " in lines[0] and lines[0].endswith("errors 0"),
           "expected 6 batches and errors 0")


def check_serve_and_connect(binary):
    """--serve in one process, --connect from another; the server stops on SIGTERM."""
    server = subprocess.Popen([binary, "--serve=127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        print(line.strip())
        port = re.search(r"serving on port (\d+)", line)
        expect(port is not None, "--serve did not say its port")
        done = run(binary, [f"--connect=127.0.0.1:{port.group(1)}", "--transport=bytebuffer",
                            "--batch=1", "--seq_len=4", "--count=4", "--streams=2", "--json"])
        expect(done.returncode == 0, f"--connect: exit status {done.returncode}")
        result = json.loads(done.stdout)
        want = request_bytes(1, 4, SPEC_LAYER, "accumulate", "float32", "float32", "tables")
        expect(result["batches"] == 8 and result["server_received_bytes"] == 8 * want,
               f"--connect: {result['batches']} batches, {result['server_received_bytes']} "
               f"bytes at the server; expected 8 and {8 * want}")
        server.terminate()
        expect(server.wait(timeout=30) == 0, f"--serve exited with {server.returncode} on SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def check_bad_flag(binary):
    done = run(binary, ["--mode=sideways"])
    expect(done.returncode == 2 and "--mode" in done.stderr,
           "--mode=sideways: expected exit status 2 and an error naming --mode")


def main():
    binary = sys.argv[1]
    checks = [
        lambda: check_run(binary, transport="protobuf", mode="accumulate", B=1, S=128,
                          channels=2, streams=2, in_flight=2, count=10),
        lambda: check_run(binary, transport="bytebuffer", mode="accumulate", B=1, S=128,
                          channels=2, streams=2, in_flight=2, count=10),
        lambda: check_run(binary, transport="protobuf", mode="return", B=2, S=64, channels=1,
                          streams=3, in_flight=1, count=3, layer=SMALL_LAYER,
                          input_dtype="bfloat16", response_dtype="float16", rotary="positions"),
        lambda: check_run(binary, transport="bytebuffer", mode="return", B=2, S=64, channels=3,
                          streams=3, in_flight=3, count=3, layer=SMALL_LAYER,
                          input_dtype="float16", response_dtype="bfloat16"),
        lambda: check_run(binary, transport="bytebuffer", mode="return", B=0, S=0, channels=0,
                          streams=0, in_flight=0, count=5, layer=SMALL_LAYER, latency=True),
        lambda: check_run(binary, transport="protobuf", mode="accumulate", B=1, S=32, channels=2,
                          streams=2, in_flight=2, count=0, duration=0.5),
        lambda: check_text_line(binary),
        lambda: check_serve_and_connect(binary),
        lambda: check_bad_flag(binary),
    ]
    failures = 0
    for check in checks:
        try:
            check()
        except Failure as failure:
            print(f"FAILED: {failure}", flush=True)
            failures += 1
    print(f"{len(checks) - failures} of {len(checks)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
