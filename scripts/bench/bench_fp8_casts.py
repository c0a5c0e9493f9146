"""fp8.recipe=delayed's cast kernels alone, on each tile: GPU time and bandwidth against a copy of as many bytes.

    python3 scripts/bench/bench_fp8_casts.py --shapes 32768x8192,32768x2048 [--tiles 64,64,4:128,128,8] \
        [--ways bits,bytes] [--reps 20]

Why: at 32k tokens on the 1B shape the SwiGLU backward (h again, dg and du, their e5m2 transposed copies) took 1.5 ms
a layer, at about 65% of the bandwidth Liger's SwiGLU backward reaches (docs/benchmarks.md, 2026-12-07 eighth part).
The autotuner picks among fp8_cast_kernels.TILE_SHAPES; this times each kernel on each tile given (by default those,
some others, and `auto`: the autotuner's pick) and checks each tile's outputs against the torch path byte for byte,
as tests/test_gpu_fp8_delayed.py does, so that a fast tile writing wrong bytes is never read as a candidate.

Legend: an operand [M, N] bf16 (a shape of --shapes); the kernels as in kernels/fp8_cast_kernels.py, each called
through kernels/fp8_casts.py as a step calls it (output allocation included; with way `bytes`, the e5m2 transposes
by the byte-transpose kernel after the cast).

One JSON line per (shape, way, kernel, tile): the median ms of --reps calls, the bytes the kernel must move (each
operand read once, each output written once), GB/s, `of_copy` (a device copy of as many bytes, timed the same way,
over this kernel's time: 1 is the copy's bandwidth) and `exact` (the outputs against the torch path's: the casts
byte for byte, the SiLU products within one float8 step in at most 1e-5 of the elements).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_attention import timed  # noqa: E402
from ds_ulysses_ext.kernels import fp8_cast_kernels  # noqa: E402
from ds_ulysses_ext.kernels.fp8_casts import (DY, E4, E5, WIDTH, X, Launch, cast, kernels_ok, swiglu_bwd,  # noqa: E402
                                              swiglu_fwd)

# tiles beyond the autotuner's list: longer and shorter rows of the tile, fewer and more warps
MORE_TILES = ((64, 256, 8), (128, 256, 8), (256, 64, 8), (256, 128, 8), (128, 128, 4), (64, 64, 2))


# the kernels whose work depends on how the e5m2 transposes are made (--ways); the others run for the first way only
E5_KERNELS = ("cast_e5m2", "swiglu_bwd")


def kernels(x, g, u, dh, scales):
    """name -> (op(kernel) -> outputs, bytes read, bytes written, SiLU outputs), for operands [M, N]."""
    mn = x.numel()

    def fresh():
        return torch.zeros(WIDTH, device=x.device)
    return {
        "cast_e4m3": (lambda k: cast(x, scales, fresh(), X, E4, k), 2 * mn, 2 * mn, False),
        "cast_e5m2": (lambda k: cast(dh, scales, fresh(), DY, E5, k), 2 * mn, 2 * mn, False),
        "swiglu_fwd": (lambda k: (swiglu_fwd(g, u, scales, fresh(), k),), 4 * mn, mn, True),
        "swiglu_bwd": (lambda k: swiglu_bwd(dh, g, u, scales, fresh(), k), 6 * mn, 5 * mn, True),
    }


def exact(got, ref, silu: bool) -> bool:
    for a, b in zip(got, ref):
        differ = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
        if differ > (a.numel() // 100_000 if silu else 0):
            return False
    return True


def median_ms(fn, reps: int, device) -> float:
    fn()
    return statistics.median(timed(fn, device) for _ in range(reps)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x8192,32768x2048")
    ap.add_argument("--tiles", default="", help="BM,BN,warps tiles separated by ':' (default: the autotuner's list "
                    "and MORE_TILES)")
    ap.add_argument("--ways", default="bits,bytes", help="how the e5m2 transposes are made (fp8_casts.E5_WAYS)")
    ap.add_argument("--kernels", default="cast_e4m3,cast_e5m2,swiglu_fwd,swiglu_bwd")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    tiles = ([tuple(int(v) for v in t.split(",")) for t in args.tiles.split(":")] if args.tiles
             else [*fp8_cast_kernels.TILE_SHAPES, *MORE_TILES])
    print(json.dumps({"bench": "fp8_casts_check", "first_use_chose": str(kernels_ok(device))}), flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        x, g, u = (torch.randn(m, n, device=device, generator=gen).bfloat16() for _ in range(3))
        dh = (1e-2 * torch.randn(m, n, device=device, generator=gen)).bfloat16()
        scales = torch.tensor([100.0, 150.0, 4000.0, 4000.0, 4000.0, 2e6, 2e6, 1e7], device=device)
        for name, (op, read, written, silu) in kernels(x, g, u, dh, scales).items():
            if name not in args.kernels.split(","):
                continue
            ref = op(False)
            src = torch.empty((read + written) // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copy_ms = median_ms(lambda: dst.copy_(src), args.reps, device)  # moves read + written bytes
            ways = args.ways.split(",")
            for way in ways if name in E5_KERNELS else ways[:1]:
                for tile in [None, *tiles]:
                    kernel = Launch(way, tile)
                    row = {"bench": "fp8_casts", "shape": [m, n], "way": way, "kernel": name,
                           "tile": "auto" if tile is None else list(tile), "bytes": read + written}
                    try:
                        ok = exact(op(kernel), ref, silu)
                        ms = median_ms(lambda: op(kernel), args.reps, device)
                    except Exception as e:  # a tile Triton cannot compile (shared memory, registers): say so, go on
                        print(json.dumps({**row, "error": repr(e)[:300]}), flush=True)
                        continue
                    print(json.dumps({**row, "ms": round(ms, 4), "gb_s": round((read + written) / ms / 1e6, 1),
                                      "of_copy": round(copy_ms / ms, 3), "exact": ok}), flush=True)


if __name__ == "__main__":
    main()
