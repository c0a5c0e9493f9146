#!/usr/bin/env python3
"""FlashAttention-4's Hopper tile sizes at the Llama-3.2-1B attention shape: is its choice the fastest? (bench only)

    python3 scripts/bench/bench_fa4_tiles.py bwd --seqs 16384,65536 --reps 3     # backward tile variants
    python3 scripts/bench/bench_fa4_tiles.py fwd --seqs 16384,65536 --reps 3     # forward tile variants

Shape: q [1, S, 32, 64], k, v [1, S, 8, 64], bf16, causal; one forward + backward per rep, CUDA-event timed, the
median of --reps after one warm-up. Each variant replaces FA4's sm90 tile choice (flash_attn.cute.interface's
_tile_size_{fwd,bwd}_sm90, which it calls per launch and keys its compile cache on) for this process only: a
measurement, not something the library does (ds_ulysses_ext calls FA4 with its own choice). The first variant is
FA4's own; every other is checked against it (max |out| difference, gradients relative to their max) and a variant
the kernel rejects (shared memory, a tile the MMA cannot partition) is reported as an error line. One JSON line per
variant and length (docs/benchmarks.md BF).
"""
import argparse
import json
import statistics
import time

import torch

HQ, HKV, D = 32, 8, 64
# FA4 4.0.0b36's choice at head dim 64 (its BwdConfig fields) and the variants around it
BWD_DEFAULT = dict(m_block_size=128, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2,
                   SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2,
                   AtomLayoutMdQ=2)
BWD = {"b0_default": None,
       "b1_m64n128": dict(BWD_DEFAULT, m_block_size=64, AtomLayoutMdQ=1),
       "b2_mdq1": dict(BWD_DEFAULT, AtomLayoutMdQ=1),
       "b3_ndkv1": dict(BWD_DEFAULT, AtomLayoutNdKV=1),
       "b4_sdp2": dict(BWD_DEFAULT, SdP_swapAB=False, AtomLayoutMSdP=2),
       "b5_m64_dqswap": dict(BWD_DEFAULT, m_block_size=64, AtomLayoutMdQ=1, dQ_swapAB=True),
       "b6_n96": dict(BWD_DEFAULT, n_block_size=96),
       "b7_m128n64": dict(BWD_DEFAULT, n_block_size=64, AtomLayoutNdKV=1)}
# FwdConfig(m_block_size, n_block_size, mma_pv_is_rs, intra_wg_overlap); FA4's own is 192 x 128, RS, overlap
FWD = {"f0_default": None, "f1_128x128": (128, 128, True, True), "f2_192x128_noRS": (192, 128, False, True),
       "f3_192x160": (192, 160, True, True), "f4_128x176": (128, 176, True, True)}


def attention_flops(s: int) -> float:
    return 4 * s * s * HQ * D / 2  # causal forward


def run(fn, s: int, reps: int):
    torch.manual_seed(0)
    q = torch.randn(1, s, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, s, HQ, D, device="cuda", dtype=torch.bfloat16)
    fwd, bwd = [], []
    for i in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        out = fn(q, k, v, causal=True)
        out = out[0] if isinstance(out, tuple) else out
        e[1].record()
        out.backward(do)
        e[2].record()
        torch.cuda.synchronize()
        if i:
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
    return statistics.median(fwd), statistics.median(bwd), out.float(), [t.grad.float() for t in (q, k, v)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direction", choices=("fwd", "bwd"))
    ap.add_argument("--seqs", default="16384,65536")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import flash_attn.cute.interface as fa4
    from flash_attn.cute import flash_attn_func
    name = f"_tile_size_{args.direction}_sm90"
    own = getattr(fa4, name)
    variants = BWD if args.direction == "bwd" else FWD
    reference = {}
    for variant, cfg in variants.items():
        if cfg is None:
            choice = own
        elif args.direction == "bwd":
            choice = lambda *a, _c=cfg, **kw: fa4.BwdConfig(**_c)  # noqa: E731
        else:
            choice = lambda *a, _c=cfg, **kw: fa4.FwdConfig(*_c)  # noqa: E731
        setattr(fa4, name, choice)
        for s in map(int, args.seqs.split(",")):
            row = dict(direction=args.direction, variant=variant, S=s)
            try:
                t0 = time.time()
                f_ms, b_ms, out, grads = run(flash_attn_func, s, args.reps)
                if cfg is None:
                    reference[s] = out, grads
                    err = 0.0
                else:
                    ro, rg = reference[s]
                    err = max([(out - ro).abs().max().item()] +
                              [((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, rg)])
                row.update(fwd_ms=round(f_ms, 3), bwd_ms=round(b_ms, 3),
                           fwd_tflops=round(attention_flops(s) / f_ms / 1e9, 1),
                           bwd_tflops=round(2.5 * attention_flops(s) / b_ms / 1e9, 1),
                           max_err=err, wall_s=round(time.time() - t0, 1))
            except Exception as exc:  # a tile the kernel rejects: reported, the next variant runs
                row["error"] = repr(exc)[:300]
            print(json.dumps(row), flush=True)
        setattr(fa4, name, own)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
