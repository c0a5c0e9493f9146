#!/usr/bin/env bash
# Multi-GPU proof on one host (2-8 H200s): exactness on NCCL, scaling, and ALST side by side.
#
#   NGPU=2 bash scripts/bench/bench_multigpu.sh exact scale alst
#
# Parts:
#   exact  tiny model fp32 (tight) and Llama-3.2-1B shape bf16, 3 steps at cp=1,2,..,NGPU: loss and grad_norm
#          per step must agree across layouts (fp32 rel 1e-5; bf16 rel 2e-2) -> $OUT/exact_*.json. With
#          LAYOUT_EXTRA=dist_backend=gloo (also for moe_exact) NGPU ranks share the GPUs there are, over gloo: the
#          layouts' numbers on fewer GPUs (docs/usage.md; 4 ranks on one H100: docs/benchmarks.md, 2026-12-06, eighth part)
#   scale  $MODEL (default Llama-3.1-8B shape, random init), ZeRO-3, bf16, cp=NGPU, S in $SEQS with memory
#          preset $MEMORY, or the S:memory list $POINTS; $STEPS steps (default 3); $EXTRA: more Hydra overrides
#          (e.g. model.attn_backend=fa4 logging.profile_step=3, whose op table gives the all-to-all time)
#   long   Llama-3.2-1B shape, one 1,048,576-token step at cp=NGPU (memory=long_context); ALST sp=2 took
#          428.6 s on two H200s (measured before this project's first session)
#   alst   DeepSpeed ALST sp=NGPU (../anchor-bench/alst_sp_sweep.py, Llama-3.2-1B shape), same S list, ZeRO stage
#          $ALST_ZERO (default 1, ALST's baseline configuration); run `MODEL=llama3_2_1b ... scale`
#          for our side of that comparison; $ALST_DEADLINE_S (default 500) bounds the sweep (1M at sp=2: ~470 s)
#   fit8b  whether the Llama-3.1-8B shape fits at $FIT_S tokens (default 4,194,304, past ALST's published 3.7M on
#          8 GPUs): one step with 4 of its 32 layers, memory=long_context, memory.offload_max_gib=$OFFLOAD_GIB
#          (default 56, for a 560 GiB host over 8 ranks). A full 32-layer step at 4M is about an hour on 8 H200s
#          (attention-bound), longer than a device session; the GPU peak of 4 layers is the working set, and
#          the 32-layer peak adds the layer inputs the cap leaves on the GPU (docs/memory.md)
#   moe_exact  MoE on NCCL: tiny_moe fp32 (rel 1e-5) and the 4-layer Qwen3-30B-A3B shape bf16 (rel 2e-2) at the cp:ep
#          layouts $MOE_LAYOUTS (default 2:2,2:4,4:4 at 4 GPUs; 2:2,1:2 at 2; 2:8,8:8,2:4 at 8) against world 1
#   moe_scale  ours, the 4-layer Qwen3-30B-A3B shape (or $MOE_MODEL), ZeRO-3, bf16, cp=$MOE_CP ep=$MOE_EP (default
#          NGPU, NGPU), S in $SEQS, moe=expert_recompute, per-phase times -> bench_train.jsonl
#   topo   nvidia-smi's GPU list and link matrix
# Needs .whl/ and .bench/anchor-bench as scripts/bench/bench_gpu.sh does. Results under $OUT.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/outputs/bench_multi}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
source scripts/bench/bench_site.sh
SEQS=${SEQS:-32768,65536,131072,262144}
for part in ${*:-exact scale alst}; do
  echo "=== $part $(date +%T)"
  case $part in
    exact)
      for spec in "tiny:fp32:1e-5" "llama3_2_1b:bf16:2e-2"; do
        IFS=: read model prec tol <<< "$spec"
        python3 scripts/bench/check_layouts.py --model "$model" --precision "$prec" --rtol "$tol" --ngpu "$NGPU" \
          --out "$OUT/exact_${model}_${prec}.json" ${LAYOUT_EXTRA:+--extra $LAYOUT_EXTRA}
      done ;;
    scale)   # ours, $MODEL (default the Llama-3.1-8B shape), cp = NGPU
      python3 scripts/bench/bench_train.py --model "${MODEL:-llama3_1_8b_shape}" --nproc "$NGPU" --steps "${STEPS:-3}" \
        --timeout 560 --points "${POINTS:-$(echo "$SEQS" | sed "s/,/:${MEMORY:-selective_tiled},/g"):${MEMORY:-selective_tiled}}" \
        ${EXTRA:-} ;;
    long)
      python3 scripts/bench/bench_train.py --model llama3_2_1b --nproc "$NGPU" --steps 1 --timeout 580 \
        --points 1048576:long_context ${EXTRA:-} ;;
    alst)    # the anchor: ALST sp = NGPU on its model (the Llama-3.2-1B shape); compare with MODEL=llama3_2_1b
      python3 .bench/anchor-bench/alst_sp_sweep.py --nproc "$NGPU" --seqs "$SEQS" --zero "${ALST_ZERO:-1}" \
        --deadline-s "${ALST_DEADLINE_S:-500}" ;;
    fit8b)
      python3 scripts/bench/bench_train.py --model llama3_1_8b_shape --nproc "$NGPU" --steps 1 --timeout 580 \
        --points "${FIT_S:-4194304}:long_context" model.attn_backend=fa4 model.arch.num_hidden_layers=4 \
        memory.offload_max_gib="${OFFLOAD_GIB:-56}" ;;
    moe_exact)
      case $NGPU in 2) def=2:2,1:2 ;; 8) def=2:8,8:8,2:4 ;; *) def=2:2,2:4,4:4 ;; esac
      for spec in "tiny_moe:fp32:1e-5:512" "qwen3_30b_a3b_4l:bf16:2e-2:4096"; do
        IFS=: read model prec tol seq <<< "$spec"
        python3 scripts/bench/check_layouts.py --model "$model" --precision "$prec" --rtol "$tol" --ngpu "$NGPU" \
          --ngpu-ref 1 --seq-len "$seq" --layouts "1:1,${MOE_LAYOUTS:-$def}" --out "$OUT/moe_exact_${model}_${prec}.json" \
          --extra moe.dispatcher=${MOE_DISPATCHER:-alltoall} moe.aux_loss_coef=0.01 ${LAYOUT_EXTRA:-}
      done ;;
    moe_scale)
      python3 scripts/bench/bench_train.py --model "${MOE_MODEL:-qwen3_30b_a3b_4l}" --nproc "$NGPU" --cp "${MOE_CP:-$NGPU}" \
        --steps "${STEPS:-3}" --timeout 560 --points "$(echo "$SEQS" | sed "s/,/:full_recompute,/g"):full_recompute" \
        parallelism.ep="${MOE_EP:-$NGPU}" moe=expert_recompute moe.dispatcher=${MOE_DISPATCHER:-alltoall} \
        deepspeed.master_weights=bf16 ${EXTRA:-} ;;
    topo) nvidia-smi -L; nvidia-smi topo -m ;;
    *) echo "unknown part $part" ;;
  esac
done
