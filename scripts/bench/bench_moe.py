#!/usr/bin/env python3
"""MoE block benchmark: our MoEBlock (ds_ulysses_ext/moe), forward + backward, one GPU, ep=1.

    python3 scripts/bench/bench_moe.py --tokens 16384,65536 --modes none,experts,experts_offload

Measured the way the anchor measures HF's Qwen3MoeSparseMoeBlock (../anchor-bench/moe_bench.py, run in the same
session by scripts/bench/bench_gpu.sh moe_block): Qwen3-30B-A3B shape by default (hidden 2048, expert intermediate 768,
128 experts, top-8), bf16, weights ~N(0, 0.02), x [1, T, hidden] with requires_grad, median of --reps after
--warmup, expert-GEMM TFLOP/s = 18 * hidden * intermediate * T * top_k / step time (router not counted).
`--modes`: moe.recompute none | act | experts (one expert at a time; experts_g4: four), `_offload` adds
moe.offload_inputs. One `RESULT {json}` line per (mode, tokens).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout, not an install
from ds_ulysses_ext.moe import MoEBlock, MoESpec  # noqa: E402


def build(args, mode):
    recompute = mode.split("_")[0]
    block = MoEBlock(MoESpec(args.hidden, args.experts, args.topk, args.inter, norm_topk_prob=True))
    block.to(device="cuda", dtype=torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.experts.recompute = recompute
    block.experts.group_size = int(mode.split("_g")[1].split("_")[0]) if "_g" in mode else 1
    block.experts.offload_inputs = mode.endswith("_offload")
    return block


def time_step(block, x, grad):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block(x).backward(grad)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--modes", default="none")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the top CUDA ops of one more step per point")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            rec = dict(bench="ours_moe_block", mode=mode, tokens=T, hidden=args.hidden, inter=args.inter,
                       experts=args.experts, topk=args.topk, torch=torch.__version__)
            block = None
            try:
                torch.manual_seed(0)
                block = build(args, mode)
                x = torch.randn(1, T, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                grad = torch.randn_like(x)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                for _ in range(args.warmup):
                    time_step(block, x, grad)
                times = [time_step(block, x, grad) for _ in range(args.reps)]
                step = statistics.median(times)
                flops = 18 * args.hidden * args.inter * T * args.topk
                rec.update(step_s=step, tokens_per_s=T / step, expert_tflops=flops / step / 1e12,
                           peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                           peak_above_inputs_gib=(torch.cuda.max_memory_allocated() - base) / 2**30, status="ok")
                if args.profile:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        time_step(block, x, grad)
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
            except Exception as e:  # OOM or a kernel missing: record and go on
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
            print("RESULT " + json.dumps(rec), flush=True)
            del block
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
