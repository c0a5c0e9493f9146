#!/usr/bin/env python3
"""Plot tokens/s per GPU and peak memory against sequence length from bench_train.jsonl files.

    python3 scripts/bench/plot_bench.py docs/results/h200-2026-11-29/bench_train.jsonl --out docs/bench_1gpu.png
    python3 scripts/bench/plot_bench.py docs/results/h200x2-2026-11-30/side_by_side.jsonl --out docs/bench_2gpu.png \
        --title "Llama-3.2-1B shape, two H200s (cp = sp = 2), bf16, one sequence per step"

Our series are split by attention backend (model.attn_backend=...; sdpa when a run names none, as bench_train
pins it).
"""
import argparse
import json
from pathlib import Path


def load(paths):
    rows = []
    for p in paths:
        rows += [json.loads(x) for x in Path(p).read_text().splitlines() if x.strip()]
    return [r for r in rows if "error" not in r]


def series(rows):
    out = {}
    for r in rows:
        name = {"ours": "ds_ulysses_ext", "hf": "stock HF", "alst": "DeepSpeed ALST"}[r["variant"]]
        # bench_train pins sdpa unless a run names its backend
        backend = [o.split("=", 1)[1] for o in r.get("overrides") or [] if o.startswith("model.attn_backend=")]
        if r["variant"] == "ours":
            name += f" ({(backend or ['sdpa'])[0]})"
        tps = r.get("tokens_per_s_per_gpu") or r.get("tokens_per_s")
        mem = r.get("peak_alloc_gib")
        out.setdefault(name, []).append((r["S"], tps, mem, r.get("memory", "")))
    return {k: sorted(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Llama-3.2-1B shape, one H200, bf16, one sequence per step")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, pts in series(load(args.files)).items():
        xs = [p[0] / 1024 for p in pts]
        a1.plot(xs, [p[1] for p in pts], marker="o", label=name)
        a2.plot(xs, [p[2] for p in pts], marker="o", label=name)
        for x, p in zip(xs, pts):  # our points say which memory policy ran there
            if p[3]:
                a2.annotate(p[3], (x, p[2]), textcoords="offset points", xytext=(4, -10), fontsize=6)
    a1.set_yscale("log")  # 16k to 1M spans 20x in tokens/s
    for ax, label in ((a1, "tokens/s per GPU"), (a2, "peak allocated GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (k tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a2.axhline(139.8, color="grey", ls="--", lw=0.8)
    a1.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
