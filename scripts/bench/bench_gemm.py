#!/usr/bin/env python3
"""The dense GEMMs of one decoder layer and the loss head, alone: what cuBLAS reaches on this GPU for each linear of
a model's layer at S tokens, forward (x W^T), input gradient (g W) and weight gradient (g^T x), each as its own
call and with the projections that share an input fused into one weight (q, k, v; gate, up).

    python3 scripts/bench/bench_gemm.py [--model llama3_2_1b] [--tokens 16384,32768] [--reps 20]

Why: docs/benchmarks.md AZ bounds a step's time by attention plus 6 x parameters x tokens at an effective GEMM
rate. The step's fitted rate (576 TFLOP/s, small ops included) is below what these shapes reach alone; this says by
how much, per linear and per pass, so a profile of the step can be read against it. Each JSON line: the linear,
the pass, M x N x K, the median time and TFLOP/s. The shapes come from hydra_conf/model/<model>.yaml (no weights).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import yaml  # noqa: E402

from bench_attention import timed  # noqa: E402


def layer_linears(model: str) -> dict:
    """{name: (out_features, in_features)} for one decoder layer and the head, from the model's yaml."""
    root = Path(__file__).resolve().parent.parent.parent
    spec = yaml.safe_load((root / "hydra_conf/model" / f"{model}.yaml").read_text())
    a = spec["arch"]
    h, i = a["hidden_size"], a["intermediate_size"]
    d = a.get("head_dim", h // a["num_attention_heads"])
    q, kv = a["num_attention_heads"] * d, a.get("num_key_value_heads", a["num_attention_heads"]) * d
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i),
            "qkv": (q + 2 * kv, h), "gate_up": (2 * i, h), "head": (a["vocab_size"], h)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--head-chunk", type=int, default=0, help="the loss head's rows per chunk (0: all at once)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for s in (int(t) for t in args.tokens.split(",")):
        for name, (n, k) in layer_linears(args.model).items():
            m = args.head_chunk if (name == "head" and args.head_chunk) else s
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
            g = torch.randn(m, n, device=device, dtype=dtype)
            passes = {"fwd": lambda: x @ w.t(), "dgrad": lambda: g @ w, "wgrad": lambda: g.t() @ x}
            for p, fn in passes.items():
                fn()
                # ten calls between two synchronisations: one call of 0.1 ms would mostly time the host
                t = statistics.median(timed(lambda: [fn() for _ in range(10)], device) for _ in range(args.reps)) / 10
                print(json.dumps({"bench": "gemm", "model": args.model, "tokens": s, "linear": name, "pass": p,
                                  "mnk": [m, n, k], "ms": round(t * 1e3, 4),
                                  "tflops": round(2 * m * n * k / t / 1e12, 1)}), flush=True)


if __name__ == "__main__":
    main()
