#!/usr/bin/env python3
"""Anchor: a stock HF training step of one of our model presets (DeepSeek-V3, GLM-4-MoE-Lite, GLM-4-MoE, any family
transformers builds), the baseline our engine's step on the same shape is compared with.

    python3 scripts/bench/hf_moe_bench.py --model glm4_moe_lite_4l --seqs 32768,131072
    python3 scripts/bench/hf_moe_bench.py --model tiny_glm4_moe_lite --device cpu --seqs 64 --warmup 1 --reps 1  # smoke

The model is HF's own class for the preset's family, built from hydra_conf/model/<model>.yaml's arch (the HF config
our engine builds, engine/ds/hf_config.py; random init, nothing downloaded), in bf16 (--dtype), with SDPA attention,
HF's experts implementation (--experts: grouped_mm on CUDA, eager on CPU), HF's non-reentrant gradient
checkpointing, and torch's AdamW (fused) on the bf16 parameters: parameters, gradients and both moments in bf16,
what our runs with deepspeed.master_weights=bf16 keep. One sequence of S random tokens per step, labels = inputs.
For each S of --seqs: --warmup steps, then --reps timed steps (median). One `RESULT {json}` line per S: step_s,
tokens_per_s, model_tflops (engine/observe/flops.py's formula, 6 x active parameters x tokens + causal attention,
recompute not counted, the same as our runs' column), peak_alloc_gib / peak_reserved_gib (CUDA), loss; an S that
runs out of memory gives status "oom" and the next S still runs. --overrides: Hydra overrides of the preset
(e.g. model.arch.num_hidden_layers=2). --liger: HF + Liger-Kernel, what such users run: Liger's own patch function
for the family (RMSNorm, SwiGLU MLPs and experts, fused linear cross-entropy; RoPE where Liger has one for the
family), applied to HF's classes before the build as Liger's users do; a family Liger has no function for is refused.
"""
import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def hf_config_of_preset(model: str, overrides: list):
    """The HF config of hydra_conf/model/<model>.yaml, as our engine builds it (source=config: from arch)."""
    from configs import compose_config
    from engine.ds.hf_config import hf_config_of
    cfg = compose_config([f"model={model}"] + list(overrides))
    if cfg.model.source != "config":
        raise SystemExit(f"model={model} has model.source={cfg.model.source}: this anchor builds random-init "
                         "models from a preset's arch only (model.source=config)")
    return cfg.model, hf_config_of(cfg.model)


def experts_modules(model):
    """HF's routed-expert modules: the ones holding every expert's weights in one [E, ...] parameter."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]


def active_params(model, hf_config) -> int:
    """Parameters a token uses: every dense one, top_k / E of each routed-expert module's (as flops.count_params)."""
    top_k = getattr(hf_config, "num_experts_per_tok", 0) or 0
    experts = set()
    routed = 0
    for m in experts_modules(model):
        for p in m.parameters(recurse=False):
            experts.add(id(p))
            routed += p.numel() * top_k // p.shape[0]
    return routed + sum(p.numel() for p in model.parameters() if id(p) not in experts)


def build(hf_config, device, dtype, experts, ckpt: bool = True):
    from transformers import AutoModelForCausalLM
    if any(getattr(hf_config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts")):
        hf_config._experts_implementation = experts  # HF refuses the key on a model with no experts
    torch.manual_seed(0)
    # built and initialised on the device itself: a 14B shape (deepseek_v3_2l) initialised on the host and moved took
    # over 120 s on the H200's host (docs/benchmarks.md AH)
    with device:
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def apply_liger(family: str):
    """Liger-Kernel's patch function for `family` (its MODEL_TYPE_TO_APPLY_LIGER_FN), called with its defaults plus
    RoPE where it takes the argument (DeepSeek-V3's warns that it has no RoPE kernel and skips it), before the model
    is built: the anchor a Liger user would run. Patching HF's classes process-wide is fine here: this process builds
    one anchor model and nothing else."""
    import inspect
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(family)
    if fn is None:
        raise SystemExit(f"--liger: Liger-Kernel has no patch function for model_type {family!r}")
    try:
        fn(**({"rope": True} if "rope" in inspect.signature(fn).parameters else {}))
    except NotImplementedError as e:  # Qwen3.5's patch raises for rope=True (its partial RoPE): the rest applies
        print(f"--liger: {fn.__name__}(rope=True) refused ({e}); applying it with rope=False", flush=True)
        fn(rope=False)
        return fn.__name__ + "(rope=False)"
    return fn.__name__


def make_optimizer(model):
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_length(model, opt, hf_config, S, args, device, rec):
    from engine.observe.flops import step_flops
    ids = torch.randint(0, hf_config.vocab_size, (1, S), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(args.warmup + args.reps):
        sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[args.warmup:])
    flops = step_flops(rec["n_active"], hf_config, 1, S)
    rec.update(status="ok", step_s=step, tokens_per_s=S / step, model_tflops=flops / step / 1e12,
               step_times_s=times, loss=loss.detach().float().item())
    if device.type == "cuda":
        rec.update(peak_alloc_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm4_moe_lite_4l", help="a hydra_conf/model preset with source=config")
    ap.add_argument("--seqs", default="32768,131072", help="comma list of tokens per step")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--experts", default="auto", help="HF experts implementation: auto (grouped_mm on CUDA, eager "
                    "elsewhere), grouped_mm, batched_mm, eager")
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides of the preset")
    ap.add_argument("--liger", action="store_true", help="HF + Liger-Kernel: the family's Liger patch function")
    ap.add_argument("--no-ckpt", action="store_true", help="without HF's gradient checkpointing (fastest, most memory)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    experts = args.experts if args.experts != "auto" else ("grouped_mm" if device.type == "cuda" else "eager")
    import transformers
    model_cfg, hf_config = hf_config_of_preset(args.model, args.overrides)
    liger = apply_liger(hf_config.model_type) if args.liger else None
    model = build(hf_config, device, DTYPES[args.dtype], experts, ckpt=not args.no_ckpt)
    opt = make_optimizer(model)
    base = dict(bench="hf_moe_step" + ("+liger" if liger else ""), liger=liger, model=args.model, family=model_cfg.family,
                layers=hf_config.num_hidden_layers, dtype=args.dtype, experts=experts, attn="sdpa",
                device=str(device), ckpt=not args.no_ckpt,
                # hybrids: HF's delta rule is fla's chunked kernel when fla imports, else its torch fallback
                fla_importable=importlib.util.find_spec("fla") is not None, n_params=sum(p.numel() for p in model.parameters()),
                n_active=active_params(model, hf_config), transformers=transformers.__version__,
                torch=torch.__version__)
    for S in (int(s) for s in args.seqs.split(",") if s):
        rec = dict(base, S=S)
        try:
            one_length(model, opt, hf_config, S, args, device, rec)
        except torch.OutOfMemoryError as e:  # the next length still runs: free what this one held
            rec.update(status="oom", error=str(e)[:300])
        except Exception as e:  # a kernel that fails (e.g. a Triton compile) is a result of the anchor too
            rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            if rec["status"] == "oom":
                rec["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
        print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
