#!/usr/bin/env python3
"""The loss head alone, forward + backward: our fused chunked loss (ds_ulysses_ext/loss.py; `ours` with each chunk's
rows in the Triton kernel as CUDA runs it, `ours_torch` with torch's rows) against Liger-Kernel's fused linear
cross-entropy (as HF + Liger runs it, weight gradient in bf16, and with accum_dtype=fp32), in bf16. One JSON line per
(impl, tokens, chunk): median time and the peak memory above the inputs. Issue 22 asks to keep the faster at equal
memory.

    python3 scripts/bench/bench_loss.py --tokens 16384,32768 [--impls ours,liger] [--vocab 128256 --hidden 2048]
        [--chunks 0,2048,4096]

Liger's is called as HF + Liger runs it (sum over tokens, ignore_index -100); its weight gradient is accumulated
in bf16, ours in fp32 (the reported `grad_w_rel_err` is each against an fp32 reference on the same inputs, so the
price of that difference is in the line too). On CPU it runs ours at the sizes given (a smoke test; Liger needs CUDA).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from ds_ulysses_ext.batch import IGNORE_INDEX  # noqa: E402
from ds_ulysses_ext.loss import chunk_tokens, linear_cross_entropy_sum  # noqa: E402


def ours(weight, hidden, labels, chunk):
    return linear_cross_entropy_sum(weight, hidden[None], labels[None], chunk_size=chunk)[0]


def ours_torch(weight, hidden, labels, chunk):
    return linear_cross_entropy_sum(weight, hidden[None], labels[None], chunk_size=chunk, fused_rows=False)[0]


def liger(weight, hidden, labels, chunk, accum_dtype=None):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
    # return_z_loss, accum_dtype): the first output is the loss
    return LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels, None, None, IGNORE_INDEX, 0.0, 0.0,
                                                      "sum", None, False, accum_dtype)[0]


def liger_fp32(weight, hidden, labels, chunk):
    """Liger with its weight gradient accumulated in fp32 (accum_dtype), as ours is."""
    return liger(weight, hidden, labels, chunk, torch.float32)


def reference_grad_w(weight, hidden, labels):
    """fp32 reference of d(sum CE)/d weight, a chunk of tokens at a time (the full fp32 logits would not fit)."""
    grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    w = weight.float()
    for s in range(0, hidden.shape[0], 1024):
        h, y = hidden[s:s + 1024].float(), labels[s:s + 1024]
        p = torch.softmax(h @ w.t(), dim=-1)
        valid = y != IGNORE_INDEX
        p[torch.arange(len(y), device=y.device)[valid], y[valid]] -= 1
        p[~valid] = 0
        grad += p.t() @ h
    return grad


def inputs(T, args, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=gen) * 0.02).to(dtype)
    hidden = torch.randn(T, args.hidden, device=device, generator=gen).to(dtype)
    labels = torch.randint(0, args.vocab, (T,), device=device, generator=gen)
    labels[: T // 10] = IGNORE_INDEX
    return weight, hidden, labels


def run(impl, T, args, device, dtype, ref, chunk):
    weight, hidden, labels = inputs(T, args, device, dtype)
    fn = {"ours": ours, "ours_torch": ours_torch, "liger": liger, "liger_fp32": liger_fp32}[impl]
    chunk = chunk_tokens(chunk, args.vocab)
    times, grad_w = [], None
    for i in range(args.warmup + args.reps):
        w, h = weight.detach().requires_grad_(), hidden.detach().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn(w, h, labels, chunk)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        grad_w = w.grad
    out = {"bench": "loss_head", "impl": impl, "tokens": T, "vocab": args.vocab, "hidden": args.hidden,
           "dtype": str(dtype).replace("torch.", ""), "chunk": chunk if impl.startswith("ours") else "liger's own",
           "ms": 1e3 * statistics.median(times), "loss": float(loss.detach())}
    if device.type == "cuda":
        out["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    out["grad_w_rel_err"] = float((grad_w.float() - ref).norm() / ref.norm())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--impls", default="ours,ours_torch,liger,liger_fp32")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunks", default="0", help="ours: trainer.loss_chunk_size values (0: sized to the vocabulary)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for T in map(int, args.tokens.split(",")):
        ref = reference_grad_w(*inputs(T, args, device, dtype))
        for impl in args.impls.split(","):
            if impl.startswith("liger") and device.type != "cuda":
                print(json.dumps({"bench": "loss_head", "impl": impl, "tokens": T, "status": "skipped: needs CUDA"}))
                continue
            for chunk in map(int, args.chunks.split(",")) if impl.startswith("ours") else (0,):
                try:
                    print(json.dumps(run(impl, T, args, device, dtype, ref, chunk)), flush=True)
                except torch.cuda.OutOfMemoryError:
                    print(json.dumps({"bench": "loss_head", "impl": impl, "tokens": T, "chunk": chunk,
                                      "status": "oom"}), flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
