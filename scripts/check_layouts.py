#!/usr/bin/env python3
"""Exactness across layouts on real GPUs: the same run at cp = 1, 2, 4, ... NGPU must give the same loss
and grad_norm at every step (within --rtol), on the same global batch.

    python3 scripts/check_layouts.py --model tiny --precision fp32 --rtol 1e-5 --ngpu 2 --out exact.json
    python3 scripts/check_layouts.py --model tiny --precision fp32 --device cpu --ngpu 2   # CPU smoke test

Every layout runs scripts/train.py under torchrun with NGPU ranks (dp = NGPU / cp) and --steps steps.
Exits 1 if any step differs by more than --rtol (relative) from the cp=1 run.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_layout(cp, args, out_root):
    out = out_root / f"{args.model}_{args.precision}_cp{cp}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ngpu}",
           str(ROOT / "scripts" / "train.py"), f"model={args.model}", "data=synthetic", f"data.seq_len={args.seq_len}",
           f"parallelism.cp={cp}", f"precision={args.precision}", f"trainer.max_steps={args.steps}",
           f"trainer.global_batch_size={args.ngpu}", "trainer.warmup_steps=1", "trainer.save_at_end=false",
           "trainer.export_hf=false", "trainer.resume=false", "logging.progress_bar=false",
           f"device={args.device}", f"run.out_dir={out}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"cp={cp} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_root = Path(args.out).parent if args.out else ROOT / "outputs" / "check_layouts"
    cps = [cp for cp in (1, 2, 4, 8) if cp <= args.ngpu and args.ngpu % cp == 0]
    runs = {cp: run_layout(cp, args, out_root) for cp in cps}
    ref = runs[1]
    worst = 0.0
    for cp, rows in runs.items():
        for r, g in zip(ref, rows):
            for key in ("loss", "grad_norm"):
                worst = max(worst, abs(g[key] - r[key]) / abs(r[key]))
    report = {"model": args.model, "precision": args.precision, "ngpu": args.ngpu, "rtol": args.rtol,
              "worst_rel_diff": worst, "ok": worst <= args.rtol,
              "runs": {cp: [{k: r[k] for k in ("step", "loss", "grad_norm", "tokens")} for r in rows]
                       for cp, rows in runs.items()}}
    text = json.dumps(report, indent=1)
    print(text)
    print("CHECK " + json.dumps({k: report[k] for k in ("model", "precision", "ngpu", "rtol", "worst_rel_diff", "ok")}))
    if args.out:
        Path(args.out).write_text(text)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
