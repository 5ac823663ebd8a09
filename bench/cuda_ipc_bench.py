"""The service over CUDA IPC: a trainer process with PyTorch on the server's GPU
registers its CUDA tensors (attngrad.Client's zero_copy path, cuda_regions.py) and streams batches
that name them, so that no activation byte crosses the connection.

  throughput: B x S ACCUMULATE batches over STREAMS Backward streams with IN_FLIGHT batches
              outstanding on each (--configs), for DURATION seconds after a warm-up: tokens/s. The
              inputs are drawn once; each in-flight slot has its own answer tensor.
  shm:        the same over host shared memory (the other same-host path): each stream's inputs
              and answer slots in one POSIX shared-memory region registered with the server
              (RegisterRegion by name), batches naming them; no torch tensors involved.
  latency:    one B x S batch at a time (RETURN: the weight gradients come back on the wire;
              ACCUMULATE: nothing but the response): the p50/p90 round trip of COUNT batches.
  bridge:     attngrad.torch's RemoteGemma3Attention (zero_copy=True, ACCUMULATE), one B x S
              backward in a loop: p50 wall time of loss.backward(); bridge_tcp: the same with
              zero_copy=False (the tensors' bytes over the connection). With --phases, also the
              median seconds of each client-side phase of the backward (Client(phase_timings=True):
              prepare, register, synchronize, encode, send, wait, decode) and the CUDA IPC regions
              the client holds at the end.

Prints one line per measurement (and JSON with --json). Run against a server on the same GPU:
  attngrad-server --devices=0 --listen=127.0.0.1:50051 &
  python3 bench/cuda_ipc_bench.py --target=127.0.0.1:50051
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client", "python"))

try:
    import torch  # noqa: E402
except ImportError:  # the shm mode needs no torch
    torch = None

import attngrad  # noqa: E402
from attngrad import client as client_module  # noqa: E402

pb = client_module.pb


class Trainer:
    """The registered tensors of one run: inputs once, an answer tensor per in-flight slot."""

    def __init__(self, client, batch, seq_len, hidden, slots, device, seed=1,
                 weights_region=True):
        self.weights_region = weights_region
        generator = torch.Generator(device=device).manual_seed(seed)
        shape = (batch, seq_len, hidden)
        self.batch, self.seq_len, self.hidden = batch, seq_len, hidden
        self.hidden_states = torch.randn(shape, generator=generator, device=device)
        self.grad_output = torch.randn(shape, generator=generator, device=device) * 0.01
        self.answers = [torch.empty(shape, device=device) for _ in range(slots)]
        cache = client._cuda_region_cache()
        self.hidden_slice = cache.slice_of(self.hidden_states)
        self.grad_slice = cache.slice_of(self.grad_output)
        self.answer_slices = [cache.slice_of(answer) for answer in self.answers]
        # RETURN: the six weight gradients (fp32, packed) into this process's memory as well.
        shapes = client_module._weight_shapes(client.info())
        self.weights = torch.empty(sum(int(torch.tensor(s).prod()) for s in shapes), device=device)
        self.weights_slice = cache.slice_of(self.weights)
        torch.cuda.synchronize(device)

    def request(self, batch_id, mode, slot):
        message = pb.BackwardRequest(batch_id=batch_id, mode=mode)
        for tensor in (message.hidden_states, message.grad_output):
            tensor.dtype = client_module.tensor_pb2.DTYPE_FLOAT32
            tensor.shape.extend([self.batch, self.seq_len, self.hidden])
        message.positions.position_ids.extend(range(self.seq_len))
        for field, (region, offset, size) in (("hidden_states_region", self.hidden_slice),
                                              ("grad_output_region", self.grad_slice),
                                              ("grad_hidden_states_region",
                                               self.answer_slices[slot])):
            getattr(message, field).CopyFrom(
                pb.RegionSlice(region_id=region, offset=offset, byte_size=size))
        if mode == pb.GRADIENT_MODE_RETURN and self.weights_region:
            region, offset, size = self.weights_slice
            message.weight_gradients_region.CopyFrom(
                pb.RegionSlice(region_id=region, offset=offset, byte_size=size))
        return message.SerializeToString()


class HostTrainer(Trainer):
    """Trainer's requests over a shared-memory region of this process: [hidden_states |
    grad_output | one answer per in-flight slot], fp32, a sealed memfd registered over the region
    socket (the server copies the inputs from it into its page-locked staging and the answers into
    it)."""

    def __init__(self, client, batch, seq_len, hidden, slots, seed=1):
        import numpy as np
        from attngrad import SealedMemory

        self.weights_region = False
        self.batch, self.seq_len, self.hidden = batch, seq_len, hidden
        tensor_bytes = batch * seq_len * hidden * 4
        self.memory = SealedMemory(tensor_bytes * (2 + slots))
        rng = np.random.default_rng(seed)
        floats = np.ndarray((2 + slots, batch * seq_len * hidden), dtype=np.float32,
                            buffer=self.memory.buf)
        floats[0] = rng.standard_normal(floats.shape[1], dtype=np.float32)
        floats[1] = rng.standard_normal(floats.shape[1], dtype=np.float32) * 0.01
        del floats  # no view may outlive close()
        self.client = client
        self.region = client.register_region(self.memory, self.memory.size)
        self.hidden_slice = (self.region, 0, tensor_bytes)
        self.grad_slice = (self.region, tensor_bytes, tensor_bytes)
        self.answer_slices = [(self.region, (2 + slot) * tensor_bytes, tensor_bytes)
                              for slot in range(slots)]

    def close(self):
        try:
            self.client.unregister_region(self.region)
        finally:
            self.memory.close()


def backward_call(client):
    return client._channel.stream_stream(
        "/attngrad.v1.AttentionGradient/Backward", request_serializer=lambda raw: raw,
        response_deserializer=pb.BackwardResponse.FromString)


def throughput(args, client, hidden, device, streams, in_flight, shared_memory=False):
    if shared_memory:
        trainers = [HostTrainer(client, args.batch, args.seq_len, hidden, in_flight, seed=s)
                    for s in range(streams)]
    else:
        trainers = [Trainer(client, args.batch, args.seq_len, hidden, in_flight, device, seed=s)
                    for s in range(streams)]
    ids = iter(range(1, 1 << 62))
    lock = threading.Lock()
    done = {"batches": 0, "errors": 0, "compute": []}
    measuring = threading.Event()
    stop = threading.Event()

    def lane(trainer, index):
        window = threading.Semaphore(in_flight)
        channel_client = attngrad.Client(args.target, client_id=client_id_of(args),
                                         timeout=0) if index else client

        def requests():
            slot = 0
            while not stop.is_set():
                window.acquire()
                with lock:
                    batch_id = next(ids)
                yield trainer.request(batch_id, pb.GRADIENT_MODE_ACCUMULATE, slot)
                slot = (slot + 1) % in_flight

        for response in backward_call(channel_client)(requests()):
            window.release()
            if measuring.is_set():
                with lock:
                    done["batches"] += 1
                    done["errors"] += int(response.error.code != 0)
                    done["compute"].append(response.timings.compute_seconds)
            if response.error.code != 0 and done["errors"] < 3:
                print("error:", response.error.message, file=sys.stderr)
        if index:
            channel_client.close()

    # Regions belong to a client id: every lane's client uses the same one.
    threads = [threading.Thread(target=lane, args=(t, i), daemon=True)
               for i, t in enumerate(trainers)]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup)
    measuring.set()
    start = time.perf_counter()
    time.sleep(args.duration)
    measuring.clear()
    elapsed = time.perf_counter() - start
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    for trainer in trainers:
        if shared_memory:
            trainer.close()
    tokens = done["batches"] * args.batch * args.seq_len
    compute = statistics.median(done["compute"]) if done["compute"] else float("nan")
    path = "host shared memory" if shared_memory else "CUDA IPC"
    return {"what": f"ACCUMULATE {args.batch}x{args.seq_len} over {path}",
            "streams": streams, "in_flight": in_flight, "seconds": elapsed,
            "batches": done["batches"], "errors": done["errors"],
            "tokens_per_second": tokens / elapsed, "server_compute_p50_ms": compute * 1e3}


def latency(args, client, hidden, device, mode, batch, seq_len, label, weights_region):
    trainer = Trainer(client, batch, seq_len, hidden, 1, device, weights_region=weights_region)
    call = backward_call(client)
    box = {"next": None}
    ready = threading.Semaphore(0)
    times = []

    def requests():
        while True:
            ready.acquire()
            if box["next"] is None:
                return
            yield box["next"]

    responses = call(requests())
    errors = 0
    for index in range(args.count + 5):
        box["next"] = trainer.request(index + 1 + (1 << 40), mode, 0)
        start = time.perf_counter()
        ready.release()
        response = next(responses)
        elapsed = time.perf_counter() - start
        errors += int(response.error.code != 0)
        if response.error.code != 0 and errors < 3:
            print("error:", response.error.message, file=sys.stderr)
        if index >= 5:
            times.append(elapsed)
    box["next"] = None
    ready.release()
    for _ in responses:
        pass
    times.sort()
    return {"what": label, "count": len(times), "errors": errors,
            "p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3}


def bridge(args, client, device, zero_copy):
    import attngrad.torch as bridge_module

    layer = bridge_module.RemoteGemma3Attention(client, mode="accumulate", device=device,
                                                zero_copy=zero_copy)
    layer.sync_weights()
    info = client.info()
    hidden = torch.randn(1, args.bridge_seq_len, info.hidden_size, device=device,
                         requires_grad=True)
    positions = torch.arange(args.bridge_seq_len, device=device)
    cos, sin = bridge_module.rotary_tables(positions, info.head_dim)
    times = []
    phases = {}
    for index in range(args.count + 5):
        out = layer(hidden, cos, sin)
        loss = out.float().square().mean()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        hidden.grad = None
        if index >= 5:
            times.append(elapsed)
            measured = getattr(layer.last_result, "client_phases", None) or {}
            for name, seconds in measured.items():
                phases.setdefault(name, []).append(seconds)
    times.sort()
    result = {"what": f"attngrad.torch zero_copy={zero_copy} ACCUMULATE 1x{args.bridge_seq_len} "
                      "loss.backward()", "count": len(times),
              "p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3}
    if args.phases:
        result["client_phases_p50_ms"] = {name: round(statistics.median(values) * 1e3, 3)
                                          for name, values in phases.items()}
        regions = getattr(client, "_cuda_regions", None)
        result["cuda_regions"] = len(regions) if regions is not None else 0
    return result


def client_id_of(args):
    return args.client_id


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--client_id", default="cuda-ipc-bench")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--configs", default="2x3,4x2",
                        help="throughput runs: STREAMSxIN_FLIGHT, comma-separated")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--count", type=int, default=100, help="latency / bridge iterations")
    parser.add_argument("--bridge_seq_len", type=int, default=1024)
    parser.add_argument("--only", default="throughput,latency,bridge",
                        help="bridge: over CUDA IPC (zero_copy=True); bridge_tcp: the bytes path; "
                             "shm: throughput over host shared-memory regions (--configs)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--phases", action="store_true",
                        help="bridge: the client's phase timings (Client(phase_timings=True)) and "
                             "its CUDA IPC regions")
    args = parser.parse_args()
    if torch is None and set(args.only.split(",")) - {"shm"}:
        parser.error("torch is needed for everything but --only=shm")
    device = torch.device("cuda", 0) if torch is not None else None
    options = {"phase_timings": True} if args.phases else {}
    client = attngrad.Client(args.target, client_id=args.client_id, timeout=0, **options)
    info = client.wait_until_serving(60)
    results = []
    parts = args.only.split(",")
    if "throughput" in parts:
        for config in args.configs.split(","):
            streams, in_flight = (int(v) for v in config.split("x"))
            results.append(throughput(args, client, info.hidden_size, device, streams, in_flight))
            print(json.dumps(results[-1]), flush=True)
    if "shm" in parts:
        for config in args.configs.split(","):
            streams, in_flight = (int(v) for v in config.split("x"))
            results.append(throughput(args, client, info.hidden_size, device, streams, in_flight,
                                      shared_memory=True))
            print(json.dumps(results[-1]), flush=True)
    if "latency" in parts:
        for mode, name, weights_region in (
                (pb.GRADIENT_MODE_RETURN, "RETURN (weight gradients into a CUDA IPC region)", True),
                (pb.GRADIENT_MODE_RETURN, "RETURN (weight gradients on the wire)", False),
                (pb.GRADIENT_MODE_ACCUMULATE, "ACCUMULATE", True)):
            results.append(latency(args, client, info.hidden_size, device, mode, 1, 128,
                                   f"{name} 1x128 over CUDA IPC, one in flight", weights_region))
            print(json.dumps(results[-1]), flush=True)
    for part, zero_copy in (("bridge", True), ("bridge_tcp", False)):
        if part not in parts:
            continue
        client.zero_gradients()
        results.append(bridge(args, client, device, zero_copy))
        print(json.dumps(results[-1]), flush=True)
    client.close()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
