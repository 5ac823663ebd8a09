#!/usr/bin/env python3
"""One whole backward (SPEC section 2) of attngrad at one (B, S), for a profiler to watch.

Draws SPEC section 3's inputs and calls libattngrad's C ABI `--calls` times in AUTO mode (the first
call may build the pipeline's graph); nothing is checked or timed here. The ncu suite of
bench/device/run.sh runs it under Nsight Compute.
  python3 bench/profile_backward.py --lib libattngrad.so --batch 2 --seq 2048
"""
import argparse
import sys

import torch

from check_torch import MODES, draw_inputs, load_library, new_outputs, run_attngrad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    lib = load_library(args.lib)
    generator = torch.Generator(device="cuda").manual_seed(1)
    inputs = draw_inputs(args.batch, args.seq, generator)
    precision = MODES["AUTO"]
    workspace = torch.empty(lib.attngrad_workspace_size(args.batch, args.seq, precision),
                            dtype=torch.uint8, device="cuda")
    outputs = new_outputs(inputs)
    for _ in range(args.calls):
        run_attngrad(lib, inputs, outputs, precision, workspace)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
