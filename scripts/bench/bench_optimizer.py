#!/usr/bin/env python3
"""The optimizer phase alone: deepspeed=zero0's ClippingAdamW (engine/ds/clipping_adamw.py) on a model's real
parameter shapes, its parts timed apart, each against the GPU's streaming bandwidth measured in the same process.

    python3 scripts/bench/bench_optimizer.py [--model qwen3_30b_a3b_4l] [--dtype bf16] [--reps 10]

Issue 22 asks for the 4-layer Qwen3-30B-A3B shape's optimizer phase (3.1B parameters, bf16 master weights) in at
most 20 ms. Parts: `copy` (the memory wall), `grad_norm` (the clip's global norm), `fused_adamw` (torch's),
`triton_adamw` (engine/ds/adamw_kernel.py, CUDA only), `clipping_adamw_step` (all of ClippingAdamW.step, with the
kernel it picks on this device). Each JSON line: the median time of one part and the bytes it must move at least
(AdamW: read the parameter, its gradient and both moments, write back the parameter and the moments; the norm: read
every gradient), so `gbps` against the `copy` line's says how far from the memory wall each part runs. The shapes
come from the HF model built on the meta device from hydra_conf/model/<model>.yaml (nothing is downloaded or
allocated for it).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import yaml  # noqa: E402

from bench_attention import timed  # noqa: E402  (one synchronised call, as the attention bench times it)
from engine.ds.clipping_adamw import ClippingAdamW, squared_norm  # noqa: E402


def shapes(model: str) -> list:
    import transformers
    root = Path(__file__).resolve().parent.parent.parent
    spec = yaml.safe_load((root / "hydra_conf/model" / f"{model}.yaml").read_text())
    config = transformers.AutoConfig.for_model(spec["family"], **spec["arch"])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    return [tuple(p.shape) for p in hf.parameters()]


def median_time(fn, reps: int, device) -> float:
    fn()  # warm-up: kernel selection, lazy state
    return statistics.median(timed(fn, device) for _ in range(reps))


def copy_time(numel: int, dtype, device, reps: int) -> float:
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return median_time(lambda: dst.copy_(src), reps, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_30b_a3b_4l")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each parameter's rows (a CPU smoke test)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes(args.model):
        shape = (max(1, int(shape[0] * args.scale)),) + shape[1:]
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 1e-3
        params.append(p)
    n = sum(p.numel() for p in params)
    esize = params[0].element_size()
    grads = [p.grad for p in params]

    def line(part, seconds, nbytes):
        print(json.dumps({"bench": "optimizer", "model": args.model, "dtype": args.dtype, "params": n,
                          "tensors": len(params), "part": part, "ms": round(seconds * 1e3, 3),
                          "gbps": round(nbytes / seconds / 1e9, 1), "device": torch.cuda.get_device_name(device)
                          if device.type == "cuda" else "cpu"}), flush=True)

    # the memory wall: one read and one write of as many bytes as AdamW writes (3 tensors per parameter)
    line("copy", copy_time(n * 3, dtype, device, args.reps), 2 * 3 * n * esize)
    line("grad_norm", median_time(lambda: squared_norm(grads, device).sqrt(), args.reps, device), n * esize)
    plain = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")
    line("fused_adamw", median_time(plain.step, args.reps, device), 7 * n * esize)
    plain.state.clear()
    del plain
    if device.type == "cuda":
        from engine.ds.adamw_kernel import adamw_step
        triton = torch.optim.AdamW(params, lr=1e-6)
        line("triton_adamw", median_time(lambda: adamw_step(triton), args.reps, device), 7 * n * esize)
        triton.state.clear()
        del triton
    # the whole of deepspeed=zero0's step: the norm, the clip divisor, the AdamW kernel ClippingAdamW picked
    clipping = ClippingAdamW(params, clip=1.0, lr=1e-6)
    line("clipping_adamw_step", median_time(clipping.step, args.reps, device), 8 * n * esize)


if __name__ == "__main__":
    main()
