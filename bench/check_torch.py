#!/usr/bin/env python3
"""Checks and times libattngrad.so on a GPU machine with PyTorch.

1. Correctness (SPEC section 4): for each of the 16 SPEC workloads and each of --rounds rounds of
   fresh random inputs (SPEC section 3), every one of the 7 outputs of attngrad_backward, in each
   precision mode of --modes, against a float64 PyTorch autograd evaluation of SPEC section 2 on the
   same inputs: >= 99% of elements within atol + 1e-3 |ref| (at most one miss for each 128-element
   norm-weight gradient), no NaN/Inf anywhere. With --grad-output-scale F, attngrad gets
   F * grad_output and its outputs, divided by F, are checked against the reference for grad_output
   (every output is linear in it): real gradients are far smaller than SPEC section 3's randn
   (e.g. F = 1e-7).
2. Timing (SPEC section 5): attngrad (AUTO unless --time-mode), PyTorch eager fp32, eager TF32 and
   torch.compile TF32 — each one whole backward (forward recomputation + backward from the fp32
   inputs), L2 flushed by writing a 2x-L2 buffer before every iteration, warm-up then timed
   iterations, CUDA events, median; geometric means over the workloads.

Usage: python3 bench/check_torch.py [--lib build-gpu/kernels/libattngrad.so] [--rounds 10]
          [--modes AUTO,FP16,TF32,FP32] [--mode-rounds FP32=3,TF32=3] [--workloads 1:128,2:541]
          [--grad-output-scale 1e-7] [--no-check] [--no-time]
          [--torch eager32,eager_tf32,compile_tf32] [--torch-iters 50]
"""
import argparse
import ctypes
import math
import os
import sys
import time

import torch

H, NQ, NKV, D = 3072, 24, 8, 128
SCALING, CAP, EPS = 1.0 / math.sqrt(128.0), 50.0, 1e-6
WORKLOADS = [(1, 128), (1, 256), (1, 512), (1, 2048), (2, 512), (2, 541), (2, 1024), (2, 2048),
             (4, 128), (4, 256), (4, 1024), (8, 128), (8, 512), (16, 256), (32, 128), (64, 256)]
ATOL = {(1, 128): .0067, (1, 256): .0070, (1, 512): .0086, (1, 2048): .0071, (2, 512): .0084,
        (2, 541): .0079, (2, 1024): .0069, (2, 2048): .0073, (4, 128): .0081, (4, 256): .0077,
        (4, 1024): .0083, (8, 128): .0091, (8, 512): .0089, (16, 256): .0092, (32, 128): .0091,
        (64, 256): .0099}
MODES = {"AUTO": 0, "FP32": 1, "TF32": 2, "FP16": 3}
OUTPUTS = ["grad_hidden_states", "grad_q_weight", "grad_k_weight", "grad_v_weight",
           "grad_o_weight", "grad_q_norm_weight", "grad_k_norm_weight"]


def load_library(path):
    lib = ctypes.CDLL(path)
    lib.attngrad_workspace_size.restype = ctypes.c_size_t
    lib.attngrad_workspace_size.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.attngrad_backward.restype = ctypes.c_int
    lib.attngrad_backward.argtypes = ([ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                                       ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                      + [ctypes.c_void_p] * 17
                                      + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    lib.attngrad_status_string.restype = ctypes.c_char_p
    lib.attngrad_device_count.restype = ctypes.c_int
    return lib


def rotary(batch, seq, device):
    inv_freq = 10000.0 ** (-torch.arange(0, 64, dtype=torch.float64, device=device) * 2 / 128)
    angles = torch.arange(seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos = emb.cos().float()[None].expand(batch, seq, D).contiguous()
    sin = emb.sin().float()[None].expand(batch, seq, D).contiguous()
    return cos, sin


def draw_inputs(batch, seq, generator, device="cuda"):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)
    w = math.sqrt(2.0 / 3072.0)
    cos, sin = rotary(batch, seq, device)
    return dict(grad_output=randn(batch, seq, H),
                hidden_states=randn(batch, seq, H) / math.sqrt(3072.0),
                cos=cos, sin=sin, q_weight=randn(NQ * D, H) * w, k_weight=randn(NKV * D, H) * w,
                v_weight=randn(NKV * D, H) * w, o_weight=randn(H, NQ * D) * w,
                q_norm_weight=randn(D) * 0.02, k_norm_weight=randn(D) * 0.02)


def layer_forward(x, cos, sin, wq, wk, wv, wo, qnw, knw, eps=EPS, scaling=SCALING, cap=CAP):
    """SPEC section 2 forward (any dtype): returns the layer output A Wo^T."""
    b, s, _ = x.shape
    q = (x @ wq.t()).view(b, s, NQ, D)
    k = (x @ wk.t()).view(b, s, NKV, D)
    v = (x @ wv.t()).view(b, s, NKV, D)

    def norm(t, w):
        r = torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return t * r * (1 + w)

    def rope(t):
        c, sn = cos[:, :, None, :], sin[:, :, None, :]
        rot = torch.cat([-t[..., 64:], t[..., :64]], dim=-1)
        return t * c + rot * sn

    q = rope(norm(q, qnw)).transpose(1, 2)                    # [b, NQ, s, D]
    k = rope(norm(k, knw)).transpose(1, 2).repeat_interleave(NQ // NKV, dim=1)
    v = v.transpose(1, 2).repeat_interleave(NQ // NKV, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    capped = cap * torch.tanh(scores / cap)
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    capped = capped.masked_fill(mask, float("-inf"))
    p = torch.softmax(capped, dim=-1)
    a = (p @ v).transpose(1, 2).reshape(b, s, NQ * D)
    return a @ wo.t()


def reference_float64(inputs):
    names = ["hidden_states", "q_weight", "k_weight", "v_weight", "o_weight", "q_norm_weight",
             "k_norm_weight"]
    leaves = {n: inputs[n].double().requires_grad_(True) for n in names}
    y = layer_forward(leaves["hidden_states"], inputs["cos"].double(), inputs["sin"].double(),
                      leaves["q_weight"], leaves["k_weight"], leaves["v_weight"],
                      leaves["o_weight"], leaves["q_norm_weight"], leaves["k_norm_weight"])
    grads = torch.autograd.grad(y, [leaves[n] for n in names],
                                grad_outputs=inputs["grad_output"].double())
    return grads  # same order as OUTPUTS


def run_attngrad(lib, inputs, outputs, precision, workspace, accumulate=0):
    b, s, _ = inputs["hidden_states"].shape
    order_in = ["grad_output", "hidden_states", "cos", "sin", "q_weight", "k_weight", "v_weight",
                "o_weight", "q_norm_weight", "k_norm_weight"]
    args = ([b, s, SCALING, CAP, EPS, precision, accumulate]
            + [inputs[n].data_ptr() for n in order_in] + [o.data_ptr() for o in outputs]
            + [workspace.data_ptr(), workspace.numel(), torch.cuda.current_stream().cuda_stream])
    status = lib.attngrad_backward(*args)
    if status != 0:
        raise RuntimeError("attngrad_backward: " + lib.attngrad_status_string(status).decode())


def new_outputs(inputs):
    x = inputs["hidden_states"]
    shapes = [x.shape, inputs["q_weight"].shape, inputs["k_weight"].shape, inputs["v_weight"].shape,
              inputs["o_weight"].shape, (D,), (D,)]
    return [torch.full(sh, float("nan"), device="cuda", dtype=torch.float32) for sh in shapes]


def check_outputs(outputs, reference, atol):
    """Returns (ok, per-output misses, worst fraction matching)."""
    ok, misses = True, []
    worst_fraction = 1.0
    for out, ref in zip(outputs, reference):
        out64 = out.double()
        finite = bool(torch.isfinite(out64).all())
        miss = int(((out64 - ref).abs() > atol + 1e-3 * ref.abs()).sum()) if finite else out.numel()
        allowed = 1 if out.numel() == D else out.numel() // 100
        ok = ok and finite and miss <= allowed
        misses.append(miss)
        worst_fraction = min(worst_fraction, 1.0 - miss / out.numel())
    return ok, misses, worst_fraction


def median_time_us(fn, flush, warmup, iters):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + iters):
        flush.fill_(i & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    n = len(times)
    return times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])


def sol_us(b, s):
    tokens = b * s
    macs = tokens * 66060288 + b * s * s * 18432
    weights = 2 * H * NQ * D + 2 * NKV * D * H
    elements = tokens * H * 3 + tokens * D * 2 + 2 * weights + 4 * D
    return max(macs / 494.7e12, elements * 2 / 4.8e12) * 1e6


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", default=os.path.join(os.path.dirname(__file__), "..", "build-gpu",
                                                      "kernels", "libattngrad.so"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--modes", default="AUTO,FP16,TF32,FP32")
    parser.add_argument("--mode-rounds", default="",
                        help="e.g. FP32=3,TF32=3: fewer rounds for a mode")
    parser.add_argument("--workloads", default="")
    parser.add_argument("--grad-output-scale", type=float, default=1.0)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--time-mode", default="AUTO")
    parser.add_argument("--torch", default="eager32,eager_tf32,compile_tf32")
    parser.add_argument("--torch-warmup", type=int, default=10)
    parser.add_argument("--torch-iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()

    lib = load_library(os.path.abspath(args.lib))
    if lib.attngrad_device_count() < 1:
        print("no CUDA device visible to attngrad")
        return 1
    workloads = WORKLOADS
    if args.workloads:
        workloads = [tuple(int(v) for v in item.split(":")) for item in args.workloads.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    mode_rounds = {m: args.rounds for m in modes}
    for item in filter(None, args.mode_rounds.split(",")):
        name, count = item.split("=")
        mode_rounds[name] = int(count)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, torch {torch.__version__}, lib {args.lib}", flush=True)
    generator = torch.Generator(device="cuda")
    generator.manual_seed(args.seed)
    all_ok = True

    if not args.no_check:
        print("\n== correctness (SPEC section 4): worst fraction of matching elements over rounds; "
              f"max misses of the norm-weight grads; grad_output x {args.grad_output_scale:g} ==",
              flush=True)
        summary = {}
        t0 = time.time()
        for (b, s) in workloads:
            ws_bytes = max(lib.attngrad_workspace_size(b, s, MODES[m]) for m in modes)
            workspace = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
            rows = {m: [True, 1.0, 0, 0] for m in modes}  # ok, worst fraction, norm misses, rounds
            for r in range(max(mode_rounds.values())):
                inputs = draw_inputs(b, s, generator)
                reference = reference_float64(inputs)
                for m in modes:
                    if r >= mode_rounds[m]:
                        continue
                    outputs = new_outputs(inputs)
                    factor = args.grad_output_scale
                    run_attngrad(lib, dict(inputs, grad_output=inputs["grad_output"] * factor),
                                 outputs, MODES[m], workspace)
                    if factor != 1.0:
                        outputs = [o / factor for o in outputs]
                    ok, misses, fraction = check_outputs(outputs, reference,
                                                         ATOL.get((b, s), .0067))
                    row = rows[m]
                    row[0] = row[0] and ok
                    row[1] = min(row[1], fraction)
                    row[2] = max(row[2], misses[5], misses[6])
                    row[3] += 1
                    if not ok:
                        print(f"  FAIL {m} B={b} S={s} round {r}: misses per output {misses}",
                              flush=True)
                del reference, inputs
            for m in modes:
                summary[(b, s, m)] = rows[m]
                all_ok = all_ok and rows[m][0]
            cells = "  ".join(f"{m}:{'pass' if rows[m][0] else 'FAIL'} {rows[m][1]*100:.4f}% "
                              f"nw{rows[m][2]} x{rows[m][3]}" for m in modes)
            print(f"  B={b:3d} S={s:5d}  {cells}", flush=True)
            del workspace
            torch.cuda.empty_cache()
        print(f"correctness: {'ALL PASS' if all_ok else 'SOME FAIL'} ({time.time() - t0:.0f} s)",
              flush=True)

    if not args.no_time:
        flush = torch.empty(2 * props.L2_cache_size, dtype=torch.uint8, device="cuda")
        variants = [v for v in args.torch.split(",") if v]
        compiled = (torch.compile(layer_forward, dynamic=True) if "compile_tf32" in variants
                    else None)
        print(f"\n== timing (SPEC section 5): median us; attngrad {args.time_mode} 10+50 "
              f"iterations; PyTorch {args.torch_warmup}+{args.torch_iters} ==", flush=True)
        header = f"{'B':>3} {'S':>5} {'sol':>8} {'attngrad':>9} {'x_sol':>6}" + "".join(
            f" {v:>13}" for v in variants)
        print(header, flush=True)
        table = {"sol": [], "attngrad": []}
        for v in variants:
            table[v] = []
        for (b, s) in workloads:
            inputs = draw_inputs(b, s, generator)
            precision = MODES[args.time_mode]
            workspace = torch.empty(lib.attngrad_workspace_size(b, s, precision), dtype=torch.uint8,
                                    device="cuda")
            outputs = new_outputs(inputs)
            ours = median_time_us(lambda: run_attngrad(lib, inputs, outputs, precision, workspace),
                                  flush, 10, 50)
            table["sol"].append(sol_us(b, s))
            table["attngrad"].append(ours)
            line = f"{b:3d} {s:5d} {sol_us(b, s):8.1f} {ours:9.1f} {ours / sol_us(b, s):6.2f}"
            del workspace, outputs
            names = ["hidden_states", "q_weight", "k_weight", "v_weight", "o_weight",
                     "q_norm_weight", "k_norm_weight"]
            leaves = [inputs[n].clone().requires_grad_(True) for n in names]
            for v in variants:
                torch.backends.cuda.matmul.allow_tf32 = v != "eager32"
                torch.backends.cudnn.allow_tf32 = v != "eager32"
                forward = compiled if v == "compile_tf32" else layer_forward

                def step():
                    y = forward(leaves[0], inputs["cos"], inputs["sin"], *leaves[1:])
                    torch.autograd.grad(y, leaves, grad_outputs=inputs["grad_output"])
                try:
                    t = median_time_us(step, flush, args.torch_warmup, args.torch_iters)
                except Exception as error:  # e.g. out of memory; report and go on
                    print(f"  {v} failed: {error}", file=sys.stderr)
                    t = float("nan")
                table[v].append(t)
                line += f" {t:13.1f}"
            torch.backends.cuda.matmul.allow_tf32 = False
            print(line, flush=True)
            del inputs, leaves
            torch.cuda.empty_cache()
        print("geomean      " + f"{geomean(table['sol']):8.1f} {geomean(table['attngrad']):9.1f} "
              f"{geomean(table['attngrad']) / geomean(table['sol']):6.2f}" + "".join(
                  " " + format(geomean([t for t in table[v] if t == t])
                               if any(t == t for t in table[v]) else float("nan"), "13.1f")
                  for v in variants), flush=True)
        for v in variants:
            good = [t for t in table[v] if t == t]
            if good:
                print(f"speed-up of attngrad over {v}: "
                      f"{geomean(good) / geomean(table['attngrad']):.2f}x")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
