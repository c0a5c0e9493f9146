#!/usr/bin/env python3
"""Packed SFT against unpacked-and-padded rows: real tokens per second through the engine, on chat-like lengths.

    # one H200, Llama-3.2-1B shape: packed into 32k and 128k rows, and the padded anchor, in one call
    python3 scripts/bench/bench_packing.py --rows 32768,131072
    # CPU smoke test
    python3 scripts/bench/bench_packing.py --model tiny --device cpu --precision fp32 --rows 1024,2048 --pad-seq 512 \
        --max-len 512 --median 60 --samples 300 --tokens-per-step 4096 --pad-micro 2 --steps 2

The samples: --samples lengths drawn from a lognormal (median --median tokens, sigma --sigma, clipped to
[--min-len, --max-len]; the defaults are a chat set's: median 600, a long tail to 16k), seeded by --seed, written
at run time as a JSONL of text (data=jsonl, format=text, never committed) under --data-dir. Each text is
n - 1 words that the shipped demo tokenizer (engine/demo_data/tokenizer, 512 entries) encodes as one token each,
and the loader appends eos, so a sample is exactly n tokens (checked here on the first samples).

Runs (scripts/train.py, one process group each, the same file, the same seed):
- packed, one per --rows R: data.pack=true data.seq_len=R: samples packed best-fit into rows of R tokens,
  documents masked from each other (model.attn_backend=sdpa: masks.py's exact torch path; flash-attn is not
  installed on the device image, so no varlen kernel);
- padded (the anchor): data.pack=false data.seq_len=--pad-seq (16384, the longest sample): one sample per row,
  right-padded to 16384 tokens, --pad-micro rows per micro-batch; the pads are computed (SDPA causal over the
  whole row) and carry no loss.
Every run takes --tokens-per-step row tokens per optimizer step (rows x row length; micro-batches of one row when
packed), so the optimizer's share of a step is the same. Throughput counts REAL tokens only: `tokens` of
metrics.jsonl (the non-masked targets of the step: every token of a document but its first, for packed and padded
rows alike) over step_time_s, median of the steps after the first. Row tokens/s (pads included) is reported too.
ALST with packing (DeepSpeed ALST packs only through flash-attn varlen) is reported as not run when flash_attn
does not import.

MFU: engine/run/train.py counts each row's attention as one causal sequence of the row's length, which for packed
rows is far more than is computed (a packed 128k step would show an impossible MFU and stop the run), so these runs
set logging.peak_tflops=1e9 (MFU ~0, not used here) and the engine's tflops_per_gpu is not reported.
Results: RESULT lines, and $OUT/pack_sft.jsonl; each run's folder under $OUT/pack_sft/.
"""
import argparse
import importlib.util
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
TOKENIZER = ROOT / "engine" / "demo_data" / "tokenizer"


def draw_lengths(args) -> list:
    rng = random.Random(args.seed)
    mu = math.log(args.median)
    return [min(args.max_len, max(args.min_len, round(rng.lognormvariate(mu, args.sigma))))
            for _ in range(args.samples)]


def one_token_words(tokenizer) -> list:
    """Words w whose ' w' the demo tokenizer encodes as exactly one token (ByteLevel BPE: 'Ġ' + letters)."""
    words = []
    for tok in tokenizer.get_vocab():
        w = tok[1:]
        if tok.startswith("Ġ") and w.isalpha() and len(w) > 1 and len(tokenizer(" " + w)["input_ids"]) == 1:
            words.append(w)
    return sorted(words)


def write_dataset(args, lengths, path: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    words = one_token_words(tok)
    rng = random.Random(args.seed + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            text = "".join(" " + rng.choice(words) for _ in range(n - 1))  # + the eos the loader appends = n
            if i < 5:
                got = len(tok(text, add_special_tokens=True)["input_ids"]) + 1
                assert got == n, f"sample {i}: {got} tokens, wanted {n}"
            f.write(json.dumps({"text": text}) + "\n")


def run(name, row_len, pack, rows_per_step, micro, args, data, out_root):
    out = out_root / name
    over = [f"model={args.model}", "data=jsonl", f"data.path={data}", f"data.tokenizer_path={TOKENIZER}",
            "data.format=text", f"data.seq_len={row_len}", f"data.pack={str(pack).lower()}", "data.overlong=drop",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={rows_per_step}",
            f"trainer.micro_batch_size={micro}", "trainer.warmup_steps=1", "trainer.save_at_end=false",
            "trainer.export_hf=false", "trainer.resume=false", "logging.progress_bar=false",
            "logging.phase_times=true", "logging.peak_tflops=1e9", "parallelism.cp=1", f"memory={args.memory}",
            f"precision={args.precision}", f"deepspeed={args.deepspeed}", f"device={args.device}",
            "model.attn_backend=sdpa", f"run.out_dir={out}"] + args.extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "scripts" / "train.py")] + over
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", f"timeout after {e.timeout} s"
    res = dict(variant=name, packed=pack, row_len=row_len, rows_per_step=rows_per_step, micro_batch=micro,
               model=args.model, memory=args.memory, precision=args.precision, wall_s=time.time() - t0, rc=rc,
               overrides=args.extra)
    m = re.search(r"packing efficiency ([0-9.]+)%", log)
    if m:
        res["pack_efficiency_logged"] = float(m.group(1)) / 100
    m = re.search(r"data: (data\[.*)", log)
    if m:
        res["data_summary"] = m.group(1)[:400]
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if rc != 0 or not rows:
        res["error"] = log[-4000:]
        return res
    timed = rows[1:] or rows
    step = statistics.median(r["step_time_s"] for r in timed)
    res.update(step_s=step, timed_steps=len(timed),
               real_tokens_per_s=statistics.median(r["tokens"] / r["step_time_s"] for r in timed),
               row_tokens_per_s=statistics.median(r["input_tokens"] / r["step_time_s"] for r in timed),
               real_fraction=sum(r["tokens"] for r in timed) / sum(r["input_tokens"] for r in timed),
               real_tokens_per_step=[r["tokens"] for r in timed], loss=rows[-1]["loss"],
               peak_alloc_gib=rows[-1]["peak_mem_gib"], peak_reserved_gib=rows[-1]["peak_reserved_gib"],
               **{k: statistics.median(r[k] for r in timed) for k in rows[-1] if k.startswith("time_")})
    return res


def emit(row, out_root):
    row["date"] = time.strftime("%Y-%m-%d %H:%M")
    print("RESULT " + json.dumps(row), flush=True)
    with open(out_root / "pack_sft.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32768,131072", help="packed row lengths")
    ap.add_argument("--pad-seq", type=int, default=16384, help="the padded anchor's row length (>= --max-len)")
    ap.add_argument("--pad-micro", type=int, default=2, help="padded rows per micro-batch")
    ap.add_argument("--tokens-per-step", type=int, default=131072, help="row tokens per optimizer step, every run")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--median", type=float, default=600)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is warm-up")
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--memory", default="full_recompute")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--deepspeed", default="zero3")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", default="", help="comma list of runs to do (packed_<R>, padded); default all")
    ap.add_argument("--data-dir", default="/tmp/pack_sft_data")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",") if x]
    if args.pad_seq < args.max_len or min(rows) < args.max_len:
        raise SystemExit("--pad-seq and every --rows must hold the longest sample (--max-len)")
    out_root = Path(os.environ.get("OUT", ROOT / "outputs" / "bench")) / "pack_sft"
    out_root.mkdir(parents=True, exist_ok=True)

    lengths = draw_lengths(args)
    data = Path(args.data_dir) / f"chat_lengths_seed{args.seed}_n{args.samples}.jsonl"
    write_dataset(args, lengths, data)
    from engine.data.packing import pack_rows  # the engine's own packing, to report what each row length gives
    srt = sorted(lengths)
    summary = dict(variant="dataset", path=str(data), samples=len(lengths), tokens=sum(lengths),
                   median=srt[len(srt) // 2], mean=sum(lengths) / len(lengths), p90=srt[int(0.9 * len(srt))],
                   p99=srt[int(0.99 * len(srt))], max=srt[-1], lognormal=dict(median=args.median, sigma=args.sigma),
                   padded_efficiency=sum(lengths) / (len(lengths) * args.pad_seq))
    for R in rows:
        n = len(pack_rows(lengths, R))
        summary[f"packed_{R}"] = dict(rows=n, efficiency=sum(lengths) / (n * R))
    emit(summary, out_root)

    only = {x for x in args.only.split(",") if x}
    jobs = [(f"packed_{R}", R, True, max(1, args.tokens_per_step // R), 1) for R in rows]
    pad_rows = max(args.pad_micro, args.tokens_per_step // args.pad_seq // args.pad_micro * args.pad_micro)
    jobs.append(("padded", args.pad_seq, False, pad_rows, args.pad_micro))
    results = {}
    for name, row_len, pack, per_step, micro in jobs:
        if only and name not in only:
            continue
        res = run(name, row_len, pack, per_step, micro, args, data, out_root)
        results[name] = res
        emit(res, out_root)
    anchor = results.get("padded", {}).get("real_tokens_per_s")
    for name, res in results.items():
        if res.get("packed") and anchor and res.get("real_tokens_per_s"):
            emit(dict(variant="ratio", packed=name, anchor="padded", packed_real_tokens_per_s=res["real_tokens_per_s"],
                      padded_real_tokens_per_s=anchor, packed_over_padded=res["real_tokens_per_s"] / anchor),
                 out_root)
    # flash-attn 2's varlen entry point, not just the package: FA4 installs flash_attn/cute, which makes
    # `flash_attn` findable without flash-attn 2 (seen on the H200 with FA4 only)
    try:
        flash = hasattr(importlib.import_module("flash_attn"), "flash_attn_varlen_func")
    except Exception:  # not installed, or a broken build: no flash-attn 2 either way
        flash = False
    emit(dict(variant="alst_packed", status="not run",
              reason=("flash_attn imports here, but this script has no ALST packed-sequence anchor yet" if flash else
                      "flash-attn is not installed on this machine; ALST packs sequences only through flash-attn "
                      "varlen (its SDPA path needs monotonic position_ids), so it has no packed run to compare")),
         out_root)


if __name__ == "__main__":
    main()
