#!/usr/bin/env python3
"""A few optimizer steps of a tiny language model whose Gemma-3 attention layer's backward runs on
an attngrad server; prints the loss going down (exit status 1 if it did not).

The model: token embedding [vocab, 3072] -> x + RemoteGemma3Attention(x) -> RMSNorm -> linear head.
The task: predict the token one position back (only attention can see it), on a fixed batch of
random tokens (so the loss goes down step after step).

    # against a running server
    python3 client/python/examples/train_step.py --target localhost:50051
    # or start one (CPU backend here; on a GPU box leave --devices to use the GPUs)
    python3 client/python/examples/train_step.py --server build/server/attngrad-server --devices=cpu

Needs PyTorch, grpcio and numpy (PYTHONPATH=client/python, or pip install client/python).
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# client/python, when run from the repo
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import attngrad  # noqa: E402
import attngrad.torch as attngrad_torch  # noqa: E402


class TinyModel(nn.Module):
    def __init__(self, client, vocab: int, mode: str, precision: str):
        super().__init__()
        self.attention = attngrad_torch.RemoteGemma3Attention(client, mode=mode,
                                                              precision=precision)
        hidden = self.attention.config.hidden_size
        self.embed = nn.Embedding(vocab, hidden)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        cos, sin = attngrad_torch.rotary_tables(positions, self.attention.config.head_dim)
        x = x + self.attention(x, cos, sin)
        return self.head(self.norm(x))


def start_server(binary: str, devices: str):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = f"127.0.0.1:{port}"
    process = subprocess.Popen([binary, f"--listen={target}", "--metrics_listen=",
                                f"--devices={devices}", "--weights=random"])
    return target, process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", default=os.environ.get("ATTNGRAD_TARGET", "localhost:50051"))
    where.add_argument("--server", help="start this attngrad-server binary on a free loopback port")
    parser.add_argument("--devices", default="",
                        help="--devices of the started server (cpu, 0,1, ...)")
    parser.add_argument("--mode", choices=("return", "accumulate"), default="accumulate")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    process = None
    target = args.target
    if args.server:
        target, process = start_server(args.server, args.devices)
    try:
        client = attngrad.Client(target)
        info = client.wait_until_serving(timeout=120)
        print(f"server {target}: {info.server_version or 'attngrad'} on "
              f"{', '.join(d.name for d in info.devices)}; mode={args.mode}")
        torch.manual_seed(0)
        model = TinyModel(client, args.vocab, args.mode, args.precision).to(args.device)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len),
                               generator=generator).to(args.device)
        losses = []
        for step in range(args.steps):
            started = time.perf_counter()
            logits = model(tokens)
            # position i predicts token i-1 (position 0 has nothing to copy)
            loss = nn.functional.cross_entropy(logits[:, 1:].reshape(-1, args.vocab),
                                               tokens[:, :-1].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()                      # the attention layer's backward: on the server
            if args.mode == "accumulate":
                model.attention.fetch_gradients()  # the server's sums -> .grad
            optimizer.step()                     # next forward uploads the new attention weights
            elapsed = time.perf_counter() - started
            server = model.attention.last_result
            compute = sum(t.compute for t in server.timings)
            losses.append(loss.item())
            print(f"step {step}: loss {loss.item():.4f}  ({elapsed * 1e3:.0f} ms, server compute "
                  f"{compute * 1e3:.1f} ms on {server.devices[0]}, weights "
                  f"v{server.weights_version})")
        went_down = losses[-1] < losses[0] and math.isfinite(losses[-1])
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: "
              f"{'went down' if went_down else 'DID NOT go down'}")
        client.close()
        return 0 if went_down else 1
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
