#!/usr/bin/env python3
"""Overhead of ulysses_attention with a CP group of size 1 against calling the same backend directly.

    python3 scripts/bench/bench_attention.py --seqs 32768,131072            # one GPU, bf16, Hq32/Hkv8, D128
    python3 scripts/bench/bench_attention.py --device cpu --seqs 512 --reps 2   # smoke test on CPU

Both sides run fwd+bwd on the same tensors, interleaved (A B A B ...) so clock and thermal drift hit
both alike; the reported time is the median. Prints one JSON line per (backend, S) prefixed RESULT.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from ds_ulysses_ext import init_topology, ulysses_attention  # noqa: E402
from ds_ulysses_ext.attention.backends import local_attention  # noqa: E402


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    topo = init_topology(1)  # a real process group of size 1
    for S in [int(s) for s in args.seqs.split(",")]:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, S, h, args.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
                   for h in (args.hq, args.hkv, args.hkv))
        dout = torch.randn(1, S, args.hq, args.head_dim, device=device, dtype=dtype, generator=g)

        def direct():
            local_attention(args.backend, q, k, v, causal=True).backward(dout)

        def ours():
            ulysses_attention(q, k, v, group=topo.cp_group, causal=True, backend=args.backend).backward(dout)

        for fn in (direct, ours):  # warm-up: kernel selection, allocator
            timed(fn, device)
        t_direct, t_ours = [], []
        for _ in range(args.reps):
            t_direct.append(timed(direct, device))
            t_ours.append(timed(ours, device))
        flops = 3.5 * 2 * 2 * args.hq * S * S * args.head_dim / 2  # causal fwd + 2.5x bwd
        d, o = statistics.median(t_direct), statistics.median(t_ours)
        print("RESULT " + json.dumps(dict(S=S, hq=args.hq, hkv=args.hkv, D=args.head_dim, backend=args.backend,
                                          direct_ms=d * 1e3, ulysses_ms=o * 1e3, overhead_pct=(o / d - 1) * 100,
                                          direct_tflops=flops / d / 1e12, reps=args.reps,
                                          device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")),
              flush=True)
        del q, k, v, dout
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
