#!/usr/bin/env bash
# Single-GPU benchmark session: our engine and the anchors (../anchor-bench, copied to .bench/) side by side.
#
#   bash scripts/bench/bench_gpu.sh attn train_short            # parts, in the order given
#
# Parts:
#   attn         ulysses_attention (group of 1) vs the backend directly, bf16 Hq32/Hkv8 D128, 32k + 128k
#   train_short  Llama-3.2-1B shape, 16k/32k/64k: ours (full recompute, ZeRO-3) and stock HF (anchor 'hf');
#                $EXTRA as for train_long (e.g. deepspeed.master_weights=bf16: the anchor's bf16 optimizer states);
#                $SHORT_POINTS replaces the S:memory list
#   profile_16k  one step of ours at $PROF_POINT (default 16384:full_recompute; $PROF_DS the deepspeed preset, default
#                zero3) under torch.profiler (logging.profile_step, engine/observe/profile.py; $EXTRA as above): the op table by GPU time is kept as $OUT/0_profile_16k.txt, and the per-phase breakdown
#                of the trace (scripts/bench/trace_phases.py: host ops, GPU busy and idle time) printed and kept as
#                $OUT/0_phases_16k.txt
#   memory_16k   step $MEM_STEP (default 2) of 3 at 16k of ours (full_recompute, bf16 master weights, model.kernels=liger; $MEM_POINT, $EXTRA) under
#                the CUDA allocator's history (logging.memory_snapshot_step, engine/observe/memory_snapshot.py): what is
#                alive at the step's peak, by the line that allocated it, printed and kept as $OUT/0_memory_16k.txt
#   train_long   $LONG_POINTS (S:memory, default 128k and 256k with except_attention): ours and ALST (anchor 'alst')
#                $EXTRA: more Hydra overrides for our runs (e.g. model.attn_backend=fa4); $ANCHORS (default alst)
#   long_equal   the README's rows against ALST + Liger at 128k and 256k ($LONG_POINTS to change them): ours at those
#                rows' settings (except_attention_offload_tiled, memory.offload_activations=true, bf16 master weights;
#                $EXTRA more, e.g. model.attn_backend=fa4 with the anchor's --attn fa4: ANCHORS=alst+liger+fa4), then
#                ALST + Liger. Without the two overrides ours ran 1.9x the memory at the same speed (2026-12-06)
#   site_fa4     pip-install the FA4 wheels of .fa4w/ (flash-attn-4, nvidia-cutlass-dsl meta/base/core, quack-kernels,
#                apache-tvm-ffi, torch-c-dlpack-ext, einops) into the site folder; before site_cu13 (pip --upgrade
#                replaces whole top-level folders)
#   stash_cu13   copy .fa4a/cu13.tar.xz.part-* (the first part of nvidia-cutlass-dsl-libs-cu13's files, xz, split:
#                61 MiB in all; the wheel is 88 MiB, over the 64 MiB carry limit with the tree) to /tmp/fa4a, which
#                outlives the call on a warm machine. FA4 recipe: call 1 carries [.fa4a]: `stash_cu13`; call 2
#                carries [.whl, .fa4w, .bench, .fa4b] (the other parts): `site_fa4 site_cu13 fa4 ...` (that order:
#                pip --upgrade replaces whole top-level folders, so installing the wheels after the unpack would
#                delete it).
#   site_cu13    unpack the cu13 archive (its parts from /tmp/fa4a/, .fa4a/ and .fa4b/) into the site folder
#   fa4          our attention with FlashAttention-4 vs SDPA (cuDNN), group of 1, D=64 (the 1B model) and D=128
#   fa4_tiles    FA4's own Hopper tile choice against variants, backward then forward, at the 1B model's attention shape
#                (scripts/bench/bench_fa4_tiles.py; $TILE_SEQS, default 16384,65536); $OUT/fa4_tiles.jsonl. About 1 min
#   train_512k   one 512k step of ours (memory=except_attention_tiled) and of ALST (its measured maximum), no warm-up
#   train_1m     one 1,048,576-token step of ours (memory=long_context); about 14 min at the measured 256k rate,
#                which is over the device's 10-minute command limit on one H200
#   moe_block    the MoE block, Qwen3-30B-A3B shape, bf16 fwd+bwd at 16k and 64k tokens: ours (scripts/bench/bench_moe.py,
#                recompute none / experts / experts + offload) and the anchors, HF's grouped_mm block (moe_bench.py)
#                and Liger's fused experts ($MOE_ANCHORS, default grouped_mm,liger; Liger's Triton autotune of its
#                fused MoE kernel took over 170 s on a fresh machine on 2026-12-03: give the call 5 minutes)
#   kernels_short  Llama-3.2-1B shape at $SHORT_POINTS (default 16k and 32k, full_recompute, bf16 master weights): ours
#                with each model.kernels of $KERNELS (default "liger none"; $DS: the deepspeed preset, default zero3, e.g.
#                zero0), then HF + Liger ($SHORT_ANCHORS)
#   equal_memory the Llama-3.2-1B shape at HF + Liger's memory, one GPU: ours with deepspeed=zero0 (bf16 master weights,
#                model.kernels=liger) at $EQ_POINTS (default 16k/32k/64k, except_attention_offload: attention is never
#                recomputed, its saved tensors and the layer inputs, memory.offload_activations=true, go to pinned host
#                memory) for each attention backend of $EQ_BACKENDS (default "sdpa fa4": fa4 after the FA4 recipe's
#                site_fa4 site_cu13), then HF + Liger at the same lengths. About 8 min
#   optimizer    deepspeed=zero0's optimizer phase alone on $OPT_MODEL's parameter shapes (default qwen3_30b_a3b_4l, 3.1B
#                bf16 parameters): the gradient norm, torch's fused AdamW, the Triton AdamW step and all of ClippingAdamW.step,
#                each against a copy of as many bytes (scripts/bench/bench_optimizer.py); $OUT/optimizer.jsonl. About 40 s
#   loss_head    the loss head alone at 16k and 32k tokens, Llama-3's vocabulary, bf16 forward + backward: ours (Triton
#                rows, and torch's) against Liger-Kernel's fused linear cross-entropy (bf16 and fp32 weight-gradient
#                accumulation), with each one's weight-gradient error against fp32 (scripts/bench/bench_loss.py; $LOSS_ARGS:
#                more arguments, e.g. --vocab 151936 --chunks 0,2048); $OUT/loss_head.jsonl
#   track_loss   $TRACK_STEPS (default 50) bf16 steps of $TRACK_MODEL (default llama3_2_1b; $TRACK_DS the deepspeed preset,
#                default zero3) at $TRACK_POINT (default 8192:full_recompute)
#                with model.kernels=liger and =none, the same data and seed, $TRACK_ARGS (default trainer.lr=1e-4: at
#                the default 1e-3 this random-init model's bf16 loss climbs, and any rounding difference grows), and a
#                control (eager, loss chunks of 1024: rounding only): the per-step loss of the fused run and of the
#                control against the eager one (max, mean, last absolute difference); $OUT/track_loss_<run>.jsonl
#   moe_equal    the 4-layer Qwen3-30B-A3B shape at HF + Liger's memory (docs/benchmarks.md AW): ours with deepspeed=zero0,
#                bf16 master weights, the optimizer step in backward and $MOE_EQ_BACKEND (default fa4: after the FA4 recipe's
#                site_fa4 site_cu13), 16k `none` and 32k `none` with moe.recompute=experts, then HF + Liger on the same
#                attention backend (checkpointed; $MOE_ANCHOR_ARGS more anchor arguments, e.g. --no-ckpt) at both
#                lengths in the same call (about 5.5 min on a machine kept warm; give a fresh one the whole 10 minutes)
#   dense_equal  the Llama-3.2-1B shape against HF + Liger as docs/benchmarks.md BB measured it: ours with deepspeed=zero0,
#                bf16 master weights, the optimizer step in backward and FA4 (after the FA4 recipe's site_fa4 site_cu13),
#                without the phase syncs (bench_train.py --no-phase-times), `none` at 16k/32k/64k and
#                except_attention_offload at 16k/32k, then HF + Liger at 16k/32k/64k; $OUT/dense_equal.jsonl. About 6 min
#   moe_short    the 4-layer Qwen3-30B-A3B shape at $MOE_POINTS (default 16384:none): ours with each of $KERNELS ($DS), then
#                HF + Liger (moe_model_bench.py --liger) at $MOE_HF_SEQS: that anchor alone takes over 4 min on a fresh
#                machine (HF's host init of 3.1B parameters, then Liger's fused-MoE kernel compiled and autotuned):
#                give it a call of its own
#   moe_train    training steps of the 4-layer Qwen3-30B-A3B shape: ours ($MOE_POINTS, S:memory, bf16 master weights,
#                $MOE_EXTRA, default moe=expert_recompute) and stock HF (moe_model_bench.py) at $MOE_HF_SEQS
#   mla_train    training steps of a reduced-depth MLA shape, $MLA_MODEL (default glm4_moe_lite_4l: GLM-4.7-Flash's
#                first 4 layers; deepseek_v3_2l: DeepSeek-V3's first dense and one MoE layer): ours ($MLA_POINTS, S:memory,
#                default 32768:full_recompute,131072:long_context; bf16 master weights, moe.dispatcher=alltoall,
#                $MLA_EXTRA) and stock HF on the same preset (scripts/bench/hf_moe_bench.py: SDPA, grouped_mm experts, HF
#                gradient checkpointing, fused AdamW on bf16 parameters) at $MLA_HF_SEQS (default 32768,131072: 128k
#                is expected to run out of memory, reported as status oom); HF's lines also in $OUT/mla_train_hf.jsonl
#   mla_liger    HF + Liger-Kernel on $MLA_MODEL (default deepseek_v3_2l) at $MLA_HF_SEQS (scripts/bench/hf_moe_bench.py --liger: the family's Liger patch
#                function; Liger 0.8.5 has DeepSeek-V3's, not GLM-4-MoE-Lite's); $OUT/mla_train_hf_liger.jsonl
#   train_1m_4l  the same 1M-token step with 4 of the 16 layers: GPU memory is set by one layer's working set
#                plus offloaded inputs (host), so this shows whether 1M fits; time scales ~linearly with layers
#   attn_features  attention features at 128k, bf16 Hq32/Hkv8 D64, fwd+bwd, against one full causal SDPA (cuDNN) call
#                in the same process (scripts/bench/bench_attn_features.py; an exactness check of the simulation first):
#                ring.py's per-block kernels (ring_blocks.py, as shipped) + fp32 merge at ring 2 and 4 simulated on
#                one GPU (rank 0's work x ring size) and the same blocks through SDPA (a projection), then sliding
#                windows 4096 and 128 (and 128 + sinks) through backends.local_attention (flash_varlen.py on the GPU)
#                and masks.py's torch path; $ATTN_PARTS replaces the parts (ring,window; ring_window adds ring.py
#                with a window, documents a 128k row of packed chat-like documents); $ATTN_ARGS: more arguments
#                (e.g. --backend fa4); $OUT/attn_features.jsonl. About 1 min
#   pack_sft     packed SFT, Llama-3.2-1B shape: chat-like lengths (lognormal, median 600, clipped to 16..16384)
#                packed into 32k and 128k rows vs one sample per padded 16k row, real tokens/s through
#                scripts/train.py (scripts/bench/bench_packing.py; $PACK_ARGS: more arguments); $OUT/pack_sft.jsonl and
#                the runs' folders under $OUT/pack_sft/. About 2-2.5 min
#   passkey      the passkey curriculum on one GPU (docs/retrieval.md): the stages of $PK_STAGES in order, each
#                `stage:minutes` (default "256:1.5 1k:2.3 32k:4"; then "128k:3.2" in a second call, as the
#                machine keeps outputs/ while warm), experiment=llama1b_1gpu_passkey_<stage> cut by
#                trainer.max_minutes, each reading the previous stage's export; $PK_ARGS: more overrides for every
#                stage; $PK_TAG: a suffix to every stage's run name, each stage reading the tagged previous
#                stage's export (a second chain beside the first, e.g. PK_TAG=_fp8 PK_ARGS=precision=fp8). Each stage's metrics.jsonl, retrieval.json and .png go to $OUT as one tar (fewer files);
#                a stage that fails stops the chain (the next would read a missing or an earlier call's export)
#   hybrid_train training steps of a reduced-depth hybrid linear-attention shape, $HYB_MODEL (default qwen3_5_35b_a3b_4l:
#                Qwen3.5-35B-A3B's first 4 layers; qwen3_5_9b_4l: the dense Qwen3.5-9B's): ours ($HYB_POINTS, S:memory,
#                default 32768:full_recompute,131072:full_recompute; bf16 master weights, SDPA, $HYB_EXTRA, default
#                moe.dispatcher=alltoall: set it empty for a dense model), then stock HF on the same preset (scripts/bench/hf_moe_bench.py: SDPA, HF checkpointing) at
#                $HYB_HF_SEQS (default 32768,131072) with its torch delta rule, and, where $FLA_SITE holds fla-core, HF
#                with fla's kernels at the first of them (ours sees fla there too: model.linear_attn_kernel=auto);
#                $HYB_LIGER=1 adds HF + Liger (Liger 0.8.5 patches qwen3_5, qwen3_5_moe and qwen3_next);
#                $OUT/hybrid_train.jsonl
#   fp8_short    precision=fp8 against our own bf16 at the same settings, and HF + Liger + torchao's float8 (the anchor an
#                HF user can assemble; model_bench.py --fp8, each decoder layer compiled): $MODEL (default llama3_2_1b;
#                $ANCHOR_SHAPE e.g. "--shape llama8b --layers 8" to match llama3_1_8b_shape with
#                model.arch.num_hidden_layers=8 in $EXTRA) at $FP8_POINTS (default 16384:none,32768:none; ours zero0,
#                bf16 master weights, Liger's kernels, no clipping, the step in backward, $EXTRA), ours bf16 then
#                fp8 with each of $FP8_RECIPES (default $FP8_RECIPE, default tensorwise; e.g. "tensorwise delayed")
#                and each of $FP8_LINEARS (default "mlp all"), and $FP8_COMPILE (default auto; e.g. regions: q/k/v as
#                one region under fp8.linears=all), then the anchor without checkpointing at the same lengths
#                (--fp8 $FP8_ANCHOR_RECIPE, default $FP8_RECIPE or tensorwise: the anchor has no delayed recipe);
#                $OUT/fp8_short.jsonl
#   fp8_pairs    precision=fp8 against our bf16, alternated $FP8_PAIRS times (default 2: bf16, fp8, bf16, fp8) at
#                $FP8_PAIR_POINT (default 32768:none; $MODEL, $EXTRA as for fp8_short; fp8.linears=$FP8_LINEARS, default
#                all; fp8.recipe=$FP8_RECIPE, default delayed): a ratio whose margin is smaller than the bf16 step's
#                drift between calls (0.8% on the 1B shape at 32k) read from interleaved runs; $OUT/fp8_pairs.jsonl
#   fp8_equal    precision=fp8 at the FP8 anchor's checkpointed memory: ours (zero0, bf16 master weights, Liger, no clipping,
#                the step in backward, memory.offload_activations=true) in bf16 and in fp8 ($FP8_RECIPE, default tensorwise)
#                at $FP8_EQ_POINTS (default 16k and 32k, except_attention_offload; $MODEL, $EXTRA as for fp8_short), then
#                model_bench.py --liger --fp8 $FP8_ANCHOR_RECIPE (default $FP8_RECIPE; torchao has no delayed recipe: with
#                FP8_RECIPE=delayed name tensorwise) with its gradient checkpointing at the same lengths ($ANCHOR_SHAPE, e.g.
#                "--attn fa4"); $OUT/fp8_equal.jsonl
#   fp8_tune     whether inductor's coordinate-descent tuning of its Triton block sizes speeds FP8's casts (the 8B
#                profile: the casts 29.6 ms of the step, the largest at about 75% of their bytes' bandwidth, the weights'
#                transposed casts 2.3x slower than their forward casts; docs/benchmarks.md, sixth part): one MLP compiled
#                whole (bench_fp8_mlp.py, bf16, fp8_mlp and the no-amax ceiling fp8_mlp_static, tensorwise, 16k) on the 8B layer and 1B shapes with
#                TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=0 and =1; $OUT/fp8_tune.jsonl. The values do not change (block
#                sizes only; amax is a max). A step with it: set the variable in front of fp8_short. About 3 min
#   fp8_tiling   whether inductor's N-d tiling speeds FP8's transposing casts (the 8B profile's largest cast kernel, 1.2 ms a
#                layer, writes a float8 copy and its transpose; pytorch/pytorch#133242 and #130015 describe the pattern):
#                one MLP compiled whole on the 8B layer shape at 16k, bf16 and fp8_mlp, tensorwise, with inductor's
#                defaults and with triton.prefer_nd_tiling=True ($TILING_CONFIGS: more `--inductor` settings, separated
#                by spaces), each with its 14 largest GPU kernels of one step (--profile); $OUT/fp8_tiling.jsonl, and
#                each run's generated FP8 code in $OUT/fp8_tiling_code_<n>/. About 3 min
#   fp8_delayed  whether delayed scaling could pay under inductor: one MLP compiled whole on the 8B layer and 1B shapes
#                at 16k, tensorwise: fp8_mlp (dynamic scaling), fp8_mlp_static (no amax at all) and fp8_mlp_delayed
#                (fixed scales, every operand's amax still taken, as delayed scaling must) and fp8_mlp_fused (the same
#                with our own Triton casts, each amax taken in its cast's pass: fp8.recipe=delayed's MLP, its e5m2
#                transposes as the first-use check chose), fp8_mlp_fused_bytes and fp8_mlp_fused_torch_t (those by the
#                byte-transpose kernel and by torch's copy after the casts), each
#                with its 16 largest kernels; $OUT/fp8_delayed.jsonl; $FP8_VARIANTS, $FP8_MODELS: fewer. About 3 min
#   fp8_casts    fp8.recipe=delayed's cast kernels alone on each tile (scripts/bench/bench_fp8_casts.py: the autotuner's
#                tiles and others, each checked against the torch path, GB/s against a copy of as many bytes) at
#                $CAST_SHAPES (default the 1B shape's [32768, 8192] and [32768, 2048]); $OUT/fp8_casts.jsonl
#   gpu_fp8      fp8.recipe=delayed's GPU test (tests/test_gpu_fp8_delayed.py: its Triton casts against its torch path)
#   fp8_track    FP8's accuracy against bf16: $FP8_TRACK_STEPS (default 500) steps of the Llama-3.2-1B shape on the shipped
#                corpus (data=demo, $FP8_TRACK_SEQ tokens a row, default 4096, lr $FP8_TRACK_LR, default 1e-4) in bf16,
#                in fp8 ($FP8_TRACK_ARGS more overrides, e.g. fp8.linears=all) and a rounding-only control (bf16, loss
#                chunks of 1024); the fp8 and control losses against bf16's (max, mean |dloss|) and each run's last
#                eval loss; $OUT/fp8_track_<run>.jsonl. $FP8_TRACK_KINDS: the runs (default "bf16 fp8 control";
#                also bf16_cp2 and fp8_cp2: world 2, parallelism.cp=2, ZeRO-3 (the default preset), both ranks on the
#                one GPU over gloo (dist_backend=gloo), each compared with its cp=1 run as well);
#                $FP8_TRACK_REF: a stored track (docs/results/*/fp8_track_losses.jsonl), compared against as well;
#                $FP8_TRACK_COMMON: overrides for every run (data.pack=true fills the rows, which the corpus's short
#                documents otherwise leave mostly padding: at cp=2 rank 1's half of a row is then padding only);
#                $FP8_TRACK_TAG: a suffix of the run names (two tracks side by side on one machine, each with its own $OUT)
#   gpu_matrix   the GPU exactness matrix (scripts/bench/gpu_matrix.py): every family at a small shape with its real head dims,
#                each model.kernels, every preset memory=auto can choose, zero0 / zero3, the optimizer step in backward,
#                packed documents, against the fp32 eager unsplit model; $OUT/gpu_matrix.jsonl; $MATRIX_ARGS: more
#                arguments, split at spaces (--families, --only: substrings of cell names without spaces, e.g. delayed,
#                --fa4, --fla, --fp8 (the dense families in FP8, judged against torchao's eager tensorwise on the same
#                linears), --reinstate-contiguity-bug for the self-check). Families
#                run in $MATRIX_JOBS processes side by side (default 0: one per 20 GiB of GPU memory, 3 on an H100, 7 on
#                an H200; 8 on an H100 ran out of memory in 54 cells, which --resume runs again); no cell starts after $MATRIX_DEADLINE_S (520) s, and the
#                rows collect in outputs/gpu_matrix.jsonl, which a warm machine keeps: run the part again in the next
#                call and it runs only the cells still missing (--resume). docs/gpu_matrix.md
#   auto_memory  memory=auto through scripts/train.py: the Llama-3.2-1B shape at $AUTO_POINTS (default 16k-128k) and the
#                4-layer Qwen3-30B-A3B shape at $AUTO_MOE_POINTS (default 16k, 32k), 3 steps each, with the choice logged
#   gpu_tests    the suite's GPU-only tests (skipped on CPU): tests/test_gpu_exactness.py (the MLA RMSNorm slice, selective
#                recompute with the default kernels), tests/test_gpu_paths.py (the fused ring kernel, the
#                packed and sink SDPA paths, bf16 against exact references), tests/test_gpu_loss_head.py, tests/test_gpu_offload.py
#                (the host link: settled reloads, reserved memory), GPT-OSS's grouped_mm experts and
#                deepspeed=zero0's optimizer on CUDA (ClippingAdamW and its Triton AdamW step against torch's fused one);
#                the log is $OUT/gpu_tests.txt. Run it before measuring those paths. After site_fa4 site_cu13
#                (the FA4 recipe below) it also checks FA4's varlen, window and sink arguments
#   bg_1m_start  the full 16-layer 1M step ($BG_POINT, default 1048576:long_context; $BG_ARGS: more bench_train
#                arguments) in the background, through scripts/bench/bench_bg.sh (BG=/tmp/bg1m), so it outlives the command
#   bg_1m_wait   wait up to $WAIT_S (default 570) s for that run, then pack it into $OUT (scripts/bench/bench_bg.sh wait);
#                call it again in the next command if it is still running (the machine must stay warm between)
# Needs: .whl/ (DeepSpeed 0.19.8 + hjson, pydantic(-core), annotated-types, typing-inspection, hydra-core,
# omegaconf, antlr4 wheels), .lig/ (Liger-Kernel 0.8.5, where the image lacks it) and .bench/anchor-bench; results
# under $OUT (default outputs/bench).
# FA4 inputs (ignored folders), rebuilt on a machine with PyPI: in .fa4w/, `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --pre` of
# flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
# nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels einops;
# cu13.tar.xz = the files of nvidia_cutlass_dsl_libs_cu13-4.8.1 (unzip the wheel, `tar c . | xz -9e`), cut by
# `split -b 30000000 -d cu13.tar.xz cu13.tar.xz.part-`: part-00 in .fa4a/, the others in .fa4b/.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/outputs/bench}
mkdir -p "$OUT"
source scripts/bench/bench_site.sh
# the settings our step runs with against HF + Liger and in the FP8 comparisons: bf16 master weights, Liger's kernels,
# no clipping, the optimizer step in backward (docs/benchmarks.md BB)
SAME_C="deepspeed.master_weights=bf16 model.kernels=liger trainer.grad_clip=0 trainer.optimizer_in_backward=true"
for part in ${*:-attn train_short train_long}; do
  echo "=== $part $(date +%T)"
  case $part in
    attn) python3 scripts/bench/bench_attention.py --seqs 32768,131072 --reps 10 | tee -a "$OUT/attn.jsonl" ;;
    train_short) python3 scripts/bench/bench_train.py --points ${SHORT_POINTS:-16384:full_recompute,32768:full_recompute,65536:full_recompute} \
                   --anchors hf --steps 4 ${EXTRA:-} ;;
    profile_16k) OUT=$OUT/prof python3 scripts/bench/bench_train.py --points ${PROF_POINT:-16384:full_recompute} --steps 4 \
                   logging.profile_step=4 ${EXTRA:-} --deepspeed ${PROF_DS:-zero3}
                 prof=$(ls -d "$OUT"/prof/ours_*_cp1* | head -1)  # _fp8: the precision suffix
                 cp "$prof/profile_step4_rank0.txt" "$OUT/0_profile_16k.txt"
                 python3 scripts/bench/trace_phases.py "$prof/profile_step4_rank0.json" --top 12 | tee "$OUT/0_phases_16k.txt" ;;
    memory_16k) OUT=$OUT/mem python3 scripts/bench/bench_train.py --points ${MEM_POINT:-16384:full_recompute} --steps 3 \
                  deepspeed.master_weights=bf16 model.kernels=liger logging.memory_snapshot_step=${MEM_STEP:-2} ${EXTRA:-} | cut -c1-400
                cp "$OUT"/mem/ours_*/memory_step${MEM_STEP:-2}_rank0.txt "$OUT/0_memory_16k.txt" && cat "$OUT/0_memory_16k.txt" ;;
    long_equal) python3 scripts/bench/bench_train.py \
                  --points ${LONG_POINTS:-131072:except_attention_offload_tiled,262144:except_attention_offload_tiled} \
                  --anchors "${ANCHORS-alst+liger}" --steps ${LONG_STEPS:-2} memory.offload_activations=true \
                  deepspeed.master_weights=bf16 ${EXTRA:-} ;;
    train_long) python3 scripts/bench/bench_train.py --points ${LONG_POINTS:-131072:except_attention,262144:except_attention} \
                  --anchors "${ANCHORS-alst}" --steps ${LONG_STEPS:-2} ${EXTRA:-} ;;
    site_fa4) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                .fa4w/*.whl && echo "FA4 wheels installed into $SITE" ;;
    stash_cu13) mkdir -p /tmp/fa4a && cp .fa4a/cu13.tar.xz.part-* /tmp/fa4a/ && echo "cu13 archive parts kept in /tmp/fa4a" ;;
    site_cu13) # the archive's parts, from wherever this call or an earlier one on this machine put them, in order
               parts=$(for f in /tmp/fa4a/cu13.tar.xz.part-* .fa4a/cu13.tar.xz.part-* .fa4b/cu13.tar.xz.part-*; do
                         [ -f "$f" ] && echo "$(basename "$f") $f"; done | sort -u -k1,1 | cut -d' ' -f2)
               cat $parts | tar -xJ -C "$SITE" && echo "cutlass-dsl cu13 libs unpacked into $SITE from" $parts ;;
    fa4_tiles) for d in bwd fwd; do python3 scripts/bench/bench_fa4_tiles.py $d --seqs ${TILE_SEQS:-16384,65536} 2>&1 \
                 | grep '^{' | tee -a "$OUT/fa4_tiles.jsonl"; done ;;
    fa4) python3 -c "import flash_attn.cute; print('flash_attn.cute imports')" 2>&1 | tail -2
         for d in 64 128; do
           python3 scripts/bench/bench_attention.py --seqs 32768,131072 --reps 5 --head-dim $d --backend sdpa | tee -a "$OUT/attn.jsonl"
           python3 scripts/bench/bench_attention.py --seqs 32768,131072 --reps 5 --head-dim $d --backend fa4 | tee -a "$OUT/attn.jsonl"
         done ;;
    train_512k) python3 scripts/bench/bench_train.py --points 524288:except_attention_tiled --anchors alst --steps 1 \
                  --timeout 420 ;;
    bg_1m_start) BG=/tmp/bg1m bash scripts/bench/bench_bg.sh start "python3 scripts/bench/bench_train.py --points \
                   ${BG_POINT:-1048576:long_context} --steps 1 --timeout 1700 ${BG_ARGS:-}" ;;
    bg_1m_wait) BG=/tmp/bg1m bash scripts/bench/bench_bg.sh wait "${WAIT_S:-570}" ;;
    moe_block) python3 scripts/bench/bench_moe.py --tokens 16384,65536 --modes ${MOE_MODES:-none,experts_g8,experts,experts_offload} \
                 | tee -a "$OUT/moe_block.jsonl"
               python3 .bench/anchor-bench/moe_bench.py --tokens 16384,65536 --impls ${MOE_ANCHORS:-grouped_mm,liger} \
                 | grep RESULT | tee -a "$OUT/moe_block.jsonl" ;;
    kernels_short) for k in ${KERNELS:-liger none}; do
                     python3 scripts/bench/bench_train.py --points ${SHORT_POINTS:-16384:full_recompute,32768:full_recompute} \
                       --steps 4 --deepspeed ${DS:-zero3} deepspeed.master_weights=bf16 model.kernels=$k ${EXTRA:-}; done
                   python3 scripts/bench/bench_train.py --points ${SHORT_POINTS:-16384:full_recompute,32768:full_recompute} \
                     --steps 4 --anchors ${SHORT_ANCHORS:-hf+liger} --order anchors-first --no-ours ;;
    equal_memory) pts=${EQ_POINTS:-16384:except_attention_offload,32768:except_attention_offload,65536:except_attention_offload}
                  for be in ${EQ_BACKENDS:-sdpa fa4}; do
                    python3 scripts/bench/bench_train.py --points $pts --steps 4 --deepspeed zero0 deepspeed.master_weights=bf16 \
                      model.kernels=liger memory.offload_activations=true model.attn_backend=$be ${EXTRA:-} | grep RESULT | cut -c1-900
                  done
                  python3 scripts/bench/bench_train.py --points $pts --steps 4 --anchors hf+liger --order anchors-first --no-ours \
                    | grep RESULT | cut -c1-900 ;;
    optimizer) python3 scripts/bench/bench_optimizer.py --model ${OPT_MODEL:-qwen3_30b_a3b_4l} | tee -a "$OUT/optimizer.jsonl" ;;
    loss_head) python3 scripts/bench/bench_loss.py --tokens ${LOSS_TOKENS:-16384,32768} ${LOSS_ARGS:-} | tee -a "$OUT/loss_head.jsonl" ;;
    track_loss) tp=${TRACK_POINT:-8192:full_recompute}
                for k in liger none control; do
                  # control: eager again, its loss head in chunks of 1024 instead of 2048: a change of bf16 rounding
                  # only, the noise floor the fused run's difference is read against
                  if [ $k = control ]; then kk="model.kernels=none trainer.loss_chunk_size=1024"; else kk="model.kernels=$k"; fi
                  python3 scripts/bench/bench_train.py --model ${TRACK_MODEL:-llama3_2_1b} --points $tp --steps ${TRACK_STEPS:-50} \
                    deepspeed.master_weights=bf16 ${TRACK_ARGS-trainer.lr=1e-4} $kk --deepspeed ${TRACK_DS:-zero3} \
                    | grep RESULT | cut -c1-300
                  cp "$OUT/ours_${TRACK_MODEL:-llama3_2_1b}_${tp%%:*}_${tp##*:}_cp1/metrics.jsonl" "$OUT/track_loss_$k.jsonl"
                done
                python3 -c "import json, sys
ref, *runs = ([r['loss'] for r in map(json.loads, open(f)) if 'loss' in r] for f in sys.argv[1:])
for name, a in zip(('liger', 'control'), runs):
    d = [abs(x - y) for x, y in zip(a, ref)]
    print(f'track_loss {name} vs none: {len(d)} steps, max |dloss| {max(d):.3e} (step {d.index(max(d)) + 1}), '
          f'mean {sum(d) / len(d):.3e}, last {d[-1]:.3e}; losses first {ref[0]:.5f} last {a[-1]:.5f} / {ref[-1]:.5f}')" \
                  "$OUT/track_loss_none.jsonl" "$OUT/track_loss_liger.jsonl" "$OUT/track_loss_control.jsonl" ;;
    moe_equal) C="deepspeed.master_weights=bf16 moe.dispatcher=alltoall model.kernels=liger trainer.grad_clip=0"
               C="$C trainer.optimizer_in_backward=true model.attn_backend=${MOE_EQ_BACKEND:-fa4}"
               python3 scripts/bench/bench_train.py --model qwen3_30b_a3b_4l --points 16384:none --steps 4 $C --deepspeed zero0 \
                 | grep RESULT | cut -c1-1200
               python3 scripts/bench/bench_train.py --model qwen3_30b_a3b_4l --points 32768:none --steps 4 $C moe.recompute=experts \
                 --deepspeed zero0 | grep RESULT | cut -c1-1200
               python3 -u .bench/anchor-bench/moe_model_bench.py --seqs 16384,32768 --layers 4 --liger \
                 --attn ${MOE_EQ_BACKEND:-fa4} ${MOE_ANCHOR_ARGS:-} 2>&1 | grep RESULT | tee -a "$OUT/moe_equal_hf_liger.jsonl" ;;
    dense_equal) C="$SAME_C model.attn_backend=fa4"
                 python3 scripts/bench/bench_train.py --steps 5 --no-phase-times --points 16384:none,32768:none,65536:none $C \
                   --deepspeed zero0 | grep RESULT | cut -c1-1200 | tee -a "$OUT/dense_equal.jsonl"
                 python3 scripts/bench/bench_train.py --steps 5 --no-phase-times --points \
                   16384:except_attention_offload,32768:except_attention_offload $C memory.offload_activations=true \
                   --deepspeed zero0 | grep RESULT | cut -c1-1200 | tee -a "$OUT/dense_equal.jsonl"
                 python3 scripts/bench/bench_train.py --steps 4 --points 16384:none,32768:none,65536:none --anchors hf+liger \
                   --order anchors-first --no-ours | grep RESULT | cut -c1-1200 | tee -a "$OUT/dense_equal.jsonl" ;;
    moe_short) for k in ${KERNELS:-liger none}; do
                 python3 scripts/bench/bench_train.py --model qwen3_30b_a3b_4l --points ${MOE_POINTS:-16384:none} --steps 4 \
                   --deepspeed ${DS:-zero3} deepspeed.master_weights=bf16 moe.dispatcher=alltoall model.kernels=$k ${MOE_EXTRA:-}; done
               python3 .bench/anchor-bench/moe_model_bench.py --seqs ${MOE_HF_SEQS:-16384} --layers 4 --liger \
                 | tee -a "$OUT/moe_train_hf_liger.jsonl" ;;
    moe_train) python3 scripts/bench/bench_train.py --model qwen3_30b_a3b_4l --points ${MOE_POINTS:-32768:full_recompute,131072:full_recompute} \
                 --steps 3 deepspeed.master_weights=bf16 ${MOE_EXTRA-moe=expert_recompute} moe.dispatcher=alltoall ${EXTRA:-}
               python3 .bench/anchor-bench/moe_model_bench.py --seqs ${MOE_HF_SEQS:-32768,65536} --layers 4 | tee -a "$OUT/moe_train_hf.jsonl" ;;
    mla_train) python3 scripts/bench/bench_train.py --model ${MLA_MODEL:-glm4_moe_lite_4l} \
                 --points ${MLA_POINTS:-32768:full_recompute,131072:long_context} --steps 3 deepspeed.master_weights=bf16 \
                 moe.dispatcher=alltoall ${MLA_EXTRA:-}
               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench/hf_moe_bench.py \
                 --model ${MLA_MODEL:-glm4_moe_lite_4l} --seqs ${MLA_HF_SEQS:-32768,131072} | tee -a "$OUT/mla_train_hf.jsonl" ;;
    hybrid_train) M=${HYB_MODEL:-qwen3_5_35b_a3b_4l}; F=${FLA_SITE:+$FLA_SITE:}
                  PYTHONPATH=$F$PYTHONPATH python3 scripts/bench/bench_train.py --model $M --steps 3 \
                    --points ${HYB_POINTS:-32768:full_recompute,131072:full_recompute} deepspeed.master_weights=bf16 \
                    model.attn_backend=sdpa ${HYB_EXTRA-moe.dispatcher=alltoall} | grep RESULT | cut -c1-1500 \
                    | tee -a "$OUT/hybrid_train.jsonl"
                  S=${HYB_HF_SEQS:-32768,131072}
                  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench/hf_moe_bench.py --model $M --seqs $S \
                    | grep RESULT | tee -a "$OUT/hybrid_train.jsonl"
                  if [ -n "${HYB_LIGER:-}" ]; then  # HF + Liger: Liger's patch function for the family
                    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench/hf_moe_bench.py --model $M \
                      --seqs $S --liger | grep RESULT | tee -a "$OUT/hybrid_train.jsonl"
                  fi
                  if [ -n "${FLA_SITE:-}" ]; then
                    PYTHONPATH=$FLA_SITE:$PYTHONPATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                      python3 scripts/bench/hf_moe_bench.py --model $M --seqs ${S%%,*} --reps 1 2>&1 | grep -E "RESULT|Error" \
                      | tail -5 | tee -a "$OUT/hybrid_train.jsonl"
                  fi ;;
    mla_liger) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench/hf_moe_bench.py --liger \
                 --model ${MLA_MODEL:-deepseek_v3_2l} --seqs ${MLA_HF_SEQS:-32768} | tee -a "$OUT/mla_train_hf_liger.jsonl" ;;
    train_1m) python3 scripts/bench/bench_train.py --points 1048576:long_context --steps 1 --timeout 580 ;;
    train_1m_4l) python3 scripts/bench/bench_train.py --points 1048576:long_context --steps 1 --timeout 580 \
                   model.arch.num_hidden_layers=4 ;;
    attn_features) python3 scripts/bench/bench_attn_features.py --parts "${ATTN_PARTS:-ring,window}" --check --budget-s 15 ${ATTN_ARGS:-} \
                     --out "$OUT/attn_features.jsonl" ;;
    pack_sft) python3 scripts/bench/bench_packing.py ${PACK_ARGS:-} ;;
    passkey) prev=""
             for st in ${PK_STAGES:-256:1.5 1k:2.3 32k:4}; do
               exp=llama1b_1gpu_passkey_${st%%:*}; name=$exp${PK_TAG:-}
               # with a tag, each stage after the first reads the tagged chain's previous export, not the plain one's
               from=${PK_TAG:+${prev:+model.path=outputs/$prev/hf_export}}
               python3 -m torch.distributed.run --standalone --nproc_per_node=1 scripts/train.py experiment=$exp \
                 run.name=$name $from trainer.max_minutes=${st##*:} logging.progress_bar=false ${PK_ARGS:-} \
                 > "$OUT/$name.log" 2>&1
               rc=$?; echo "$name rc=$rc"; grep -h '"retrieval_acc"' outputs/$name/metrics.jsonl | cut -c1-120 | tail -3
               tar cf "$OUT/$name.tar" -C outputs $name/metrics.jsonl $name/retrieval.json $name/retrieval.png \
                 $name/config.json 2>/dev/null
               # the next stage reads this one's export: after a failure it would train from a missing one or, on
               # a warm machine, from an earlier call's
               [ $rc -eq 0 ] || { echo "passkey: $name failed (rc=$rc, $OUT/$name.log); later stages not run"; break; }
               prev=$name
             done ;;
    gpu_tests) { python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_exactness.py tests/test_gpu_paths.py tests/test_gpu_loss_head.py \
                   tests/test_gpu_moe_kernels.py tests/test_gpu_projections.py tests/test_gpu_offload.py tests/test_gpu_fp8_delayed.py
                 python3 -m pytest -q -rs -p no:cacheprovider tests/test_moe_gpt_oss.py -k grouped
                 python3 -m pytest -q -rs -p no:cacheprovider tests/test_zero0.py -k "triton or cuda or in_backward and not follows"; } 2>&1 \
                 | tee "$OUT/gpu_tests.txt" | tail -30 ;;
    fp8_short) pts=${FP8_POINTS:-16384:none,32768:none}; M=${MODEL:-llama3_2_1b}
               python3 scripts/bench/bench_train.py --model $M --points $pts --steps 5 --no-phase-times --deepspeed zero0 \
                 $SAME_C ${EXTRA:-} | grep RESULT | cut -c1-1200 | tee -a "$OUT/fp8_short.jsonl"
               for r in ${FP8_RECIPES:-${FP8_RECIPE:-tensorwise}}; do for l in ${FP8_LINEARS:-mlp all}; do
                 python3 scripts/bench/bench_train.py --model $M --points $pts --steps 5 --no-phase-times --deepspeed zero0 \
                   --precision fp8 $SAME_C fp8.linears=$l fp8.recipe=$r fp8.compile=${FP8_COMPILE:-auto} \
                   ${EXTRA:-} | grep RESULT | cut -c1-1200 \
                   | tee -a "$OUT/fp8_short.jsonl"
               done; done
               for p in ${pts//,/ }; do  # FP8_ANCHORS=0: ours only (e.g. at a recompute preset, beside --no-ckpt's rows)
                 [ "${FP8_ANCHORS:-1}" = 0 ] && break
                 python3 .bench/anchor-bench/model_bench.py --seq ${p%%:*} --variant hf --liger \
                   --fp8 ${FP8_ANCHOR_RECIPE:-${FP8_RECIPE:-tensorwise}} --no-ckpt --warmup 1 --reps 3 ${ANCHOR_SHAPE:-} 2>&1 \
                   | grep -E "RESULT|Error" | tail -2 | tee -a "$OUT/fp8_short.jsonl"
               done ;;
    fp8_pairs) for i in $(seq ${FP8_PAIRS:-2}); do for p in bf16 fp8; do  # alternating: drift hits both sides
                 python3 scripts/bench/bench_train.py --model ${MODEL:-llama3_2_1b} --points ${FP8_PAIR_POINT:-32768:none} \
                   --steps 5 --no-phase-times --deepspeed zero0 --precision $p $SAME_C ${EXTRA:-} \
                   $([ $p = fp8 ] && echo fp8.linears=${FP8_LINEARS:-all} fp8.recipe=${FP8_RECIPE:-delayed}) \
                   | grep RESULT | cut -c1-1200 | tee -a "$OUT/fp8_pairs.jsonl"
               done; done ;;
    fp8_equal) pts=${FP8_EQ_POINTS:-16384:except_attention_offload,32768:except_attention_offload}; M=${MODEL:-llama3_2_1b}
               C="$SAME_C memory.offload_activations=true"
               for p in bf16 fp8; do  # fp8.* only on the fp8 rows: a bf16 run refuses a non-default recipe
                 python3 scripts/bench/bench_train.py --model $M --points $pts --steps 5 --no-phase-times --deepspeed zero0 \
                   --precision $p $C ${EXTRA:-} $([ $p = fp8 ] && echo fp8.recipe=${FP8_RECIPE:-tensorwise}) \
                   | grep RESULT | cut -c1-1200 | tee -a "$OUT/fp8_equal.jsonl"
               done
               for p in ${pts//,/ }; do  # checkpointed: the anchor's memory, which ours must not exceed
                 python3 .bench/anchor-bench/model_bench.py --seq ${p%%:*} --variant hf --liger \
                   --fp8 ${FP8_ANCHOR_RECIPE:-${FP8_RECIPE:-tensorwise}} --warmup 1 --reps 3 ${ANCHOR_SHAPE:-} 2>&1 \
                   | grep -E "RESULT|Error" | tail -2 | tee -a "$OUT/fp8_equal.jsonl"
               done ;;
    fp8_tune) for t in 0 1; do for m in llama3_1_8b_shape llama3_2_1b; do
                TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=$t python3 scripts/bench/bench_fp8_mlp.py --model $m \
                  --recipes tensorwise --variants bf16,fp8_mlp,fp8_mlp_static --tokens 16384 2>&1 | grep -E '^\{|Error' \
                  | sed "s/^{/{\"coordinate_descent_tuning\": $t, /" | tee -a "$OUT/fp8_tune.jsonl"
              done; done ;;
    fp8_delayed) for m in ${FP8_MODELS:-llama3_1_8b_shape llama3_2_1b}; do
                   python3 scripts/bench/bench_fp8_mlp.py --model $m --recipes tensorwise --tokens 16384 --profile 16 \
                     --variants ${FP8_VARIANTS:-bf16,fp8_mlp,fp8_mlp_static,fp8_mlp_delayed,fp8_mlp_fused,fp8_mlp_fused_bytes,fp8_mlp_fused_torch_t} 2>&1 \
                     | grep -E '^\{|Error' | tee -a "$OUT/fp8_delayed.jsonl"
                 done ;;
    fp8_casts) python3 scripts/bench/bench_fp8_casts.py --shapes ${CAST_SHAPES:-32768x8192,32768x2048} 2>&1 \
                 | grep -E '^\{|Error' | tee -a "$OUT/fp8_casts.jsonl" ;;
    gpu_fp8) python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_fp8_delayed.py 2>&1 | tee "$OUT/gpu_fp8.txt" \
               | tail -15 ;;
    fp8_tiling) n=0; for c in "" ${TILING_CONFIGS:-triton.prefer_nd_tiling=True}; do
                  n=$((n + 1)); TORCHINDUCTOR_CACHE_DIR=/tmp/fp8_tiling_$n python3 scripts/bench/bench_fp8_mlp.py \
                    --model llama3_1_8b_shape --recipes tensorwise --variants bf16,fp8_mlp --tokens 16384 --profile 14 \
                    --inductor "$c" 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/fp8_tiling.jsonl"
                  mkdir -p "$OUT/fp8_tiling_code_$n"
                  grep -rl scaled_mm "/tmp/fp8_tiling_$n" --include='*.py' | head -20 | xargs -r cp -t "$OUT/fp8_tiling_code_$n"
                done ;;
    fp8_track) for k in ${FP8_TRACK_KINDS:-bf16 fp8 control}; do
                 n=1; cp="parallelism.cp=1"
                 case $k in *_cp2) n=2; cp="parallelism.cp=2 dist_backend=gloo" ;; esac  # both ranks on one GPU
                 case ${k%_cp2} in bf16) a="precision=bf16" ;; fp8) a="precision=fp8 ${FP8_TRACK_ARGS:-}" ;;
                                   control) a="precision=bf16 trainer.loss_chunk_size=1024" ;; esac  # rounding only
                 python3 -m torch.distributed.run --standalone --nproc_per_node=$n scripts/train.py model=${FP8_TRACK_MODEL:-llama3_2_1b} \
                   data=demo data.seq_len=${FP8_TRACK_SEQ:-4096} data.eval_samples=16 $cp trainer.global_batch_size=1 \
                   trainer.max_steps=${FP8_TRACK_STEPS:-500} trainer.warmup_steps=20 trainer.lr=${FP8_TRACK_LR:-1e-4} \
                   trainer.eval_every=${FP8_TRACK_STEPS:-500} trainer.save_at_end=false trainer.export_hf=false \
                   deepspeed.master_weights=bf16 logging.progress_bar=false run.name=fp8_track${FP8_TRACK_TAG:-}_$k $a ${FP8_TRACK_COMMON:-} \
                   > "$OUT/fp8_track_$k.log" 2>&1
                 echo "fp8_track $k rc=$?"; cp outputs/fp8_track${FP8_TRACK_TAG:-}_$k/metrics.jsonl "$OUT/fp8_track_$k.jsonl"
               done
               # each run against this call's bf16, and against a stored track's columns ($FP8_TRACK_REF: a
               # fp8_track_losses.jsonl of docs/results/, one row a step, a column a run) where one is named
               python3 -c "import json, os, sys
runs = {os.path.basename(f)[10:-6]: [json.loads(l) for l in open(f)] for f in sys.argv[1:] if os.path.exists(f)}
losses = {k: [r['loss'] for r in rs if 'loss' in r] for k, rs in runs.items()}
ref = os.environ.get('FP8_TRACK_REF')
if ref:
    stored = [json.loads(l) for l in open(ref)][1:]
    losses.update({'stored_' + c: [r[c] for r in stored] for c in ('bf16', 'control')})
def compare(name, a, b, against):
    d = [abs(x - y) for x, y in zip(a, b)]
    print(f'fp8_track {name} vs {against}: {len(d)} steps, max |dloss| {max(d):.3e}, mean {sum(d) / len(d):.3e}, last {d[-1]:.3e}')
for against in ('bf16', 'stored_bf16'):  # this call's runs against the stored bf16 too, never a stored run twice
    for name, a in losses.items():
        if against in losses and name != against and not (against.startswith('stored') and name.startswith('stored')):
            compare(name, a, losses[against], against)
for name, a in losses.items():  # a layout against the same precision at cp=1
    if name.endswith('_cp2') and name[:-4] in losses:
        compare(name, a, losses[name[:-4]], name[:-4])
print('fp8_track last eval loss:', {k: [r['eval_loss'] for r in rs if 'eval_loss' in r][-1:] for k, rs in runs.items()})" \
                 "$OUT/fp8_track_bf16.jsonl" "$OUT/fp8_track_fp8.jsonl" "$OUT/fp8_track_control.jsonl" \
                 "$OUT/fp8_track_bf16_cp2.jsonl" "$OUT/fp8_track_fp8_cp2.jsonl" ;;
    gpu_matrix) python3 scripts/bench/gpu_matrix.py --jobs ${MATRIX_JOBS:-0} --deadline-s ${MATRIX_DEADLINE_S:-520} \
                    --resume --out outputs/gpu_matrix.jsonl ${MATRIX_ARGS:-} 2>&1 | grep -E '^\{|gpu_matrix' \
                  | cut -c1-400; cp outputs/gpu_matrix.jsonl "$OUT/" ;;
    auto_memory) python3 scripts/bench/bench_train.py --points ${AUTO_POINTS:-16384:auto,32768:auto,65536:auto,131072:auto} \
                   --steps 3 ${EXTRA:-} | grep RESULT | cut -c1-700
                 python3 scripts/bench/bench_train.py --model qwen3_30b_a3b_4l --points ${AUTO_MOE_POINTS:-16384:auto,32768:auto} \
                   --steps 3 moe.dispatcher=alltoall ${EXTRA:-} | grep RESULT | cut -c1-700
                 ;;
    *) echo "unknown part $part" ;;
  esac
done
