#!/usr/bin/env python3
"""The torch delta rule (ds_ulysses_ext/linear_attention/delta_rule.py) alone: forward and backward time against S.

    python3 scripts/bench/bench_delta_rule.py [--device cpu|cuda] [--seqs 2048,4096,8192,16384] [--heads 4] [--dim 64]

Why: its chunks run in order in Python, and a per-chunk cost that grows with S (as indexing each chunk out of the
whole tensors did: each slice's backward wrote a zero tensor of the whole input) makes the step quadratic. Linear
cost shows as time doubling with S. One JSON line per S: forward and backward seconds (median of --reps after one
warm-up), and both per 1k tokens. Gated DeltaNet's decay (one per head); --per-channel for KDA's.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from ds_ulysses_ext.linear_attention.delta_rule import chunked_delta_rule  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def one(S, args, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, S, args.heads, args.dim)
    q, k, v = (torch.randn(shape, generator=g).to(device).requires_grad_() for _ in range(3))
    decay = (-torch.rand(shape if args.per_channel else shape[:3], generator=g) * 0.1).to(device).requires_grad_()
    beta = torch.rand(shape[:3], generator=g).to(device).requires_grad_()
    fwd, bwd = [], []
    for _ in range(args.reps + 1):
        sync(device)
        t = time.perf_counter()
        o = chunked_delta_rule(q, k, v, decay, beta)
        sync(device)
        t_mid = time.perf_counter()
        o.square().sum().backward()
        sync(device)
        fwd.append(t_mid - t)
        bwd.append(time.perf_counter() - t_mid)
    f, b = statistics.median(fwd[1:]), statistics.median(bwd[1:])
    return dict(S=S, heads=args.heads, dim=args.dim, per_channel=args.per_channel, device=device.type,
                fwd_s=round(f, 4), bwd_s=round(b, 4), fwd_s_per_1k=round(f * 1024 / S, 5),
                bwd_s_per_1k=round(b * 1024 / S, 5))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs", default="2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--per-channel", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a steady per-token cost, not the machine's thread scheduling
    for S in map(int, args.seqs.split(",")):
        print(json.dumps(one(S, args, torch.device(args.device))), flush=True)


if __name__ == "__main__":
    main()
