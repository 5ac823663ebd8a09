#!/usr/bin/env python3
"""The end-to-end offload check: a whole Gemma-3 model whose attention backward runs on
attngrad servers through attngrad.torch.offload, against local autograd of the same model.

1. Builds a random-init Gemma-3 text model (transformers' Gemma3ForCausalLM, fp32, the 270M or 1B
   config, or a reduced one) and writes it with save_pretrained, sharded (model-0000N-of-0000M
   .safetensors + model.safetensors.index.json + config.json).
2. Starts attngrad-server --weights=DIR (--devices as given) and offloads a copy of the model to it
   with upload_weights=False: the servers' weights are the checkpoint's, so one training step's
   parameter gradients check what the server read from DIR. Every parameter's gradient (attention
   weights, and everything below them, which receive the servers' grad of hidden_states) is
   compared with local autograd: relative L2 error, and the SPEC section 4 rule with
   atol = --atol-scale * max|reference| and rtol 1e-3 (>= 99% of the elements; the norm weights'
   gradients at most one miss).
3. Runs --steps optimizer steps (weights uploaded after every step, each backward pinned to them)
   side by side with the local model on the same batches: every step's loss within --loss-rtol.
4. The same with the layers split over two server processes (--layers=0-(n/2-1) and n/2-(n-1)),
   through the layer map "0-A=host:port1,B-C=host:port2".

Prints a markdown summary for bench/RESULTS.md; exit status 1 on a miss.

    # H200 (transformers + torch there; head_dim 256 needs GPU kernels for it, else --devices=cpu):
    python3 client/python/examples/check_offload.py --server build/server/attngrad-server \\
        --config 270m --devices 0 [--devices2 0] [--steps 20] [--mode return|accumulate]
    # a reduced model against CPU servers (minutes on a laptop):
    python3 client/python/examples/check_offload.py --server build-cpu/server/attngrad-server \\
        --config tiny --devices cpu --steps 5
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import attngrad  # noqa: E402
import attngrad.torch as attngrad_torch  # noqa: E402

# The published text configs (transformers' Gemma3TextConfig fields); "tiny" keeps 270M's attention
# shape (hidden 640, 4 heads, 1 kv head, head_dim 256) with 4 layers, a small vocabulary and MLP.
PRESETS = {
    "270m": dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 query_pre_attn_scalar=256, sliding_window=512, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0, max_position_embeddings=32768),
    "1b": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
               num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               query_pre_attn_scalar=256, sliding_window=512, rope_theta=1_000_000.0,
               rope_local_base_freq=10_000.0, max_position_embeddings=32768),
    # Reduced models with the attention shapes of 4B (2560 / 8 / 4 / 256) and 27B (5376 / 32 / 16 /
    # 128): few layers, a small vocabulary and MLP, so that the attention dominates a step.
    "4b-attn": dict(vocab_size=4096, hidden_size=2560, intermediate_size=1024, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                    query_pre_attn_scalar=256, sliding_window=1024, rope_theta=1_000_000.0,
                    rope_local_base_freq=10_000.0, max_position_embeddings=32768),
    "27b-attn": dict(vocab_size=4096, hidden_size=5376, intermediate_size=1024,
                     num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=16,
                     head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                     rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                     max_position_embeddings=32768),
    "tiny": dict(vocab_size=512, hidden_size=640, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 query_pre_attn_scalar=256, sliding_window=16, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0, max_position_embeddings=4096),
}


def layer_types(layers: int, pattern: int = 6):
    """Gemma-3's interleaving: every PATTERN-th layer full attention, the others sliding."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def build_model(args, device):
    import transformers  # noqa: PLC0415 - needed only here (and on the machine that runs this)

    fields = dict(PRESETS[args.config])
    if args.vocab:
        fields["vocab_size"] = args.vocab
    if args.num_layers:
        fields["num_hidden_layers"] = args.num_layers
    fields["layer_types"] = layer_types(fields["num_hidden_layers"])
    config = transformers.Gemma3TextConfig(**fields, attn_implementation=args.attention,
                                           use_cache=False)
    torch.manual_seed(args.seed)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1 + w): move them so their grads matter
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.1)
    return model.to(device)


def write_checkpoint(model, directory: Path, shard_size: str) -> None:
    model.save_pretrained(directory, max_shard_size=shard_size, safe_serialization=True)
    shards = sorted(p.name for p in directory.glob("model-*-of-*.safetensors"))
    index = directory / "model.safetensors.index.json"
    print(f"wrote {directory}: config.json, {len(shards)} shards, index "
          f"{'present' if index.exists() else 'MISSING'}", flush=True)
    if not shards or not index.exists():
        raise SystemExit(f"save_pretrained did not shard the checkpoint "
                         f"(max_shard_size={shard_size})")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """attngrad-server --weights=DIR [--layers=A-B] on a free loopback port."""

    def __init__(self, binary: str, directory: Path, devices: str, layers: str = "",
                 extra=()):
        self.target = f"127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(prefix="attngrad-server-", suffix=".log",
                                               delete=False)
        flags = [f"--listen={self.target}", "--metrics_listen=", f"--weights={directory}"]
        if devices:
            flags.append(f"--devices={devices}")
        if layers:
            flags.append(f"--layers={layers}")
        self.process = subprocess.Popen([binary] + flags + list(extra), stdout=self.log,
                                        stderr=subprocess.STDOUT)
        print(f"started attngrad-server {' '.join(flags[2:])} at {self.target} "
              f"(log {self.log.name})", flush=True)

    def wait(self, timeout: float = 600.0):
        client = attngrad.Client(self.target, timeout=60, channels=1)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"attngrad-server exited with {self.process.returncode}:\n"
                                     + Path(self.log.name).read_text()[-4000:])
                try:
                    return client.wait_until_serving(timeout=2.0)
                except attngrad.AttngradError:
                    time.sleep(0.2)
            raise SystemExit(f"attngrad-server at {self.target} did not become SERVING")
        finally:
            client.close()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def loss_of(model, input_ids):
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def compare_gradients(local, remote, atol_scale: float):
    """[(name, relative L2 error, matched fraction, misses, passes)] for every parameter."""
    rows = []
    remote_parameters = dict(remote.named_parameters())
    for name, parameter in local.named_parameters():
        reference = parameter.grad
        other = remote_parameters[name].grad
        if reference is None and other is None:
            continue
        if reference is None or other is None:
            rows.append((name, math.inf, 0.0, -1, False))
            continue
        reference, other = reference.double(), other.double()
        relative = float((other - reference).norm() / reference.norm().clamp_min(1e-300))
        atol = atol_scale * float(reference.abs().max())
        ok = (other - reference).abs() <= atol + 1e-3 * reference.abs()
        misses = int((~ok).sum())
        fraction = float(ok.double().mean())
        norm_weight = name.endswith("norm.weight") and reference.dim() == 1
        passes = bool(torch.isfinite(other).all()) and (
            misses <= 1 if norm_weight else fraction >= 0.99)
        rows.append((name, relative, fraction, misses, passes))
    return rows


def run_layout(args, base_model, directory: Path, layout: str, device):
    """One layout ("one server" / "two servers"): the gradient check and the training run."""
    layers = base_model.config.num_hidden_layers
    servers = []
    try:
        if layout == "one server":
            servers.append(Server(args.server, directory, args.devices))
        else:
            half = layers // 2
            servers.append(Server(args.server, directory, args.devices, f"0-{half - 1}"))
            servers.append(Server(args.server, directory, args.devices2 or args.devices,
                                  f"{half}-{layers - 1}"))
        for server in servers:
            server.wait()
        if layout == "one server":
            target = servers[0].target
        else:
            target = f"0-{layers // 2 - 1}={servers[0].target},{layers // 2}-{layers - 1}=" \
                     f"{servers[1].target}"
        print(f"\n## {layout}: {target}", flush=True)
        generator = torch.Generator().manual_seed(args.seed + 1)
        input_ids = torch.randint(0, base_model.config.vocab_size, (args.batch, args.seq_len),
                                  generator=generator).to(device)

        # 1. One step's gradients, the servers holding the checkpoint's weights as read from DIR.
        local, remote = copy.deepcopy(base_model), copy.deepcopy(base_model)
        handle = attngrad_torch.offload(remote, target, mode=args.mode, precision=args.precision,
                                        upload_weights=False, timeout=args.timeout)
        started = time.perf_counter()
        local_loss = loss_of(local, input_ids)
        local_loss.backward()
        local_seconds = time.perf_counter() - started
        started = time.perf_counter()
        remote_loss = loss_of(remote, input_ids)
        remote_loss.backward()
        if args.mode == "accumulate":
            handle.fetch_gradients()
        remote_seconds = time.perf_counter() - started
        handle.remove()
        rows = compare_gradients(local, remote, args.atol_scale)
        forward_same = torch.equal(local_loss.detach(), remote_loss.detach())
        worst = sorted(rows, key=lambda row: -row[1])[:8]
        failed = [row for row in rows if not row[4]]
        print(f"loss local {local_loss.item():.6f}, offloaded {remote_loss.item():.6f} "
              f"(forward {'identical' if forward_same else 'DIFFERENT'}); step wall time local "
              f"{local_seconds:.2f} s, offloaded {remote_seconds:.2f} s")
        print(f"gradients of {len(rows)} parameters: {len(rows) - len(failed)} pass "
              f"(atol {args.atol_scale:g}*max|ref| + 1e-3*|ref|, >= 99%); worst relative L2:")
        for name, relative, fraction, misses, passes in worst:
            print(f"  {name:60s} rel {relative:.2e}  matched {fraction:.5f}  misses {misses}"
                  f"  {'ok' if passes else 'FAIL'}")
        gradient_ok = not failed and forward_same

        # 2. Training: the same batch each step, weights uploaded after every optimizer step.
        local, remote = copy.deepcopy(base_model), copy.deepcopy(base_model)
        handle = attngrad_torch.offload(remote, target, mode=args.mode, precision=args.precision,
                                        timeout=args.timeout)
        optimizers = [make_optimizer(args, model) for model in (local, remote)]
        curve = []
        try:
            for step in range(args.steps):
                losses = []
                for model, optimizer in zip((local, remote), optimizers):
                    optimizer.zero_grad(set_to_none=True)
                    loss = loss_of(model, input_ids)
                    loss.backward()
                    if model is remote and args.mode == "accumulate":
                        handle.fetch_gradients()
                    optimizer.step()
                    losses.append(loss.item())
                relative = abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-30)
                curve.append((step, losses[0], losses[1], relative))
                print(f"  step {step:2d}: loss local {losses[0]:.6f} offloaded {losses[1]:.6f} "
                      f"rel {relative:.2e}", flush=True)
        finally:
            handle.remove()
        curve_ok = all(row[3] <= args.loss_rtol for row in curve)
        return dict(layout=layout, target=target, gradient_ok=gradient_ok, curve_ok=curve_ok,
                    worst=worst[0] if worst else None, failed=len(failed), parameters=len(rows),
                    first=curve[0] if curve else None, last=curve[-1] if curve else None,
                    max_rel=max((row[3] for row in curve), default=0.0),
                    seconds=(local_seconds, remote_seconds))
    finally:
        for server in servers:
            server.stop()


def make_optimizer(args, model):
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the attngrad-server binary")
    parser.add_argument("--devices", default="0", help="--devices of the servers (0, 0,1, cpu)")
    parser.add_argument("--devices2", default="", help="--devices of the second server of the split"
                        " layout (default: --devices)")
    parser.add_argument("--config", choices=sorted(PRESETS), default="270m")
    parser.add_argument("--num-layers", type=int, default=0, help="override num_hidden_layers")
    parser.add_argument("--vocab", type=int, default=0,
                        help="override vocab_size (smaller = faster)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=("return", "accumulate"), default="return")
    parser.add_argument("--precision", default="fp32",
                        help="the servers' precision (fp32, auto, ...)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--loss-rtol", type=float, default=1e-3)
    parser.add_argument("--atol-scale", type=float, default=1e-3,
                        help="gradient check: atol = this * max|reference| of each parameter")
    parser.add_argument("--attention", default="eager", help="transformers attn_implementation")
    parser.add_argument("--shard-size", default="",
                        help="save_pretrained max_shard_size (default: a quarter of the model)")
    parser.add_argument("--layouts", default="one,two", help="one, two or one,two")
    parser.add_argument("--workdir", default="",
                        help="where to write the checkpoint (default: tmp)")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the local and the offloaded model run")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    model = build_model(args, device)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"Gemma-3 {args.config}: {model.config.num_hidden_layers} layers, hidden "
          f"{model.config.hidden_size}, vocab {model.config.vocab_size}, {parameters / 1e6:.1f} M "
          f"parameters, fp32, on {device}; batch {args.batch}x{args.seq_len}, mode {args.mode}, "
          f"precision {args.precision}", flush=True)
    with tempfile.TemporaryDirectory(prefix="attngrad-gemma3-", dir=args.workdir or None) as work:
        directory = Path(work) / "checkpoint"
        shard = args.shard_size or f"{max(1, parameters * 4 // 4 // 1_000_000)}MB"
        write_checkpoint(model.cpu(), directory, shard)
        model.to(device)
        json.loads((directory / "config.json").read_text())  # written and readable
        results = []
        for layout in args.layouts.split(","):
            name = {"one": "one server", "two": "two servers"}[layout.strip()]
            results.append(run_layout(args, model, directory, name, device))

    print("\n| layout | step gradients | worst relative L2 | loss curve (%d steps) | max rel | "
          "first / last loss | step wall local / offloaded |" % args.steps)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for r in results:
        worst = f"{r['worst'][1]:.1e} ({r['worst'][0]})" if r["worst"] else "-"
        first_last = (f"{r['first'][1]:.4f} / {r['last'][1]:.4f}" if r["first"] else "-")
        print(f"| {r['layout']} | {r['parameters'] - r['failed']}/{r['parameters']} "
              f"{'PASS' if r['gradient_ok'] else 'FAIL'} | {worst} | "
              f"{'PASS' if r['curve_ok'] else 'FAIL'} | {r['max_rel']:.1e} | {first_last} | "
              f"{r['seconds'][0]:.2f} s / {r['seconds'][1]:.2f} s |")
        ok = ok and r["gradient_ok"] and r["curve_ok"]
    print("\nRESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
