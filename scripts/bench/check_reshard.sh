#!/usr/bin/env bash
# Resume on more GPUs, on real GPUs (NCCL). A 1-rank run is stopped after step 2 and resumed on $NGPU ranks,
# which re-partitions its checkpoint (engine/checkpoints/reshard.py); its steps 3-4 are compared with an uninterrupted
# $NGPU-rank run, and the checkpoint is exported (scripts/export_hf.py). Two 1-rank sources: the default, which
# runs ZeRO-2 on one rank, and deepspeed.offload_param=true, which keeps it on ZeRO-3. The tiny model in fp32,
# so the tolerance is fp32's (rel 1e-5).
#
#   NGPU=2 bash scripts/bench/check_reshard.sh        # results under $OUT
set -eu
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/outputs/check_reshard}
mkdir -p "$OUT"
source scripts/bench/bench_site.sh
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
COMMON="model=tiny data=synthetic data.seq_len=4096 data.num_samples=64 precision=fp32 parallelism.cp=$NGPU
  trainer.max_steps=4 trainer.global_batch_size=2 trainer.warmup_steps=1 trainer.export_hf=false
  logging.progress_bar=false"
run() { torchrun --standalone --nproc_per_node "$1" scripts/train.py $COMMON "${@:2}"; }
run "$NGPU" run.out_dir="$OUT/ref"
for src in zero2 zero3; do
  [ $src = zero3 ] && offload=true || offload=false
  run 1 run.out_dir="$OUT/$src" parallelism.cp=1 deepspeed.offload_param=$offload trainer.save_every=2 \
    trainer.stop_after_steps=2
  run "$NGPU" run.out_dir="$OUT/$src" > "$OUT/resume_$src.txt" 2>&1 || { tail -40 "$OUT/resume_$src.txt"; exit 1; }
  grep -E "re-partition|resumed from" "$OUT/resume_$src.txt" || true
  python3 scripts/export_hf.py "$OUT/$src" --out "$OUT/${src}_export" > /dev/null
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = lambda name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
for src in ("zero2", "zero3"):
    worst = 0.0 if len(rows(src)) == len(rows("ref")) == 4 else float("inf")
    for got, ref in zip(rows(src), rows("ref")):
        rel = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm"))
        worst = max(worst, rel)
        print(f"{src} step {got['step']}: loss {got['loss']:.9f} vs {ref['loss']:.9f}, grad_norm "
              f"{got['grad_norm']:.9f} vs {ref['grad_norm']:.9f}, worst rel {rel:.1e}")
    print(f"RESHARD from 1-rank {src}: worst rel {worst:.1e} (tolerance 1e-5): {'ok' if worst < 1e-5 else 'FAILED'}")
    print("  universal copy left behind:", (out / src / "checkpoints" / "universal").exists())
    print("  export:", sorted(p.name for p in (out / f"{src}_export").iterdir()))
PY
