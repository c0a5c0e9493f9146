#!/usr/bin/env python3
"""The lean expert pass's six grouped GEMMs (moe/lean_pass.py) in bf16 and in FP8 rowwise, one GPU.

    python3 scripts/bench/bench_fp8_grouped.py [--tokens 16384,32768,65536]

Why: issue 41 asks for the MoE experts' grouped GEMMs in FP8 where that measures faster than our bf16 grouped path.
FP8 rowwise grouped GEMMs (torch._scaled_grouped_mm) need each operand cast with its own scales: the tokens per row,
the weights per expert and output column, and for a weight gradient both operands per expert group along the token
dimension. On the Qwen3-30B-A3B shape the weights are large against the tokens each expert sees (2048 x 1536 per
expert, about 1,000 tokens per expert at 16k), so the casts can cost what the FP8 GEMMs save. This measures it,
with torchao 0.18's fused Triton casts (the fastest casts available), groups padded to 16 rows as FP8 needs.

Variants, each forward (h = x_N W_gu^T, y = act W_d^T) + backward (u = g_N W_d, grad_x = grad_h W_gu, and the two
weight gradients), casts included:
- `bf16`: torch._grouped_mm, as the lean pass runs today;
- `fp8_gw_hp`: the four token-side GEMMs in FP8, the weight gradients in bf16 (the rowwise_with_gw_hp recipe);
- `fp8`: all six in FP8.
Each JSON line: variant, tokens, median ms, the ratio to bf16, and the forward h's relative distance from bf16's.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_attention import timed  # noqa: E402

F8 = torch.float8_e4m3fn


def padded_counts(T: int, k: int, E: int, gen) -> torch.Tensor:
    """Per-expert slot counts of a random top-k routing, each rounded up to 16 (FP8 grouped GEMMs need it)."""
    picks = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.flatten()
    counts = torch.bincount(picks, minlength=E)
    return (counts + 15) // 16 * 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,32768,65536")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from torchao.prototype.moe_training.kernels import (triton_fp8_colwise_3d_scale_and_cast,
                                                        triton_fp8_per_group_colwise_scales_dual,
                                                        triton_fp8_rowwise_2d_scale_and_cast,
                                                        triton_fp8_rowwise_3d_transpose_rhs)

    def rows(a):  # row-major fp8 and the reciprocal scales per row
        q, s = triton_fp8_rowwise_2d_scale_and_cast(a, output_dtype=F8, round_scales_to_power_of_2=True)
        return q, s.squeeze(-1).reciprocal()

    def rhs(w_t):  # w_t [E, K, M] column-major (a weight's transpose view) -> fp8 column-major, scales [E, M]
        q, s = triton_fp8_colwise_3d_scale_and_cast(w_t, output_dtype=F8, round_scales_to_power_of_2=True)
        return q, s.squeeze(1).reciprocal()

    def rhs_t(w_t):  # the weight itself as the right operand: w_t [E, K, M] -> fp8 of w [E, M, K], column-major
        q, s = triton_fp8_rowwise_3d_transpose_rhs(w_t, output_dtype=F8, round_scales_to_power_of_2=True)
        return q, s.squeeze(1).reciprocal()

    def fp8_mm(a, w_q, offs):
        a_q, a_s = rows(a)
        return torch._scaled_grouped_mm(a_q, w_q[0], a_s, w_q[1], offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    def fp8_wgrad(a, b, offs):  # per expert: a's rows transposed times b's rows, both scaled per group column
        a_q, a_s, b_q, b_s = triton_fp8_per_group_colwise_scales_dual(a, b, offs, F8, round_scales_to_power_of_2=True)
        return torch._scaled_grouped_mm(a_q.t(), b_q, a_s.t().reciprocal(), b_s.reciprocal(), offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    dev = torch.device("cuda")
    D, I, E, k = args.hidden, args.inter, args.experts, args.topk
    gen = torch.Generator().manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, D, generator=gen) * 0.02).to(dev, torch.bfloat16)
    w_d = (torch.randn(E, D, I, generator=gen) * 0.02).to(dev, torch.bfloat16)
    for T in (int(t) for t in args.tokens.split(",")):
        offs = padded_counts(T, k, E, gen).cumsum(0).to(dev, torch.int32)
        N = int(offs[-1])
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        act = torch.randn(N, I, device=dev, dtype=torch.bfloat16)
        g = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        gh = torch.randn(N, 2 * I, device=dev, dtype=torch.bfloat16)

        def bf16():
            h = torch._grouped_mm(x, w_gu.transpose(-2, -1), offs=offs)
            torch._grouped_mm(act, w_d.transpose(-2, -1), offs=offs)
            torch._grouped_mm(g, w_d, offs=offs)
            torch._grouped_mm(gh, w_gu, offs=offs)
            torch._grouped_mm(g.t(), act, offs=offs)
            torch._grouped_mm(gh.t(), x, offs=offs)
            return h

        def fp8(weight_grads_fp8: bool):
            def run():
                h = fp8_mm(x, rhs(w_gu.transpose(-2, -1)), offs)
                fp8_mm(act, rhs(w_d.transpose(-2, -1)), offs)
                fp8_mm(g, rhs_t(w_d.transpose(-2, -1)), offs)
                fp8_mm(gh, rhs_t(w_gu.transpose(-2, -1)), offs)
                if weight_grads_fp8:
                    fp8_wgrad(g, act, offs)
                    fp8_wgrad(gh, x, offs)
                else:
                    torch._grouped_mm(g.t(), act, offs=offs)
                    torch._grouped_mm(gh.t(), x, offs=offs)
                return h
            return run

        ref_h = bf16().float()
        base = None
        for name, fn in (("bf16", bf16), ("fp8_gw_hp", fp8(False)), ("fp8", fp8(True))):
            for _ in range(3):
                fn()
            ms = statistics.median(timed(fn, dev) for _ in range(args.reps)) * 1e3
            base = base or ms
            err = ((fn().float() - ref_h).norm() / ref_h.norm()).item()
            print(json.dumps(dict(bench="fp8_grouped", variant=name, tokens=T, slots=N, ms=round(ms, 3),
                                  vs_bf16=round(base / ms, 3), h_rel_err=round(err, 5))), flush=True)


if __name__ == "__main__":
    main()
