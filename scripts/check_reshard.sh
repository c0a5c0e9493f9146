#!/usr/bin/env bash
# Resume on more GPUs, on real GPUs (NCCL): a 1-rank ZeRO-3 run (deepspeed.offload_param=true keeps one rank on
# ZeRO-3) is stopped after step 2, then resumed on $NGPU ranks, which re-partitions its checkpoint
# (engine/reshard.py); its steps 3-4 are compared with an uninterrupted $NGPU-rank run, and the checkpoint is
# exported (scripts/export_hf.py). The tiny model in fp32, so the tolerance is fp32's (rel 1e-5).
#
#   NGPU=2 bash scripts/check_reshard.sh        # results under $OUT
set -eu
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/outputs/check_reshard}
mkdir -p "$OUT"
source scripts/bench_site.sh
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
COMMON="model=tiny data=synthetic data.seq_len=4096 data.num_samples=64 precision=fp32 parallelism.cp=$NGPU
  trainer.max_steps=4 trainer.global_batch_size=2 trainer.warmup_steps=1 trainer.export_hf=false
  logging.progress_bar=false"
run() { torchrun --standalone --nproc_per_node "$1" scripts/train.py $COMMON "${@:2}"; }
run "$NGPU" run.out_dir="$OUT/ref"
run 1 run.out_dir="$OUT/moved" parallelism.cp=1 deepspeed.offload_param=true trainer.save_every=2 \
  trainer.stop_after_steps=2
run "$NGPU" run.out_dir="$OUT/moved" > "$OUT/resume_log.txt" 2>&1 || { tail -40 "$OUT/resume_log.txt"; exit 1; }
grep -E "re-partition|resumed from" "$OUT/resume_log.txt" || true
python3 scripts/export_hf.py "$OUT/moved" --out "$OUT/moved_export" > /dev/null
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = lambda name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
worst = 0.0 if len(rows("moved")) == len(rows("ref")) == 4 else float("inf")
for got, ref in zip(rows("moved"), rows("ref")):
    rel = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm"))
    worst = max(worst, rel)
    print(f"step {got['step']}: loss {got['loss']:.9f} vs {ref['loss']:.9f}, grad_norm {got['grad_norm']:.9f} vs "
          f"{ref['grad_norm']:.9f}, worst rel {rel:.1e}")
print(f"RESHARD worst rel {worst:.1e} (tolerance 1e-5): {'ok' if worst < 1e-5 else 'FAILED'}")
print("universal copy left behind:", (out / "moved" / "checkpoints" / "universal").exists())
print("export:", sorted(p.name for p in (out / "moved_export").iterdir()))
PY
