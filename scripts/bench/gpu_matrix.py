#!/usr/bin/env python3
"""The GPU exactness matrix: every fast path against the fp32 eager unsplit model, on the inputs real models feed it.

    python3 scripts/bench/gpu_matrix.py --out outputs/gpu_matrix.jsonl            # on one GPU (bench_gpu.sh gpu_matrix)
    python3 scripts/bench/gpu_matrix.py --device cpu --quick                      # the harness itself, on CPU (a test)

Each family is built at a small shape with its real head dims (2 layers, few experts) through the engine's own build
(engine/ds/build.py: kernels, memory policies, MoE layer, DeepSpeed) and takes one forward and backward of a fixed
batch of SEQ tokens with some labels masked (and, for `packed` cells, documents whose positions restart at 0).

    reference  precision=fp32, model.kernels=none, memory=none, deepspeed=zero0: the unsplit model, eager, fp32
    eager      precision=bf16, model.kernels=none, memory=none, deepspeed=zero0: the plain bf16 path
    cell       precision=bf16 and the cell's kernels / memory preset / deepspeed / options
    fp8 eager  precision=fp8, fp8.recipe=tensorwise, fp8.compile=false, model.kernels=none, memory=none (--fp8 cells)
    fp8 cell   precision=fp8 and the cell's recipe / linears / memory preset / packing (--fp8)

A cell passes when its loss and every parameter's gradient are no further from the reference (relative, in the norm)
than BOUND x the eager path's own error on the same parameter, or FLOOR where the eager error is below it (docs/design.md
§3.1). FP8 is not exact, so an FP8 cell's eager path is FP8's own: torchao's tensorwise recipe run eagerly, on the
same linears, is FP8's bound; a fast FP8 path (fp8.recipe=delayed's Triton casts, the compiled casts) may be at most
BOUND x as far from fp32 as that on every parameter. Delayed scaling's first step takes each operand's own amax, as
tensorwise does, so at the matrix's one step the two differ by rounding only, and a wrong kernel output (the e5m2
transposes of 2026-12-07) lands far outside.

`optimizer_in_backward` frees the gradients it steps with, so that cell reads them off its step: in fp32 with AdamW's
lr = eps = STEP_SCALE (constant schedule), the first update is -g * lr / (|g| + eps), which is -g to within |g| / eps,
and -update is judged as the gradients like any cell. (Comparing two bf16 updates at a small eps, as
before 2026-12-04, judged Adam's sign-like first step: rounding flips the sign of gradients that are zero in exact
arithmetic, such as k_proj.bias's under softmax's shift invariance, and two of those cells failed on noise.) The
table (docs/gpu_matrix.md) gives each cell's worst ratio and the parameter it sits in.

--reinstate-contiguity-bug: the self-check. The RMSNorm backward reads its input as if contiguous again (the defect
of 2026-12-03: MLA's kv_a_layernorm takes a slice of torch.split) and the first-use check is bypassed; the MLA cells
must then fail.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BOUND, FLOOR = 2.0, 2e-3
STEP_SCALE = 1000.0  # optimizer_in_backward's lr and Adam eps: the first update is then -g to within |g| / 1000
SEQ = 4096
COMMON = ["data=synthetic", "parallelism.cp=1", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
          "trainer.grad_clip=0", "model.attn_backend=sdpa", "trainer.warmup_steps=0"]
# family: (model preset, arch overrides): 2 layers, few experts, the real head dims
FAMILIES = {
    "llama_d64": ("llama3_2_1b", dict(num_hidden_layers=2)),
    "llama_d128": ("llama3_1_8b_shape", dict(num_hidden_layers=2, intermediate_size=8192)),
    "qwen3_d128": ("tiny_qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3_moe": ("qwen3_30b_a3b_4l", dict(num_hidden_layers=2, num_experts=16)),
    "gpt_oss": ("tiny_gpt_oss", dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_local_experts=8,
                                     num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                     sliding_window=128)),
    "deepseek_v3_mla": ("deepseek_v3_2l", dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096,
                                               moe_intermediate_size=512, n_routed_experts=16, n_group=1, topk_group=1,
                                               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768)),
    "glm4_moe_lite_mla": ("glm4_moe_lite_4l", dict(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                                                   n_routed_experts=16)),
    "glm4_moe": ("glm4_5_air_4l", dict(num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                                       num_key_value_heads=4, n_routed_experts=16)),
    "latent_moe": ("tiny_latent_moe", dict(vocab_size=32000, hidden_size=2048, num_attention_heads=16,
                                           num_key_value_heads=4, head_dim=128, num_experts=16, moe_intermediate_size=256)),
    # Mistral4's MLA: q/k 64 + 64 (half of it rotary, yarn with Llama-4's query scale), v 128
    "mistral4_mla": ("tiny_mistral4", {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 4096,
                                       "moe_intermediate_size": 512, "n_routed_experts": 16, "num_experts_per_tok": 4,
                                       "n_group": 1, "topk_group": 1, "num_attention_heads": 16,
                                       "num_key_value_heads": 16, "q_lora_rank": 768, "kv_lora_rank": 256,
                                       "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                       "rope_parameters.partial_rotary_factor": 0.5,
                                       "rope_parameters.original_max_position_embeddings": 1024}),
    # Cohere2-MoE: a sliding layer (window 512 of the 4k batch) and a global NoPE layer, head dim 128
    "cohere2_moe": ("tiny_cohere2_moe", dict(vocab_size=32000, hidden_size=2048, intermediate_size=1024, num_experts=16,
                                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                             sliding_window=512)),
    # the Qwen3-VL language model on text (interleaved multimodal RoPE), head dim 128; the vision tower stays frozen
    "qwen3_vl_text": ("tiny_qwen3_vl", {"text_config.vocab_size": 32000, "text_config.hidden_size": 2048,
                                        "text_config.intermediate_size": 4096, "text_config.num_attention_heads": 16,
                                        "text_config.num_key_value_heads": 8, "text_config.head_dim": 128,
                                        "text_config.rope_parameters.mrope_section": [24, 20, 20],
                                        "vision_config.out_hidden_size": 2048}),
    # Qwen3.5-MoE's hybrid: a gated DeltaNet layer (16 key / 32 value heads of 128) and a gated full-attention layer
    # (head dim 256, a quarter rotary)
    "qwen3_5_moe": ("tiny_qwen3_5_moe", dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=2,
                                             layer_types=["linear_attention", "full_attention"],
                                             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                             linear_num_key_heads=16, linear_num_value_heads=32,
                                             linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16,
                                             num_experts_per_tok=8, moe_intermediate_size=512,
                                             shared_expert_intermediate_size=512)),
    "qwen3_5_dense": ("tiny_qwen3_5", dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                                           num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                           num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                                           linear_num_key_heads=16, linear_num_value_heads=32,
                                           linear_key_head_dim=128, linear_value_head_dim=128)),
}
# the hybrids: their linear layers' delta rule through fla's chunked kernels (model.linear_attn_kernel=fla, after
# .flaw's fla-core is installed: --fla) as well as through the torch path every other cell runs
HYBRID = ("qwen3_5_moe", "qwen3_5_dense")
# FP8 cells (--fp8): the dense families, whose MLPs fp8.recipe=delayed takes (gated SiLU, no biases). The MoE families'
# layers are all sparse here, and their experts stay bf16, so precision=fp8 refuses them with fp8.linears=mlp; under
# fp8.linears=all their attention projections run in FP8, with delayed scales on Qwen3-MoE's q/k/v groups and o_proj,
# and on DeepSeek-V3's first (dense) layer's MLP and its o_proj (MLA's other projections and the shared experts keep
# tensorwise's dynamic scales)
FP8_FAMILIES = ("llama_d64", "llama_d128", "qwen3_d128")
FP8_EAGER = ["precision=fp8", "fp8.recipe=tensorwise", "fp8.compile=false", "model.kernels=none", "memory=none"]
FP8_CELLS = {  # name: overrides (each with precision=fp8 and model.kernels=liger), packed
    "fp8 tensorwise": (["fp8.recipe=tensorwise"], False),
    "fp8 delayed": (["fp8.recipe=delayed"], False),
    "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False),
    "fp8 delayed packed": (["fp8.recipe=delayed"], True),
    "fp8 delayed memory=selective": (["fp8.recipe=delayed", "memory=selective"], False),
    "fp8 delayed memory=full_recompute": (["fp8.recipe=delayed", "memory=full_recompute"], False),
}
FP8_MOE_CELLS = {  # family: its cells, as FP8_CELLS (the experts stay bf16)
    "qwen3_moe": {"fp8 tensorwise all": (["fp8.recipe=tensorwise", "fp8.linears=all"], False),
                  "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False),
                  "fp8 delayed all packed": (["fp8.recipe=delayed", "fp8.linears=all"], True)},
    "deepseek_v3_mla": {"fp8 tensorwise all": (["fp8.recipe=tensorwise", "fp8.linears=all"], False),
                        "fp8 delayed all": (["fp8.recipe=delayed", "fp8.linears=all"], False)},
}
# FlashAttention-4 cells (--fa4, after the FA4 wheels are installed): head dims it takes, windows and sinks among them
FA4_FAMILIES = ("llama_d64", "llama_d128", "qwen3_moe", "gpt_oss", "cohere2_moe")
QUICK = {  # --quick (CPU): the harness on tiny shapes
    "llama_d64": ("tiny", {}), "deepseek_v3_mla": ("tiny_deepseek_v3", {}), "qwen3_moe": ("tiny_moe", {}),
}
# every preset memory=auto can choose (hydra_conf/memory, less auto and budget)
MEMORY = ("selective", "selective_tiled", "tiled", "except_attention", "except_attention_offload",
          "except_attention_offload_tiled", "block_recompute", "full_recompute", "offload", "except_attention_tiled",
          "long_context", "selective_block")

WHOLE_LAYERS = ("except_attention_tiled", "selective_block")  # presets that recompute memory.recompute_num_layers=4


def cells(families, quick: bool, fa4: bool = False, fla: bool = False, fp8: bool = False):
    """(family, name, overrides, packed) of every cell."""
    out = []
    for fam in families:
        for k in ("liger", "compile"):  # model.kernels=none with memory=none and zero0 is the eager path itself
            out.append((fam, f"kernels={k}", [f"model.kernels={k}"], False))
        out.append((fam, "kernels=liger zero3", ["model.kernels=liger", "deepspeed=zero3"], False))
        out.append((fam, "packed", ["model.kernels=liger"], True))
        if fam in HYBRID:
            out.append((fam, "linear_attn_kernel=torch", ["model.linear_attn_kernel=torch"], False))
            if fla:
                out.append((fam, "linear_attn_kernel=fla", ["model.linear_attn_kernel=fla"], False))
                out.append((fam, "linear_attn_kernel=fla packed", ["model.linear_attn_kernel=fla"], True))
    if fa4:  # FA4 against the same SDPA fp32 reference: its varlen (packed), window and sink paths on real shapes
        for fam in [f for f in FA4_FAMILIES if f in families]:
            out.append((fam, "attn=fa4", ["model.attn_backend=fa4"], False))
            out.append((fam, "attn=fa4 packed", ["model.attn_backend=fa4"], True))
    for fam in families:  # every family takes every preset memory=auto can choose
        for m in (MEMORY[:3] if quick else MEMORY):
            out.append((fam, f"memory={m}", [f"memory={m}"], False))
            if m in WHOLE_LAYERS:  # their 4 layers recomputed whole exceed the matrix's 2: the same policy at 1
                out.append((fam, f"memory={m} recompute_num_layers=1", [f"memory={m}", "memory.recompute_num_layers=1"],
                            False))
        if not quick:  # uneven MLP tiles: 4,096 tokens in 5 tiles, whose boundaries tile_sizes puts on multiples of 16
            out.append((fam, "memory=tiled mlp_tile_tokens=1000", ["memory=tiled", "memory.mlp_tile_tokens=1000"], False))
    for fam in [f for f in ("qwen3_moe", "deepseek_v3_mla") if f in families]:
        out.append((fam, "moe.recompute=experts", ["moe.recompute=experts"], False))
        out.append((fam, "moe.recompute=experts offload_inputs", ["moe.recompute=experts", "moe.offload_inputs=true"],
                    False))
    for fam in [f for f in ("llama_d64", "qwen3_moe", "gpt_oss") if f in families]:
        out.append((fam, "optimizer_in_backward", ["trainer.optimizer_in_backward=true"], False))
        out.append((fam, "packed except_attention_offload", ["memory=except_attention_offload"], True))
    if fp8:
        fp8_cells = {**{f: FP8_CELLS for f in FP8_FAMILIES}, **FP8_MOE_CELLS}
        for fam in [f for f in fp8_cells if f in families]:
            for name, (over, packed) in fp8_cells[fam].items():
                out.append((fam, name, ["precision=fp8", "model.kernels=liger", *over], packed))
    return out


def compose(fam_spec, precision: str, overrides, device: str):
    from configs import compose_config
    preset, arch = fam_spec
    over = [f"model={preset}", f"precision={precision}", f"device={device}", f"data.seq_len={SEQ}"] + COMMON
    if precision == "bf16":  # an FP8 cell's too: it names precision=fp8 among its overrides
        over += ["deepspeed.master_weights=bf16"]
    if device == "cpu" and "precision=fp8" in overrides:  # torch's CPU float8 matmul: the harness's own test
        over += ["fp8.emulate_on_cpu=true"]
    if not any(o.startswith("deepspeed=") for o in overrides):
        over.append("deepspeed=zero0")
    over += [f"model.arch.{k}={json.dumps(v)}" for k, v in arch.items()]
    named = {o.split("=", 1)[0] for o in overrides}  # a cell's own value replaces COMMON's (Hydra refuses a key twice)
    over = [o for o in over if o.split("=", 1)[0] not in named] + list(overrides)
    return compose_config(over)


def batch(vocab: int, packed: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(1, SEQ, generator=g) < 0.1] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:  # documents of uneven lengths, positions restarting at 0 (HF's DataCollatorWithFlattening)
        starts = sorted({0, *torch.randint(1, SEQ, (5,), generator=g).tolist()})
        pos = torch.zeros(SEQ, dtype=torch.long)
        for a, b in zip(starts, starts[1:] + [SEQ]):
            pos[a:b] = torch.arange(b - a)
        out["position_ids"] = pos[None]
    return out


def run_cell(cfg, data: dict, device, step: bool = False):
    """(loss, {name: fp32 gradient} or None, {name: fp32 update of one step} or None) of one forward + backward."""
    from configs import validate
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_ulysses_ext import init_topology, shard_batch
    from ds_ulysses_ext.memory import remove_all
    from engine.ds.build import build
    plan = validate(cfg, 1)
    topo = init_topology(1)
    if cfg.memory.auto:
        raise ValueError("the matrix names its presets")
    engine, hf, scale = build(cfg, plan, topo, device)
    try:
        def weights():
            # clone: an fp32 parameter on the CPU is its own .float().cpu(), and a step would change the copy too
            return {n: (safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p).detach().float().cpu().clone()
                    for n, p in engine.module.named_parameters()}
        before = weights() if step else None  # before the forward: optimizer_in_backward steps inside backward
        shard = {k: v.to(device) for k, v in shard_batch(data, topo).items()}
        loss_sum, count = engine(**shard)
        engine.backward(loss_sum * (scale / count), scale_wrt_gas=False)
        loss = float(loss_sum.detach().double() / count)
        grads = None
        if not cfg.trainer.optimizer_in_backward:
            grads = {}
            for n, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                g = g if g is not None else p.grad
                if g is not None:
                    grads[n] = g.detach().float().cpu()
        updates = None
        if step:
            engine.step()
            updates = {n: w - before[n] for n, w in weights().items()}
        return loss, grads, updates
    finally:
        remove_all(getattr(engine, "memory_policies", []) or [])
        engine.destroy()
        del engine, hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def judge(cell_loss, cell_grads, ref, eager) -> dict:
    """The cell's worst ratio to the eager error (loss and every gradient), and where it sits."""
    ref_loss, ref_grads = ref
    eager_loss, eager_grads = eager
    rows = [("loss", abs(cell_loss - ref_loss) / abs(ref_loss), abs(eager_loss - ref_loss) / abs(ref_loss))]
    missing = sorted(set(ref_grads) - set(cell_grads))
    for n, r in ref_grads.items():
        if n in cell_grads:
            rows.append((n, rel(cell_grads[n], r), rel(eager_grads[n], r)))
    worst = max(rows, key=lambda t: t[1] / max(t[2], FLOOR / BOUND))
    ok = not missing and all(err <= max(BOUND * e, FLOOR) for _, err, e in rows)
    return dict(ok=ok, worst_param=worst[0], worst_err=worst[1], eager_err=worst[2],
                ratio=worst[1] / max(worst[2], FLOOR / BOUND), missing=missing[:3])


def reinstate_contiguity_bug() -> None:
    """The self-check: the RMSNorm backward misreads a strided x as contiguous, and no first-use check stops it."""
    from ds_ulysses_ext.kernels import providers, rms_norm
    original = rms_norm.rms_norm_backward

    def misreading(dy, x, w, rstd, llama_order):
        return original(dy, x.as_strided(x.shape, (x.shape[1], 1), x.storage_offset()), w, rstd, llama_order)
    rms_norm.rms_norm_backward = misreading
    providers.Checked._first_use = lambda *a, **k: None


def first_use_refusal(error: str) -> bool:
    """A kernel's first-use check that found it cannot run on the run's input (fla_kernels.CannotRun): the run stops
    before its first step with the fix named, as a refusal does, one forward later. Rows written before the harness
    knew this (2026-12-04) carry ok=false; the table reads them by their error."""
    return error.startswith("CannotRun:")


def table(paths) -> str:
    """The docs' markdown table of result files (a later row of the same cell replaces an earlier one)."""
    cells_seen = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            cells_seen[(r["family"], r["cell"])] = r
    out = ["| family | cell | verdict | worst error (relative) | eager's there (bf16; FP8's for fp8 cells) | ratio | where |",
           "|---|---|---|---|---|---|---|"]
    for (fam, cell), r in cells_seen.items():
        if first_use_refusal(r.get("error", "")):
            out.append(f"| {fam} | {cell} | refused at first use | | | | {r['error'][:110]} |")
        elif r.get("refused"):
            out.append(f"| {fam} | {cell} | refused before the build | | | | {r['error'][:110]} |")
        elif "error" in r:
            out.append(f"| {fam} | {cell} | **fails** | | | | {r['error'][:110]} |")
        elif "compared_with" in r and "ratio" not in r:  # optimizer_in_backward rows of 2026-12-03/04
            out.append(f"| {fam} | {cell} | {'ok' if r['ok'] else '**fails**'} | {r['worst_err']:.2e} | | | "
                       f"{r['worst_param']} ({r['compared_with']}) |")
        else:
            out.append(f"| {fam} | {cell} | {'ok' if r['ok'] else '**fails**'} | {r['worst_err']:.2e} | "
                       f"{r['eager_err']:.2e} | {r['ratio']:.2f} | {r['worst_param']}"
                       + (f" ({r['compared_with']})" if "compared_with" in r else "") + " |")
    return "\n".join(out)


START = time.time()
# the errors of a cell that found the GPU full: its neighbours' memory, not its own verdict (2026-12-06: 8 processes
# side by side on an 80 GiB H100 ran out in 54 cells), so --resume runs such a cell again
OUT_OF_MEMORY = ("OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
# a process's peak on the matrix's largest families (12-19 GiB seen in those errors), with room: --jobs 0 runs as many
# processes as fit the GPU's memory at this much each
GIB_PER_JOB = 20


def out_of_memory(row) -> bool:
    return any(e in row.get("error", "") for e in OUT_OF_MEMORY)


def jobs_for_memory(total_bytes: int) -> int:
    return max(1, total_bytes // (GIB_PER_JOB << 30))


def todo_cells(args, families) -> list:
    """The cells to run: those of `families` that --only names, less those with a row in --skip-from / --out."""
    only = [s for s in args.only.split(",") if s]
    skip_from = args.skip_from or (args.out if args.resume else "")
    done = set()
    if skip_from and Path(skip_from).exists():
        for line in Path(skip_from).read_text().splitlines():
            row = json.loads(line)
            if bool(row.get("self_check")) == args.reinstate_contiguity_bug and not out_of_memory(row):
                done.add((row["family"], row["cell"]))
    return [c for c in cells(families, args.quick, args.fa4, args.fla, args.fp8)
            if (not only or any(s in c[1] for s in only)) and (c[0], c[1]) not in done]


def fan_out(args) -> int:
    """Run the families in args.jobs child processes sharing the GPU, then append their rows to args.out.

    A cell's time is mostly the host building its model and DeepSpeed engine (8-25 s against well under a second of
    GPU work at 4k tokens), so processes side by side divide the matrix's wall time; each child owns whole families
    (their reference is computed once per family) and its own rendezvous port. Families are dealt largest first so
    the groups hold about as many cells each."""
    specs = QUICK if args.quick else FAMILIES
    families = [f for f in args.families.split(",") if f in specs]
    if args.resume:
        args.skip_from = args.out
    size = {f: len(todo_cells(args, [f])) for f in families}
    families = [f for f in families if size[f]]
    groups = [[] for _ in range(min(args.jobs, len(families)))]
    for f in sorted(families, key=lambda f: -size[f]):
        min(groups, key=lambda g: sum(size[x] for x in g)).append(f)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, group in enumerate(groups):
        part = out.with_name(f"{out.stem}.part{i}{out.suffix}")
        part.unlink(missing_ok=True)
        env = dict(os.environ, MASTER_PORT=str(int(os.environ.get("MASTER_PORT", "29600")) + 1 + i))
        # the parent's own arguments, then each child's: argparse keeps an option's last value
        child = [*sys.argv[1:], "--jobs", "1", "--families", ",".join(group), "--out", str(part),
                 "--skip-from", args.skip_from]
        procs.append((part, subprocess.Popen([sys.executable, __file__, *child], env=env)))
    codes = []
    with out.open("a") as f:
        for part, proc in procs:
            codes.append(proc.wait())
            if part.exists():
                f.write(part.read_text())
                part.unlink()
    print(f"gpu_matrix: {len(groups)} processes, exit codes {codes}; rows appended to {out}", flush=True)
    for group, code in zip(groups, codes):
        if code < 0:  # a signal: on 2026-12-04, SIGKILL of the process holding the largest model, 8 on 128 GiB of host
            print(f"gpu_matrix: the process of {','.join(group)} was killed by signal {-code} (host memory, most "
                  f"likely); its cells left run alone: --families {','.join(group)} --jobs 1 --resume", flush=True)
    return 1 if any(codes) else 0


def main() -> int:
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--only", default="", help="comma-separated substrings: run only cells whose name has one")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a few cells (the CPU test)")
    ap.add_argument("--reinstate-contiguity-bug", action="store_true")
    ap.add_argument("--fa4", action="store_true", help="add the FlashAttention-4 cells (the FA4 wheels installed)")
    ap.add_argument("--fla", action="store_true", help="add the hybrids' fla cells (fla-core installed)")
    ap.add_argument("--fp8", action="store_true", help="add the FP8 cells (torchao installed; an SM89+ GPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per batch (default 4096; --quick 64)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "gpu_matrix.jsonl"))
    ap.add_argument("--resume", action="store_true",
                    help="skip the cells that already have a row in --out (a call cut off by its deadline, run again)")
    ap.add_argument("--skip-from", default="", help=argparse.SUPPRESS)  # --resume's file, handed to --jobs' children
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="start no cell after this many seconds (0: none); --resume in the next call runs the rest")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the families in this many processes at once on the one GPU (see fan_out); 0: as many "
                         f"as its memory holds at {GIB_PER_JOB} GiB each")
    args = ap.parse_args()
    if args.jobs == 0:
        args.jobs = jobs_for_memory(torch.cuda.get_device_properties(0).total_memory)
        print(f"gpu_matrix: {args.jobs} processes for {torch.cuda.get_device_name(0)}'s memory", flush=True)
    if args.jobs > 1:
        return fan_out(args)
    global SEQ
    if args.quick:
        SEQ = 64
    SEQ = args.seq or SEQ
    if args.reinstate_contiguity_bug:
        reinstate_contiguity_bug()
    specs = QUICK if args.quick else FAMILIES
    families = [f for f in args.families.split(",") if f in specs]
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    from engine.ds.distributed import init_distributed, read_runtime
    rt = read_runtime(args.device)
    init_distributed(rt)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    todo = todo_cells(args, families)
    refs = {}
    with out.open("a") as f:
        for i, (fam, name, overrides, packed) in enumerate(todo):
            if args.deadline_s and time.time() - START > args.deadline_s:
                left = len(todo) - i
                print(f"gpu_matrix: deadline reached, {left} cells not run (run again with --resume)", flush=True)
                failed += left
                break
            t0 = time.time()
            key = (fam, packed)
            row = dict(family=fam, cell=name, packed=packed, seq=SEQ, overrides=overrides,
                       self_check=args.reinstate_contiguity_bug)
            try:
                if key not in refs:  # the fp32 reference and the eager bf16 path, once per family and batch
                    cfg = compose(specs[fam], "fp32", ["model.kernels=none", "memory=none"], args.device)
                    arch = cfg.model.arch
                    data = batch(arch["vocab_size"] if "vocab_size" in arch else arch["text_config"]["vocab_size"], packed)
                    ref = run_cell(cfg, data, rt.device)[:2]
                    plain = ["model.kernels=none", "memory=none"]
                    plain += ["model.linear_attn_kernel=torch"] if fam in HYBRID else []  # auto takes fla in bf16
                    eager = run_cell(compose(specs[fam], "bf16", plain, args.device), data, rt.device)[:2]
                    refs[key] = (data, ref, eager)
                data, ref, eager = refs[key]
                if "precision=fp8" in overrides:  # FP8's own bound: torchao tensorwise, eager, on the cell's linears
                    linears = [o for o in overrides if o.startswith("fp8.linears=")]
                    fp8_key = key + (*linears, "fp8")  # once per family, batch and fp8.linears
                    if fp8_key not in refs:
                        refs[fp8_key] = run_cell(compose(specs[fam], "bf16", FP8_EAGER + linears, args.device), data,
                                                 rt.device)[:2]
                    eager = refs[fp8_key]
                    row["compared_with"] = "FP8 eager: torchao tensorwise, uncompiled, on the same linears"
                cfg = compose(specs[fam], "bf16", overrides, args.device)
                if cfg.trainer.optimizer_in_backward:
                    scale = [f"trainer.lr={STEP_SCALE}", f"trainer.adam_eps={STEP_SCALE}", "trainer.lr_decay=constant"]
                    cfg = compose(specs[fam], "fp32", overrides + scale, args.device)
                    loss, _, update = run_cell(cfg, data, rt.device, step=True)
                    row.update(judge(loss, {n: -u for n, u in update.items()}, ref, eager),
                               compared_with="the gradients its fp32 step used (-update at lr = eps = 1000)")
                else:
                    loss, grads, _ = run_cell(cfg, data, rt.device)
                    row.update(judge(loss, grads, ref, eager))
            except Exception as err:  # a refusal before the build is a result too: it names the fix
                from configs.errors import ConfigError
                from ds_ulysses_ext.errors import UnsupportedError
                error = f"{type(err).__name__}: {str(err)[:300]}"
                refused = isinstance(err, (ConfigError, UnsupportedError)) or first_use_refusal(error)
                row.update(ok=refused, refused=refused, error=error)
            row["seconds"] = round(time.time() - t0, 1)
            failed += not row["ok"]
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    print(f"gpu_matrix: {len(todo) - failed} of {len(todo)} cells within bounds", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
