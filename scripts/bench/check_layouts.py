#!/usr/bin/env python3
"""Exactness across layouts on real GPUs: the same run at cp = 1, 2, 4, ... NGPU must give the same loss
and grad_norm at every step (within --rtol), on the same global batch.

    python3 scripts/bench/check_layouts.py --model tiny --precision fp32 --rtol 1e-5 --ngpu 2 --out exact.json
    python3 scripts/bench/check_layouts.py --model tiny --precision fp32 --device cpu --ngpu 2   # CPU smoke test
    # MoE: layouts as cp:ep pairs, against the first one (world 1 when --ngpu-ref 1)
    python3 scripts/bench/check_layouts.py --model tiny_moe --layouts 1:1,2:2,2:4,4:4 --ngpu 4 --ngpu-ref 1 \
        --extra moe.aux_loss_coef=0.1 moe.dispatcher=alltoall

Every layout runs scripts/train.py under torchrun with NGPU ranks (dp = NGPU / cp) and --steps steps.
Exits 1 if any step differs by more than --rtol (relative) from the cp=1 run.
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_layout(cp, args, out_root, ep=1, ngpu=None):
    ngpu = ngpu or args.ngpu
    out = out_root / f"{args.model}_{args.precision}_w{ngpu}_cp{cp}_ep{ep}"
    # each rank's output in its own file: torchrun's console tail holds its own traceback, not the failing rank's
    # (beside the run folder, which train.py keeps to itself)
    logs = out_root / f"{out.name}_rank_logs"
    shutil.rmtree(logs, ignore_errors=True)  # this run's logs only: torchrun adds a folder per run
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ngpu}",
           "--log-dir", str(logs), "--redirects", "3",
           str(ROOT / "scripts" / "train.py"), f"model={args.model}", "data=synthetic", f"data.seq_len={args.seq_len}",
           f"parallelism.cp={cp}", f"precision={args.precision}", f"trainer.max_steps={args.steps}",
           f"trainer.global_batch_size={args.ngpu}", "trainer.warmup_steps=1", "trainer.save_at_end=false",
           "trainer.export_hf=false", "trainer.resume=false", "logging.progress_bar=false",
           f"device={args.device}", f"run.out_dir={out}", f"parallelism.ep={ep}"] + args.extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        ranks = "\n".join(f"--- {f.relative_to(logs)}:\n{f.read_text(errors='replace')[-1500:]}"
                          for f in sorted(logs.rglob("stderr.log")))
        raise SystemExit(f"cp={cp} ep={ep} on {ngpu} ranks failed:\n{p.stderr[-1500:]}\n"
                         f"each rank's stderr, its end:\n{ranks}")
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
    ap.add_argument("--layouts", default=None, help="cp:ep pairs (default: cp = 1, 2, 4, 8 dividing --ngpu, ep 1)")
    ap.add_argument("--ngpu-ref", type=int, default=None, help="ranks of the first layout (e.g. 1: world 1)")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    args = ap.parse_args()
    out_root = Path(args.out).parent if args.out else ROOT / "outputs" / "check_layouts"
    if args.layouts:
        pairs = [tuple(int(x) for x in item.split(":")) for item in args.layouts.split(",")]
    else:
        pairs = [(cp, 1) for cp in (1, 2, 4, 8) if cp <= args.ngpu and args.ngpu % cp == 0]
    runs = {}
    for i, (cp, ep) in enumerate(pairs):
        ngpu = args.ngpu_ref if (i == 0 and args.ngpu_ref) else args.ngpu
        runs[f"w{ngpu}_cp{cp}_ep{ep}"] = run_layout(cp, args, out_root, ep, ngpu)
    ref = next(iter(runs.values()))
    worst = 0.0
    for rows in runs.values():
        for r, g in zip(ref, rows):
            for key in ("loss", "grad_norm", "moe_aux_loss"):
                if r.get(key) is not None:
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
