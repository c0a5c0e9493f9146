#!/usr/bin/env python3
"""Training-step benchmark of the engine, side by side with the anchors in the same session.

    # one H200: our engine on the Llama-3.2-1B shape, then stock HF and ALST (../anchor-bench) at the same S
    python3 scripts/bench/bench_train.py --points 16384:none,32768:none,65536:none --anchors hf \
        --anchor-dir .bench/anchor-bench
    # CPU smoke test
    python3 scripts/bench/bench_train.py --model tiny --device cpu --points 256:none --steps 2 --nproc 2

Each point S:MEMORY runs scripts/train.py in its own process group (fresh GPU memory) for --steps
optimizer steps of one sequence per CP group; the first step is warm-up, the rest are timed (median).
MEMORY is a hydra_conf/memory preset. Results go to $OUT/bench_train.jsonl (one JSON line each).
Model TFLOP/s use engine/observe/flops.py's formula (6NT + causal attention, recompute not counted), the same as
../anchor-bench/model_bench.py, so the columns compare.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_ours(S, memory, args, out_root):
    out = out_root / (f"ours_{args.model}_{S}_{memory}_cp{args.cp}" + ("" if args.precision == "bf16" else f"_{args.precision}"))
    over = [f"model={args.model}", "data=synthetic", f"data.seq_len={S}", "data.num_samples=64",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.nproc // args.cp}",
            "trainer.micro_batch_size=1", "trainer.warmup_steps=1", "trainer.save_at_end=false",
            "trainer.export_hf=false", "trainer.resume=false", "logging.progress_bar=false",
            f"logging.phase_times={str(not args.no_phase_times).lower()}", f"parallelism.cp={args.cp}",
            f"memory={memory}", f"precision={args.precision}",
            f"deepspeed={args.deepspeed}", f"device={args.device}", f"run.out_dir={out}"]
    # an explicit attention backend, so results do not depend on which optional kernels happen to import
    if not any(o.startswith("model.attn_backend=") for o in args.extra):
        over.append("model.attn_backend=sdpa")
    over += args.extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "scripts" / "train.py")] + over
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    res = dict(variant="ours", model=args.model, S=S, memory=memory, cp=args.cp, nproc=args.nproc,
               deepspeed=args.deepspeed, precision=args.precision,
               overrides=args.extra, wall_s=time.time() - t0, rc=p.returncode)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    chose = [line.split(": ", 1)[-1] for line in (p.stdout + p.stderr).splitlines() if "memory=auto chose" in line]
    if chose:  # memory=auto: the preset and the step it predicted, beside the step measured
        res["auto_choice"] = chose[-1]
    if p.returncode != 0 or not rows:
        res["error"] = (p.stdout[-1500:] + p.stderr[-2500:])
        return res
    timed = [r for r in rows[1:] if not r.get("profiled")] or rows  # a profiled step is slower by design
    step_s = statistics.median(r["step_time_s"] for r in timed)
    last = rows[-1]
    res.update(step_s=step_s, timed_steps=len(timed), tokens_per_s_per_gpu=S * args.nproc / args.cp / step_s / args.nproc,
               tflops_per_gpu=statistics.median(r["tflops_per_gpu"] for r in timed),
               mfu=statistics.median(r["mfu"] for r in timed) if last["mfu"] is not None else None,
               peak_alloc_gib=last["peak_mem_gib"], peak_reserved_gib=last["peak_reserved_gib"],
               loss=last["loss"], **({"fp8": rows[0]["fp8"]} if "fp8" in rows[0] else {}),
               **{k: statistics.median(r[k] for r in timed) for k in last if k.startswith("time_")})
    return res


def run_anchor(S, variant, args):
    """`variant`: an anchor-bench variant (hf, alst), then `+`-joined kits: `liger` (Liger-Kernel patched in),
    `fa4` (FlashAttention-4 through HF's attention interface), `nockpt` (no gradient checkpointing)."""
    base, *kits = variant.split("+")
    flags = {"liger": ["--liger"], "fa4": ["--attn", "fa4"], "nockpt": ["--no-ckpt"]}
    unknown = [k for k in kits if k not in flags]
    if unknown:
        raise SystemExit(f"anchor {variant!r}: unknown kit(s) {unknown}; known: {sorted(flags)}")
    cmd = [sys.executable, str(Path(args.anchor_dir) / "model_bench.py"), "--seq", str(S), "--variant", base,
           "--warmup", "1", "--reps", str(max(1, args.steps - 1))] + [f for k in kits for f in flags[k]]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    res = dict(variant=variant, S=S, wall_s=time.time() - t0, rc=p.returncode)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    if "step_s" not in res and "median_step_s" not in res:
        res["error"] = p.stdout[-1500:] + p.stderr[-2500:]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", required=True, help="comma list of S:memory_preset")
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--cp", type=int, default=None, help="default: nproc")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--deepspeed", default="zero3")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--anchors", default="", help="comma list of anchor-bench variants (hf, alst) with +kits: hf+liger, alst+liger+fa4, hf+liger+fa4+nockpt")
    ap.add_argument("--anchor-dir", default=str(ROOT / ".bench" / "anchor-bench"))
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--order", default="ours-first", choices=["ours-first", "anchors-first"])
    ap.add_argument("--no-ours", action="store_true", help="anchors only (ours measured by another command)")
    ap.add_argument("--no-phase-times", action="store_true",
                    help="no time_forward/backward/optimizer columns: logging.phase_times synchronises the device at "
                         "each phase boundary (three drains of the queue per step, which the anchors do not pay); "
                         "off, the step runs as a user's does (the config's default)")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for our runs")
    args = ap.parse_intermixed_args()  # overrides may follow options too ($EXTRA of bench_gpu.sh carries both)
    args.cp = args.cp or args.nproc
    out_root = Path(os.environ.get("OUT", ROOT / "outputs" / "bench"))
    out_root.mkdir(parents=True, exist_ok=True)
    anchors = [a for a in args.anchors.split(",") if a]
    for point in args.points.split(","):
        S, memory = point.split(":")
        jobs = [] if args.no_ours else [lambda S=int(S), m=memory: run_ours(S, m, args, out_root)]
        jobs += [lambda S=int(S), a=a: run_anchor(S, a, args) for a in anchors]
        if args.order == "anchors-first" and not args.no_ours:
            jobs = jobs[1:] + jobs[:1]
        for job in jobs:
            try:
                res = job()
            except subprocess.TimeoutExpired as e:
                res = dict(S=int(S), error=f"timeout after {e.timeout} s")
            res["date"] = time.strftime("%Y-%m-%d %H:%M")
            print("RESULT " + json.dumps(res), flush=True)
            with open(out_root / "bench_train.jsonl", "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
