#!/usr/bin/env python3
"""The H200 check of the PyTorch autograd bridge: for each workload, the gradients that
attngrad.torch.RemoteGemma3Attention gets from the service (all 7 outputs of SPEC section 1) against
float64 PyTorch autograd of the same layer (attngrad.torch.gemma3_attention), judged by SPEC section
4; ACCUMULATE + fetch against the sum of two batches; what each keeps for the backward (saved-tensor
hooks); the wall time of the bridge's backward next to eager PyTorch's (fp32 and TF32) on the same
GPU; then examples/train_step.py. Prints a markdown summary for bench/RESULTS.md; exit status 1 on a
miss.

    # on the GPU machine (server libraries carried with bench/device/stage.sh libs):
    LD_LIBRARY_PATH=libs python3 client/python/examples/check_autograd.py \
        --server build/server/attngrad-server [--workloads 1x128,2x541,1x2048] [--precision auto]
    # or against a running server
    python3 client/python/examples/check_autograd.py --target localhost:50051
"""
from __future__ import annotations

import argparse
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import attngrad  # noqa: E402
import attngrad.torch as bridge  # noqa: E402

ATOL = {(1, 128): .0067, (1, 256): .0070, (1, 512): .0086, (1, 2048): .0071, (2, 512): .0084,
        (2, 541): .0079, (2, 1024): .0069, (2, 2048): .0073, (4, 128): .0081, (4, 256): .0077,
        (4, 1024): .0083, (8, 128): .0091, (8, 512): .0089, (16, 256): .0092, (32, 128): .0091,
        (64, 256): .0099}
OUTPUTS = ("hidden_states", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def spec_check(output: torch.Tensor, reference: torch.Tensor, atol: float, name: str):
    """(passes, matched fraction, misses) under SPEC section 4 (norm-weight gradients: <= 1
    miss)."""
    output = output.detach().double()
    reference = reference.detach().double()
    if output.shape != reference.shape or not torch.isfinite(output).all():
        return False, 0.0, -1
    ok = (output - reference).abs() <= atol + 1e-3 * reference.abs()
    misses = int((~ok).sum())
    fraction = float(ok.double().mean())
    passes = misses <= 1 if name in ("q_norm", "k_norm") else fraction >= 0.99
    return passes, fraction, misses


def spec_inputs(batch, seq_len, device, generator):
    hidden = torch.randn(batch, seq_len, 3072, device=device, generator=generator) / math.sqrt(3072)
    grad = torch.randn(batch, seq_len, 3072, device=device, generator=generator)
    cos, sin = bridge.rotary_tables(torch.arange(seq_len, device=device).expand(batch, seq_len))
    return hidden.requires_grad_(), grad, cos, sin


def reference_grads(module, hidden, grad, cos, sin, dtype=torch.float64):
    weights = {n: w.detach().to(dtype).requires_grad_() for n, w in module.weights().items()}
    x = hidden.detach().to(dtype).requires_grad_()
    out = bridge.gemma3_attention(x, cos.to(dtype), sin.to(dtype), *weights.values())
    out.backward(grad.to(dtype))
    grads = {"hidden_states": x.grad}
    grads.update({n: w.grad for n, w in weights.items()})
    return grads


def saved_bytes(function):
    """Bytes of the distinct tensors autograd saves while FUNCTION runs (weights excluded)."""
    seen = {}

    def pack(tensor):
        seen[(tensor.data_ptr(), tensor.numel())] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return seen


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_backward(run_forward, grad, repeats=3):
    """Median wall time (s) of forward-then-backward's backward part."""
    times = []
    for _ in range(repeats):
        out = run_forward()
        synchronize(grad.device)
        started = time.perf_counter()
        out.backward(grad)
        synchronize(grad.device)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def start_server(binary, devices):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = f"127.0.0.1:{port}"
    flags = [binary, f"--listen={target}", "--metrics_listen=", "--weights=random"]
    if devices:
        flags.append(f"--devices={devices}")
    return target, subprocess.Popen(flags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target")
    where.add_argument("--server", help="attngrad-server binary to start on a loopback port")
    parser.add_argument("--devices", default="")
    parser.add_argument("--workloads", default="1x128,2x541,4x256,1x2048,8x512")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rounds", type=int, default=1, help="fresh draws per workload")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--device", default="cuda",
                        help="where the local forward and the float64 reference run "
                             "(cpu: a dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("check_autograd.py: no CUDA GPU here (use --device cpu for a dry run)")
        return 2
    workloads = [tuple(int(v) for v in w.split("x")) for w in args.workloads.split(",")]

    process = None
    target = args.target
    if args.server:
        target, process = start_server(args.server, args.devices)
    failures = []
    lines = []
    try:
        client = attngrad.Client(target)
        info = client.wait_until_serving(timeout=180)
        devices = ", ".join(f"{d.name} ({d.backend})" for d in info.devices)
        print(f"server {target}: {info.server_version} on {devices}; precision={args.precision}")
        lines.append(f"Server on {devices}, bridge precision `{args.precision}`, torch "
                     f"{torch.__version__} on "
                     f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}.")
        lines.append("")
        lines.append("| B×S | min matched fraction over the 7 outputs (norm-grad misses) "
                     "| bridge backward | eager fp32 backward | eager TF32 backward | saved/token "
                     "bridge | saved/token eager |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        generator = torch.Generator(device=device)
        for batch, seq_len in workloads:
            atol = ATOL.get((batch, seq_len), 0.0067)
            worst, norm_misses = 1.0, 0
            for round_index in range(args.rounds):
                generator.manual_seed(1000 * batch + seq_len + round_index)
                torch.manual_seed(1000 * batch + seq_len + round_index)
                module = bridge.RemoteGemma3Attention(client, mode="return",
                                                      precision=args.precision).to(device)
                hidden, grad, cos, sin = spec_inputs(batch, seq_len, device, generator)
                module(hidden, cos, sin).backward(grad)
                got = {"hidden_states": hidden.grad}
                got.update({n: w.grad for n, w in module.weights().items()})
                want = reference_grads(module, hidden, grad, cos, sin)
                for name in OUTPUTS:
                    passes, fraction, misses = spec_check(got[name], want[name], atol, name)
                    worst = min(worst, fraction)
                    if name in ("q_norm", "k_norm"):
                        norm_misses = max(norm_misses, misses)
                    if not passes:
                        failures.append(f"{batch}x{seq_len} round {round_index} {name}: "
                                        f"{fraction:.6f} matched, {misses} misses")
                del want
            tokens = batch * seq_len
            bridge_saved = sum(saved_bytes(lambda: module(hidden, cos, sin)).values()) / tokens
            weight_ptrs = {w.data_ptr() for w in module.weights().values()}
            eager = saved_bytes(lambda: bridge.gemma3_attention(hidden, cos, sin,
                                                                *module.weights().values()))
            eager_saved = sum(v for (p, _), v in eager.items() if p not in weight_ptrs) / tokens
            timing = ["", "", ""]
            if not args.no_timing:
                module.zero_grad()
                timing[0] = f"{timed_backward(lambda: module(hidden, cos, sin), grad) * 1e3:.1f} ms"
                eager_forward = lambda: bridge.gemma3_attention(  # noqa: E731
                    hidden, cos, sin, *module.weights().values())
                for index, tf32 in ((1, False), (2, True)):
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    timing[index] = f"{timed_backward(eager_forward, grad) * 1e3:.1f} ms"
                torch.backends.cuda.matmul.allow_tf32 = False
            line = (f"| {batch}×{seq_len} | {worst:.6f} ({norm_misses}) | {timing[0]} | "
                    f"{timing[1]} | {timing[2]} | {bridge_saved / 1024:.1f} KiB | "
                    f"{eager_saved / 1024:.1f} KiB |")
            print(line, flush=True)
            lines.append(line)
            del module, hidden, grad, cos, sin
            if device.type == "cuda":
                torch.cuda.empty_cache()

        # ACCUMULATE: two batches, fetched into .grad, against the float64 sum.
        batch, seq_len = (2, 256) if device.type == "cuda" else (1, 8)
        generator.manual_seed(7)
        module = bridge.RemoteGemma3Attention(client, mode="accumulate",
                                              precision=args.precision).to(device)
        total = None
        for _ in range(2):
            hidden, grad, cos, sin = spec_inputs(batch, seq_len, device, generator)
            module(hidden, cos, sin).backward(grad)
            want = reference_grads(module, hidden, grad, cos, sin)
            total = want if total is None else {n: total[n] + want[n] for n in want}
        state = module.fetch_gradients()
        accumulate_ok = state.tokens == 2 * batch * seq_len
        for name, weight in module.weights().items():
            passes, fraction, misses = spec_check(weight.grad, total[name], 0.0067, name)
            accumulate_ok &= passes
            if not passes:
                failures.append(f"accumulate {name}: {fraction:.6f} matched, {misses} misses")
        lines.append("")
        lines.append(f"ACCUMULATE (2 batches of {batch}×{seq_len}, fetched into .grad): "
                     f"{'within SPEC section 4' if accumulate_ok else 'FAILED'}; window covered "
                     f"{state.tokens} tokens.")
        client.close()

        if not args.no_train:
            command = [sys.executable, str(HERE / "train_step.py"), "--target", target,
                       "--device", args.device, "--batch", "8", "--seq-len", "128", "--steps", "10"]
            print("$", " ".join(command), flush=True)
            trained = subprocess.run(command, capture_output=True, text=True)
            print(trained.stdout + trained.stderr)
            last = [line for line in trained.stdout.splitlines() if line.startswith("loss ")]
            lines.append(f"examples/train_step.py (8×128, 10 steps): "
                         f"{last[-1] if last else 'no output'} (exit {trained.returncode}).")
            if trained.returncode != 0:
                failures.append("train_step.py: loss did not go down")
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    print("\n".join(["", "## Python autograd bridge on the GPU"] + lines))
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
