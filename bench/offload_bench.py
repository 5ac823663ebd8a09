#!/usr/bin/env python3
"""Whole training steps of Gemma-3 models with the attention backward offloaded to attngrad
(attngrad.torch.offload) against the same model trained locally, on the same GPU and batches.

For each model (random-init transformers Gemma3ForCausalLM, fp32, saved sharded with
save_pretrained and served by attngrad-server --weights=DIR) and each B x S, N optimizer steps
(AdamW) of every variant, on the same input ids:
  local eager fp32     transformers' default attention (sdpa), fp32 matmuls
  local sdpa tf32      the same with torch.set_float32_matmul_precision("high")
  local compile tf32   torch.compile of the model, TF32
  local bf16 autocast  for honesty (no target)
  offload auto         offload(model) with transport="auto" (CUDA IPC on the same GPU), RETURN,
                       server precision AUTO, the rest of the model in TF32; the client's sender
                       thread sends each call once the trainer's stream has reached it (and the
                       backward uploads changed weights itself)
  offload auto gpu-ordered
                       the same with ATTNGRAD_GPU_ORDERED=1: each call sent at once and ordered by
                       the trainer's stream on the server's GPU (stream_order), changed weights
                       uploaded by the client's sender thread
  offload auto gpu-ordered server forward
                       GPU-ordered, and the layers' forward computed by the server too
                       (offload(server_forward=True)): the trainer runs no attention kernel
  offload auto server forward
                       the host-ordered default with the forward on the server
  offload auto sender uploads
                       the default with ATTNGRAD_SENDER_UPLOADS=1: changed weights uploaded by
                       the client's sender thread, queued by the forward
  offload auto lazy registration
                       the same with Client.register_existing_segments = False: each allocation
                       registered when a call first names it, not all at the first call
  offload auto waited  the same with stream_ordered=False: each backward call answered before
                       backward() goes on (the trainer's CPU waits for the server)
  offload bytes        the same with transport="bytes" (everything through grpcio)
It reports the median step time, the trainer process's peak GPU memory (the server is another
process; also the peak above what stays allocated between steps, i.e. the step's own activations,
gradients and optimizer temporaries) and the loss curves (each offloaded curve against local eager
fp32: max relative difference). --remote adds the remote path: transport="bytes", ACCUMULATE over
--micro-batches micro-batches per optimizer step with one fetch, against the local TF32 step over
the same micro-batches. --spec-layer adds the SPEC layer through RemoteGemma3Attention (1 x 1024,
forward + backward) against local eager fp32 autograd of the same layer, with the client's phase
timings.

    python3 bench/offload_bench.py --server build/server/attngrad-server \\
        --configs 4b-attn,27b-attn --shapes 1x2048,4x2048 --steps 10 --remote --spec-layer

Prints markdown tables for bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "client" / "python"))
sys.path.insert(0, str(HERE.parent / "client" / "python" / "examples"))

import torch  # noqa: E402

import attngrad  # noqa: E402
import attngrad.torch as attngrad_torch  # noqa: E402
from check_offload import Server, build_model, loss_of, write_checkpoint  # noqa: E402

LOCAL_VARIANTS = ("local eager fp32", "local sdpa tf32", "local compile tf32",
                  "local bf16 autocast")
OFFLOAD_VARIANTS = ("offload auto", "offload auto gpu-ordered",
                    "offload auto gpu-ordered server forward", "offload auto server forward",
                    "offload auto sender uploads", "offload auto lazy registration",
                    "offload auto waited", "offload bytes")


def set_tf32(enabled: bool) -> None:
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


class Measured:
    """Step times, losses, peak memory and (offloaded) the transports and phases seen."""

    def __init__(self, name: str):
        self.name = name
        self.seconds, self.losses = [], []
        self.peak_bytes = 0
        self.resident_bytes = 0  # allocated between steps (weights, optimizer state)
        self.transports = set()
        self.phases = {}
        self.split = {}  # "forward" / "backward" / "optimizer": GPU-timeline ms per step

    def add_split(self, events) -> None:
        """EVENTS: CUDA events recorded at a step's start, after its forward, after its backward
        (and fetch) and after the optimizer step; their intervals on the GPU's timeline (the time
        the GPU waited for the CPU included)."""
        for name, (begin, end) in zip(("forward", "backward", "optimizer"),
                                      zip(events, events[1:])):
            self.split.setdefault(name, []).append(begin.elapsed_time(end))

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.seconds) if self.seconds else float("nan")


def train(model, batches, steps: int, warmup: int, step_fn, measured: Measured):
    """STEPS timed optimizer steps after WARMUP untimed ones; step_fn(ids, events) does one step's
    work (events: a list for optimizer_step's CUDA events)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for index in range(warmup + steps):
        if index == warmup:  # what stays between steps: weights, optimizer state
            torch.cuda.synchronize()
            measured.resident_bytes = torch.cuda.memory_allocated()
        ids = batches[index % len(batches)]
        events = []
        started = time.perf_counter()
        loss = step_fn(ids, events)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if index >= warmup:
            measured.seconds.append(elapsed)
            measured.losses.append(float(loss))
            if len(events) == 4:
                measured.add_split(events)
    measured.peak_bytes = torch.cuda.max_memory_allocated()
    return measured


def _mark(events) -> None:
    if events is not None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)


def optimizer_step(model, optimizer, micro_batches, after_backward=None, events=None):
    """One optimizer step over MICRO_BATCHES (a list of input id tensors); returns the mean loss.
    EVENTS (a list, one micro-batch): CUDA events are appended at the start, after the forward,
    after the backward and after the optimizer step."""
    events = events if len(micro_batches) == 1 else None
    _mark(events)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for ids in micro_batches:
        loss = loss_of(model, ids) / len(micro_batches)
        _mark(events)
        loss.backward()
        total += loss.detach()
    if after_backward is not None:
        after_backward()
    _mark(events)
    optimizer.step()
    _mark(events)
    return total


def run_local(name, base_model, batches, args):
    model = copy.deepcopy(base_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    set_tf32(name != "local eager fp32")
    measured = Measured(name)
    forward_model = model
    if name == "local compile tf32":
        forward_model = torch.compile(model)

    def step(ids, events):
        if name == "local bf16 autocast":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return optimizer_step(forward_model, optimizer, [ids], events=events)
        return optimizer_step(forward_model, optimizer, [ids], events=events)

    warmup = args.warmup + (2 if forward_model is not model else 0)  # compiling takes steps
    return train(model, batches, args.steps, warmup, step, measured)


def transport_label(result) -> str:
    """What carried a call and, for one queued on the trainer's stream, who ordered it."""
    ordering = getattr(result, "ordering", "")
    return result.transport + (f" ({ordering}-ordered)" if ordering else "")


def set_environment(name: str, value) -> None:
    """Sets (VALUE None: unsets) one of the client's environment switches for the next variant."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def run_offloaded(name, base_model, batches, target, args, *, mode="return", micro_batches=1,
                  transport=None):
    model = copy.deepcopy(base_model)
    transport = transport or ("bytes" if name == "offload bytes" else "auto")
    set_environment("ATTNGRAD_GPU_ORDERED", "1" if "gpu-ordered" in name else None)
    set_environment("ATTNGRAD_SENDER_UPLOADS", "1" if "sender uploads" in name else None)
    handle = attngrad_torch.offload(model, target, mode=mode, precision=args.precision,
                                    transport=transport, timeout=args.timeout,
                                    phase_timings=True, stream_ordered="waited" not in name,
                                    server_forward="server forward" in name)
    for client in getattr(handle.client, "clients", [handle.client]):
        client.register_existing_segments = "lazy registration" not in name
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    set_tf32(True)
    measured = Measured(name)
    fetch = handle.fetch_gradients if mode == "accumulate" else None

    def step(ids, events):
        group = [ids] if micro_batches == 1 else list(torch.chunk(ids, micro_batches, dim=0))
        loss = optimizer_step(model, optimizer, group, fetch, events)
        for index, result in handle.last_results().items():
            if result is None:
                continue
            measured.transports.add(transport_label(result))
            for phase, seconds in (result.client_phases or {}).items():
                measured.phases.setdefault(phase, []).append(seconds)
            measured.phases.setdefault("server compute", []).append(
                sum(t.compute for t in result.timings))
            measured.phases.setdefault("server total", []).append(
                sum(t.total for t in result.timings))
        return loss

    profile = cProfile.Profile() if getattr(args, "profile", False) and transport == "auto" \
        else None
    try:
        if profile is None:
            return train(model, batches, args.steps, args.warmup, step, measured)
        profile.enable()
        try:
            return train(model, batches, args.steps, args.warmup, step, measured)
        finally:
            profile.disable()
            print(f"\n{name}: the trainer's CPU profile of {args.warmup + args.steps} steps "
                  "(top 25 by own time)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        counts = getattr(handle.client, "cuda_region_counts", None)
        if counts is not None and transport != "bytes":
            print(f"  {name}: CUDA IPC regions after {args.warmup + args.steps} steps: "
                  f"{counts()}", flush=True)
        handle.remove()


def release_memory() -> None:
    """Frees what the last variant left (its model and optimizer, reference cycles included) so
    that the next variant's peak memory is its own."""
    gc.collect()
    torch.cuda.empty_cache()


def curve_difference(measured: Measured, reference: Measured) -> float:
    pairs = zip(measured.losses, reference.losses)
    return max((abs(a - b) / max(abs(b), 1e-30) for a, b in pairs), default=float("nan"))


def print_table(title, rows, reference_names):
    print(f"\n### {title}\n")
    print("| variant | median step ms | × local sdpa tf32 | × local compile tf32 | peak MB | "
          "peak above resident MB | loss rel. diff vs eager fp32 | transport |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    by_name = {m.name: m for m in rows}
    sdpa, compiled = (by_name.get(n) for n in reference_names)
    eager = by_name.get("local eager fp32")
    for m in rows:
        ratio_sdpa = m.median_ms / sdpa.median_ms if sdpa else float("nan")
        ratio_compile = m.median_ms / compiled.median_ms if compiled else float("nan")
        difference = curve_difference(m, eager) if eager and m is not eager else 0.0
        print(f"| {m.name} | {m.median_ms:.1f} | {ratio_sdpa:.2f} | {ratio_compile:.2f} | "
              f"{m.peak_bytes / 2**20:,.0f} | {(m.peak_bytes - m.resident_bytes) / 2**20:,.0f} | "
              f"{difference:.1e} | "
              f"{', '.join(sorted(m.transports)) or '-'} |")
    for m in rows:
        if m.split:
            parts = ", ".join(f"{phase} {statistics.median(values):.2f}"
                              for phase, values in m.split.items())
            print(f"\n{m.name}: per step on the GPU's timeline, median ms: {parts}")
    for m in rows:
        if m.phases:
            parts = ", ".join(f"{phase} {1e3 * statistics.median(values):.2f}"
                              for phase, values in m.phases.items())
            print(f"\n{m.name}: per layer backward, median ms: {parts}")


def bench_model(config, args, device):
    model_args = argparse.Namespace(config=config, vocab=0, num_layers=0, attention="sdpa",
                                    seed=args.seed)
    base = build_model(model_args, device)
    parameters = sum(p.numel() for p in base.parameters())
    print(f"\n## Gemma-3 {config}: {base.config.num_hidden_layers} layers, hidden "
          f"{base.config.hidden_size}, heads {base.config.num_attention_heads}/"
          f"{base.config.num_key_value_heads}, head_dim {base.config.head_dim}, "
          f"{parameters / 1e6:.0f} M parameters, fp32", flush=True)
    with tempfile.TemporaryDirectory(prefix="attngrad-offload-bench-") as work:
        directory = Path(work) / "checkpoint"
        write_checkpoint(base.cpu(), directory, f"{max(1, parameters // 1_000_000)}MB")
        base.to(device)
        server = Server(args.server, directory, args.devices)
        try:
            server.wait()
            for shape in args.shapes.split(","):
                batch, seq_len = (int(v) for v in shape.lower().split("x"))
                generator = torch.Generator().manual_seed(args.seed + batch * 7 + seq_len)
                batches = [torch.randint(0, base.config.vocab_size, (batch, seq_len),
                                         generator=generator).to(device) for _ in range(4)]
                rows = []
                for name in LOCAL_VARIANTS:
                    if name == "local compile tf32" and not args.compile:
                        continue
                    rows.append(run_local(name, base, batches, args))
                    release_memory()  # the variant's model and optimizer state are gone
                    print(f"  {config} {shape} {name}: {rows[-1].median_ms:.1f} ms", flush=True)
                for name in OFFLOAD_VARIANTS:
                    if name not in args.offload_variants.split(","):
                        continue
                    rows.append(run_offloaded(name, base, batches, server.target, args))
                    release_memory()
                    print(f"  {config} {shape} {name}: {rows[-1].median_ms:.1f} ms", flush=True)
                print_table(f"{config}, B×S = {shape}, RETURN, {args.steps} steps", rows,
                            ("local sdpa tf32", "local compile tf32"))
                if args.remote and batch == 1:
                    bench_remote(config, base, seq_len, server.target, args, device)
        finally:
            server.stop()
    del base
    torch.cuda.empty_cache()


def bench_remote(config, base, seq_len, target, args, device):
    """ACCUMULATE over --micro-batches sequences per optimizer step, one fetch, bytes on the wire
    (what a trainer on another host does), against the local TF32 step over the same sequences."""
    count = args.micro_batches
    generator = torch.Generator().manual_seed(args.seed + 99)
    batches = [torch.randint(0, base.config.vocab_size, (count, seq_len), generator=generator)
               .to(device) for _ in range(2)]
    local = Measured("local sdpa tf32")
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    set_tf32(True)
    train(model, batches, max(3, args.steps // 2), 1,
          lambda ids, events: optimizer_step(model, optimizer,
                                             list(torch.chunk(ids, count, dim=0))),
          local)
    model = optimizer = None
    torch.cuda.empty_cache()
    remote = run_offloaded("offload bytes accumulate", base, batches, target,
                           argparse.Namespace(**{**vars(args), "steps": max(3, args.steps // 2),
                                                 "warmup": 1}),
                           mode="accumulate", micro_batches=count, transport="bytes")
    print(f"\n### remote path, {config}, {count} micro-batches of 1×{seq_len} per optimizer step "
          f"(ACCUMULATE, one fetch, transport bytes)\n")
    print("| local sdpa tf32 | offloaded over TCP | ratio | loss rel. diff |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {local.median_ms:.1f} ms | {remote.median_ms:.1f} ms | "
          f"{remote.median_ms / local.median_ms:.2f} | {curve_difference(remote, local):.1e} |")


def bench_spec_layer(args, device):
    """The SPEC layer through RemoteGemma3Attention, forward + backward, against local eager."""
    server = SpecServer(args.server, args.devices)
    try:
        server.wait()
        batch, seq_len = 1, 1024
        hidden = torch.randn(batch, seq_len, 3072, device=device) / 3072 ** 0.5
        cos, sin = attngrad_torch.rotary_tables(torch.arange(seq_len, device=device))
        set_tf32(False)
        rows = []
        variants = (("auto", True, None), ("auto gpu-ordered", True, "1"),
                    ("auto gpu-ordered server forward", True, "1"),
                    ("auto waited", False, None), ("bytes", False, None))
        for name, ordered, gpu_ordered in variants:
            set_environment("ATTNGRAD_GPU_ORDERED", gpu_ordered)
            client = attngrad.Client(server.target, timeout=args.timeout, phase_timings=True)
            layer = attngrad_torch.RemoteGemma3Attention(
                client, transport=name.split()[0], stream_ordered=ordered,
                server_forward="server forward" in name).to(device)
            rows.append((f"RemoteGemma3Attention {name}",
                         time_layer(lambda: layer(hidden.requires_grad_(), cos, sin), layer,
                                    args.steps)))
            weights = layer.weights()
            client.close()
        set_environment("ATTNGRAD_GPU_ORDERED", None)
        local_weights = {name: w.detach().clone().requires_grad_() for name, w in weights.items()}

        def local_forward():
            return attngrad_torch.gemma3_attention(
                hidden.requires_grad_(), cos, sin, local_weights["q_proj"],
                local_weights["k_proj"], local_weights["v_proj"], local_weights["o_proj"],
                local_weights["q_norm"], local_weights["k_norm"])

        rows.append(("local eager fp32 autograd", time_layer(local_forward, None, args.steps)))
        print("\n### SPEC layer, 1×1024, forward + backward\n")
        print("| what | median ms | × local eager fp32 | transport | client phases (median ms) |")
        print("| --- | ---: | ---: | --- | --- |")
        local_ms = rows[-1][1][0]
        for name, (ms, transports, phases) in rows:
            parts = ", ".join(f"{p} {1e3 * statistics.median(v):.2f}" for p, v in phases.items())
            print(f"| {name} | {ms:.2f} | {ms / local_ms:.2f} | {', '.join(transports) or '-'} | "
                  f"{parts or '-'} |")
    finally:
        server.stop()


def time_layer(forward, layer, steps):
    """(median ms of forward + backward, transports, client phases) over STEPS after 3 warmups."""
    seconds, transports, phases = [], set(), {}
    for index in range(steps + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        forward().square().mean().backward()
        torch.cuda.synchronize()
        if index >= 3:
            seconds.append(time.perf_counter() - started)
            if layer is not None and layer.last_result is not None:
                result = layer.last_result
                transports.add(transport_label(result))
                for phase, value in (result.client_phases or {}).items():
                    phases.setdefault(phase, []).append(value)
                phases.setdefault("server compute", []).append(
                    sum(t.compute for t in result.timings))
    return 1e3 * statistics.median(seconds), sorted(transports), phases


class SpecServer(Server):
    """attngrad-server of the SPEC layer (no --weights: the module uploads its own)."""

    def __init__(self, binary: str, devices: str):
        import subprocess  # noqa: PLC0415

        from check_offload import free_port  # noqa: PLC0415

        self.target = f"127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(prefix="attngrad-server-", suffix=".log",
                                               delete=False)
        flags = [f"--listen={self.target}", "--metrics_listen=", f"--devices={devices}"]
        self.process = subprocess.Popen([binary] + flags, stdout=self.log,
                                        stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the attngrad-server binary")
    parser.add_argument("--devices", default="0")
    parser.add_argument("--configs", default="4b-attn,27b-attn",
                        help="check_offload.py presets: 4b-attn, 27b-attn, 270m, 1b, tiny")
    parser.add_argument("--shapes", default="1x2048,4x2048", help="B x S list")
    parser.add_argument("--offload-variants", default=",".join(OFFLOAD_VARIANTS),
                        help="which offloaded variants to time (comma-separated)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", default="auto", help="the server's precision")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--remote", action="store_true",
                        help="the remote path (ACCUMULATE, bytes) for each B = 1 shape")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--spec-layer", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print the trainer's CPU profile (cProfile) of the auto offload steps")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, attngrad client "
          f"{Path(attngrad.__file__).parent}", flush=True)
    if args.spec_layer:
        bench_spec_layer(args, device)
    for config in args.configs.split(","):
        if config:
            bench_model(config.strip(), args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
