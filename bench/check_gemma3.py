#!/usr/bin/env python3
"""Checks and times libattngrad.so's attngrad_backward_ex on the published Gemma-3 layers (GPU).

1. Correctness: for each model of proto/models/gemma3.json (not the "spec" entry) and each layer
   type (a local "sliding_attention" layer with the model's sliding window and rope_local_base_freq,
   a global "full_attention" one with rope_theta and the linear rope_scaling), Hugging Face
   transformers' own Gemma3Attention (eager, float64 autograd, built the way
   tests/fixtures/make_gemma3_fixtures.py builds it but at the model's full hidden size, with the
   model's causal / sliding-window mask) is the oracle for the gradients of
   L = sum(grad_output * layer_output) with respect to hidden_states and the six weights, on random
   inputs (SPEC section 3's distribution at the model's hidden size) with per-sequence positions.
   Every precision mode of --modes must pass SPEC section 4's rule: >= 99% of the elements of each
   of the 7 outputs within atol + 1e-3 |ref| (atol .0067; the two head_dim-element norm-weight
   gradients at most one miss), no NaN/Inf. A layer for which attngrad_workspace_size_ex answers 0
   (the GPU kernels do not compute it) is reported as such and skipped.
2. Timing (--time): attngrad (AUTO) on one local and one global layer of each computed model at
   B x S of --time-shapes: L2 flushed (2x L2 written) before every iteration, warm-up then timed
   iterations, CUDA events, median; the local layer's saving over the global one; and PyTorch eager
   TF32 (the same Gemma3Attention in fp32, forward + backward) where --torch is given, and the same
   module through torch.compile (TF32, static shapes: one compilation per model and (B, S), reused
   by both layer types, whose difference is the mask and the RoPE tables passed in) where
   --compile is given. With --timing-lock FILE, the compilation runs before the lock on FILE is
   taken and every timed section inside it, so that processes for different (model, shape) compile
   in parallel and time one at a time (bench/device/run.sh hd256:compile); --ready-dir and
   --ready-count make them wait until all have compiled before the first one times.

Usage: python3 bench/check_gemma3.py --lib build-h200/kernels/libattngrad.so
          [--shapes 1:1,2:7,1:1000,2:2500] [--modes AUTO,FP32,TF32,FP16] [--models gemma-3-27b]
          [--time] [--time-shapes 1:4096,4:1024] [--torch] [--compile]
"""
import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time

import torch

# The oracle is built the way the CI fixtures are (tests/fixtures/make_gemma3_fixtures.py: the
# config, the RoPE tables and the window mask), at the model's full size here.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "fixtures"))
import make_gemma3_fixtures as fixtures  # noqa: E402
from make_gemma3_fixtures import rope_tables, window_mask  # noqa: E402

MODELS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proto", "models",
                           "gemma3.json")
MODES = {"AUTO": 0, "FP32": 1, "TF32": 2, "FP16": 3}
ATOL = 0.0067
OUTPUTS = ["grad_hidden_states", "grad_q_weight", "grad_k_weight", "grad_v_weight",
           "grad_o_weight", "grad_q_norm_weight", "grad_k_norm_weight"]


class Layer(ctypes.Structure):
    _fields_ = [("hidden_size", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("scaling", ctypes.c_float), ("softcap", ctypes.c_float), ("eps", ctypes.c_float),
                ("sliding_window", ctypes.c_int)]


class Inputs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "grad_output", "hidden_states", "cos", "sin", "q_weight", "k_weight", "v_weight",
        "o_weight", "q_norm_weight", "k_norm_weight")]


class Outputs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in OUTPUTS]


def load_library(path):
    lib = ctypes.CDLL(path)
    lib.attngrad_workspace_size_ex.restype = ctypes.c_size_t
    lib.attngrad_workspace_size_ex.argtypes = [ctypes.POINTER(Layer), ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int]
    lib.attngrad_backward_ex.restype = ctypes.c_int
    lib.attngrad_backward_ex.argtypes = [ctypes.POINTER(Layer), ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int, ctypes.POINTER(Inputs),
                                         ctypes.POINTER(Outputs), ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p]
    lib.attngrad_status_string.restype = ctypes.c_char_p
    return lib


def hf_attention(model, layer_type, window, dtype):
    """transformers' Gemma3Attention at the model's full hidden size, on the GPU."""
    return fixtures.hf_attention(model, layer_type, window, model["hidden_size"], dtype, "cuda")


def load_weights(attention, weights):
    """Copies [wq, wk, wv, wo, q_norm, k_norm] into the module (in its dtype); its parameters."""
    params = (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight,
              attention.o_proj.weight, attention.q_norm.weight, attention.k_norm.weight)
    with torch.no_grad():
        for parameter, value in zip(params, weights):
            parameter.copy_(value)
    return params


class Case:
    """One layer (model, layer type) and its random inputs at (B, S), fp32 on the GPU."""

    def __init__(self, model, layer_type, batch, seq_len, generator):
        self.model, self.layer_type, self.batch, self.seq_len = model, layer_type, batch, seq_len
        local = layer_type == "sliding_attention"
        self.window = model["sliding_window"] if local else 0
        h, nq, nkv, d = (model["hidden_size"], model["num_attention_heads"],
                         model["num_key_value_heads"], model["head_dim"])

        def randn(*shape):
            return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32)

        scale = math.sqrt(2.0 / h)
        self.weights = [randn(nq * d, h) * scale, randn(nkv * d, h) * scale,
                        randn(nkv * d, h) * scale, randn(h, nq * d) * scale, randn(d) * 0.02,
                        randn(d) * 0.02]
        self.grad_output = randn(batch, seq_len, h)
        self.hidden_states = randn(batch, seq_len, h) / math.sqrt(h)
        start = torch.randint(0, 4000, (batch, 1), generator=generator, device="cuda")
        steps = torch.randint(1, 3, (batch, seq_len), generator=generator, device="cuda")
        positions = start + torch.cumsum(steps, dim=1)
        rule = model["rope_scaling"] or {}
        theta = model["rope_local_base_freq"] if local else model["rope_theta"]
        factor = 1.0 if local else float(rule.get("factor", 1.0))
        cos, sin = rope_tables(positions, d, theta, factor)
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self.scaling = model["query_pre_attn_scalar"] ** -0.5
        self.layer = Layer(h, nq, nkv, d, self.scaling,
                           float(model["attn_logit_softcapping"] or 0.0),
                           float(model["rms_norm_eps"]), self.window)

    def reference(self, dtype=torch.float64):
        """transformers' gradients [grad_x, grad_wq, grad_wk, grad_wv, grad_wo, grad_qn,
        grad_kn]."""
        attention = hf_attention(self.model, self.layer_type, self.window, dtype)
        params = load_weights(attention, self.weights)
        x = self.hidden_states.to(dtype).requires_grad_(True)
        output = attention(hidden_states=x,
                           position_embeddings=(self.cos.to(dtype), self.sin.to(dtype)),
                           attention_mask=window_mask(self.batch, self.seq_len, self.window, dtype,
                                                      "cuda"))
        y = output[0] if isinstance(output, tuple) else output
        y.backward(self.grad_output.to(dtype))
        grads = [x.grad] + [p.grad for p in params]
        del attention, output, y
        return [g.detach() for g in grads]

    def new_outputs(self):
        return [torch.zeros_like(self.hidden_states)] + [torch.zeros_like(w) for w in self.weights]

    def run(self, lib, precision, outputs, workspace):
        tensors = [self.grad_output, self.hidden_states, self.cos, self.sin] + self.weights
        inputs = Inputs(*[t.data_ptr() for t in tensors])
        outs = Outputs(*[t.data_ptr() for t in outputs])
        return lib.attngrad_backward_ex(ctypes.byref(self.layer), self.batch, self.seq_len,
                                        precision, 0, ctypes.byref(inputs), ctypes.byref(outs),
                                        workspace.data_ptr(), workspace.numel(),
                                        torch.cuda.current_stream().cuda_stream)


def check_outputs(outputs, reference):
    """SPEC section 4's rule; returns (passed, per-output fraction within tolerance)."""
    passed, fractions = True, []
    for out, ref in zip(outputs, reference):
        finite = bool(torch.isfinite(out).all())
        ref = ref.double()
        miss = (int(((out.double() - ref).abs() > ATOL + 1e-3 * ref.abs()).sum()) if finite
                else out.numel())
        allowed = 1 if out.dim() == 1 else out.numel() // 100
        passed &= finite and miss <= allowed
        fractions.append(1.0 - miss / out.numel())
    return passed, fractions


def parse_shapes(text):
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]


def layer_flops(model, batch, seq_len, window):
    """Useful FLOPs of one layer's backward (with its forward recomputation): the projection GEMMs
    (qkv, dA, dWo, dX, dWqkv: 2 T hidden (3 qkv_width + 2 q_width)) and the attention's 7 products
    (forward S and O, backward S, dP, dV, dK, dQ) over the visible (query, key) pairs only."""
    h, nq, nkv, d = (model["hidden_size"], model["num_attention_heads"],
                     model["num_key_value_heads"], model["head_dim"])
    tokens = batch * seq_len
    gemm = 2.0 * tokens * h * (3 * (nq + 2 * nkv) * d + 2 * nq * d)
    w = window if window else seq_len
    pairs = sum(min(i + 1, w) for i in range(seq_len))
    return gemm + 7 * 2.0 * batch * nq * pairs * d


def median_us(fn, flush, warmup, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + iters):
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


ATTENTION_KERNELS = ("AttentionForwardKernel", "KeyValueGradientKernel", "QueryGradientKernel",
                     "DeltaKernel", "SumPartialsKernel", "ShortSequenceBackwardKernel")


def attention_kernel_us(fn, calls=5):
    """Device time per call of the attention kernels and of all kernels (torch.profiler / CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    attention = total = 0.0
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None)
        if us is None:
            us = getattr(event, "cuda_time_total", 0.0)
        if getattr(event, "device_type", None) is not None and "CUDA" not in str(event.device_type):
            continue
        total += us
        if any(name in event.key for name in ATTENTION_KERNELS):
            attention += us
    return attention / calls, total / calls


class TimingLock:
    """An exclusive lock on a file (fcntl.flock), or nothing when path is empty: processes that
    compile in parallel take it around their timed sections, so that no two time at once."""

    def __init__(self, path):
        self.path, self.file = path, None

    def __enter__(self):
        if self.path:
            import fcntl
            self.file = open(self.path, "a")
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.file:
            self.file.close()  # releases the lock


def wait_for_all(directory, count, limit_seconds=240):
    """Marks this process ready in `directory` and waits until `count` processes are (a barrier:
    no process times while another still compiles and runs its first steps on the same GPU)."""
    if not directory:
        return
    open(os.path.join(directory, "ready.%d" % os.getpid()), "w").close()
    deadline = time.time() + limit_seconds
    while (len([f for f in os.listdir(directory) if f.startswith("ready.")]) < count
           and time.time() < deadline):
        time.sleep(0.5)


def time_layers(lib, name, model, batch, seq_len, generator, args):
    """[name, B, S, attngrad local µs, global µs, eager local, eager global, compiled local,
    compiled global] (nan where not asked), or None when the GPU kernels do not compute the layer.
    One module serves both layer types (their difference is the mask and the RoPE tables passed
    in); torch.compile compiles it for this (B, S) before the timing lock is taken."""
    layer_types = ("sliding_attention", "full_attention")
    cases = [Case(model, layer_type, batch, seq_len, generator) for layer_type in layer_types]
    cases[1].weights = cases[0].weights  # one set of weights: PyTorch's module holds one
    sizes = [lib.attngrad_workspace_size_ex(ctypes.byref(case.layer), batch, seq_len,
                                            MODES["AUTO"]) for case in cases]
    if 0 in sizes:
        print("%s B=%d S=%d: not computed by the GPU kernels" % (name, batch, seq_len))
        return None
    workspaces = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes]
    outputs = [case.new_outputs() for case in cases]
    attention = compiled = None
    steps = []
    if args.torch or args.compile:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        attention = hf_attention(model, cases[0].layer_type, cases[0].window, torch.float32)
        load_weights(attention, cases[0].weights)
        compiled = torch.compile(attention, dynamic=False) if args.compile else None
        for case in cases:
            mask = window_mask(batch, seq_len, case.window, torch.float32, "cuda")
            x = case.hidden_states.clone().requires_grad_(True)

            def step(layer, case=case, mask=mask, x=x):
                attention.zero_grad(set_to_none=True)  # noqa: F821 (pyflakes: the del below)
                x.grad = None
                out = layer(hidden_states=x, position_embeddings=(case.cos, case.sin),
                            attention_mask=mask)
                (out[0] if isinstance(out, tuple) else out).backward(case.grad_output)
            steps.append(step)
        if compiled is not None:
            started = time.time()
            for step in steps:  # compiles on the first use; the second layer type reuses it
                try:
                    step(compiled)
                except torch.OutOfMemoryError:  # others warming up at once: again under the lock
                    torch.cuda.empty_cache()
            torch.cuda.synchronize()
            print("compiled %s B=%d S=%d in %.0f s" % (name, batch, seq_len,
                                                       time.time() - started), flush=True)
    flush = torch.empty(2 * 60 * 1024 * 1024 // 4 * 2, dtype=torch.float32, device="cuda")
    row = [name, batch, seq_len]
    wait_for_all(args.ready_dir, args.ready_count)
    with TimingLock(args.timing_lock):
        for case, outputs_of_case, workspace in zip(cases, outputs, workspaces):
            def call(case=case, outputs_of_case=outputs_of_case, workspace=workspace):
                return case.run(lib, MODES["AUTO"], outputs_of_case, workspace)
            assert call() == 0
            row.append(median_us(call, flush, args.warmup, args.iters))
            if args.profile:
                try:
                    attention_us, kernels_us = attention_kernel_us(call)
                    print("profile %s %s B=%d S=%d: attention kernels %.1f us of %.1f us of kernel"
                          " time per call" % (name, case.layer_type, batch, seq_len, attention_us,
                                              kernels_us), flush=True)
                except Exception as error:  # the profiler may be unavailable there
                    print("profile failed:", error, flush=True)
        for layer, wanted in ((attention, args.torch), (compiled, args.compile)):
            for step in steps or [None, None]:
                row.append(median_us(lambda: step(layer), flush, 3, 10) if wanted
                           else float("nan"))
    torch.backends.cuda.matmul.allow_tf32 = False
    print("timed", row, flush=True)
    del cases, outputs, workspaces, attention, compiled, steps, flush
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default="build-h200/kernels/libattngrad.so")
    parser.add_argument("--shapes", default="1:1,2:7,1:1000,2:2500")
    parser.add_argument("--modes", default="AUTO,FP32,TF32,FP16")
    parser.add_argument("--models", default="")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--time-shapes", default="1:4096,4:1024")
    parser.add_argument("--torch", action="store_true", help="also time PyTorch eager TF32")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile (TF32) of the same layer")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--timing-lock", default="",
                        help="a file to lock (flock) around the timed sections: for several "
                             "processes that compile in parallel and time one at a time")
    parser.add_argument("--ready-dir", default="",
                        help="with --ready-count N: wait before timing until N processes have "
                             "compiled (a barrier; one (model, shape) per process)")
    parser.add_argument("--ready-count", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also report the attention kernels' device time (torch.profiler)")
    args = parser.parse_args()

    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__,
          torch.cuda.get_device_name(0), flush=True)
    lib = load_library(args.lib)
    with open(MODELS_JSON) as f:
        models = {k: v for k, v in json.load(f)["models"].items() if k != "spec"}
    if args.models:
        models = {k: models[k] for k in args.models.split(",")}
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    all_passed = True
    layer_types = ("sliding_attention", "full_attention")
    if not args.no_check:
        for name, model in models.items():
            for layer_type in layer_types:
                short = "local" if layer_type == "sliding_attention" else "global"
                for batch, seq_len in parse_shapes(args.shapes):
                    case = Case(model, layer_type, batch, seq_len, generator)
                    size = lib.attngrad_workspace_size_ex(ctypes.byref(case.layer), batch, seq_len,
                                                          MODES["FP16"])
                    label = "%s %s (window %d) B=%d S=%d" % (name, short, case.window, batch,
                                                             seq_len)
                    if size == 0:
                        print("%-44s not computed by the GPU kernels (head_dim %d): skipped"
                              % (label, model["head_dim"]), flush=True)
                        break
                    reference = case.reference()
                    for mode in args.modes.split(","):
                        workspace_size = lib.attngrad_workspace_size_ex(
                            ctypes.byref(case.layer), batch, seq_len, MODES[mode])
                        workspace = torch.empty(workspace_size, dtype=torch.uint8, device="cuda")
                        outputs = case.new_outputs()
                        for t in outputs:
                            t.fill_(float("nan"))
                        status = case.run(lib, MODES[mode], outputs, workspace)
                        torch.cuda.synchronize()
                        if status != 0:
                            print("%-44s %-4s FAILED: %s"
                                  % (label, mode, lib.attngrad_status_string(status)))
                            all_passed = False
                            continue
                        passed, fractions = check_outputs(outputs, reference)
                        all_passed &= passed
                        print("%-44s %-4s %s  min within tol %.4f%% (%s)" % (
                            label, mode, "PASS" if passed else "FAIL", 100 * min(fractions),
                            " ".join("%.4f" % (100 * f) for f in fractions)), flush=True)
                    del reference, case
                    torch.cuda.empty_cache()
        print("correctness:", "ALL PASS" if all_passed else "SOME FAILED", flush=True)

    if args.time:
        rows = [row for name, model in models.items()
                for batch, seq_len in parse_shapes(args.time_shapes)
                for row in [time_layers(lib, name, model, batch, seq_len, generator, args)]
                if row is not None]
        print("\n| model | B | S | attngrad local µs | attngrad global µs | local / global |"
              " local TFLOP/s | global TFLOP/s | eager TF32 local µs | eager TF32 global µs | "
              "compile TF32 local µs | compile TF32 global µs |")
        print("| --- | ---: | ---: |" + " ---: |" * 9)
        for (name, batch, seq_len, local_us, global_us, local_torch, global_torch, local_compiled,
             global_compiled) in rows:
            model = models[name]
            local_flops = layer_flops(model, batch, seq_len, model["sliding_window"])
            local_tflops = local_flops / local_us / 1e6
            global_tflops = layer_flops(model, batch, seq_len, 0) / global_us / 1e6
            print("| %s | %d | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |"
                  % (name, batch, seq_len, local_us, global_us, local_us / global_us, local_tflops,
                     global_tflops, local_torch, global_torch, local_compiled, global_compiled))
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
