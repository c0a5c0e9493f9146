"""Out-of-memory advice: what the run held when a step ran out of device memory, and what to change.

CUDA's own message names the failed allocation only. A long-context user needs the per-rank token
count, the memory policy in force and the next policies to try, ordered from the fastest to the
leanest (docs/memory.md), so the error that ends the run says them.
"""
from __future__ import annotations

import torch

from configs import Plan, TrainConfig

# from the fastest to the leanest: (preset, what it keeps)
_LADDER = (
    ("except_attention", "recompute all but attention; keeps 7 x hidden bytes per token per layer"),
    ("except_attention_tiled", "the same with some layers recomputed whole and the MLP in tiles "
                               "(raise memory.recompute_num_layers for less)"),
    ("except_attention_offload_tiled", "except_attention with attention's kept tensors in pinned host memory and "
                                       "the MLP in tiles (its copies hide behind compute: 11.8 s at 128k, as without them)"),
    ("long_context", "full recompute + activation offload to host + tiled MLP: the least GPU memory"),
)


def _policy(cfg: TrainConfig) -> str:
    m = cfg.memory
    parts = [f"memory.recompute={m.recompute}"]
    if m.recompute in ("block", "except_attention"):
        parts.append(f"recompute_num_layers={m.recompute_num_layers}")
    parts += [f"tiled_mlp={str(m.tiled_mlp).lower()}", f"offload_activations={str(m.offload_activations).lower()}"]
    return ", ".join(parts)


def _already(cfg: TrainConfig, preset: str) -> bool:
    m = cfg.memory
    return {"except_attention": m.recompute == "except_attention",
            "except_attention_tiled": m.recompute == "except_attention" and m.tiled_mlp,
            "except_attention_offload_tiled": m.recompute == "except_attention" and m.attention_offload and m.tiled_mlp,
            "long_context": m.recompute == "full" and m.offload_activations and m.tiled_mlp}[preset]


def oom_advice(cfg: TrainConfig, plan: Plan, step: int, device: torch.device) -> str:
    held = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        held = (f"; peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB of "
                f"{total:.1f} GiB")
    tokens = plan.seq_len // plan.cp * plan.micro_batch_size
    options = [f"memory={p} ({why})" for p, why in _LADDER if not _already(cfg, p)]
    options.append(f"raise parallelism.cp (now {plan.cp}; activations per rank scale with data.seq_len / cp)")
    options.append("memory=auto picks the fastest preset predicted to fit (python scripts/plan.py <the same "
                   "overrides> prints its table without running)")
    if plan.micro_batch_size > 1:
        options.append("lower trainer.micro_batch_size (gradient accumulation keeps the global batch)")
    return (f"out of device memory in step {step}: data.seq_len={plan.seq_len}, cp={plan.cp}, so "
            f"{tokens} tokens per rank per micro-batch; {_policy(cfg)}{held}. Options, fastest first: "
            + "; ".join(options) + ". See docs/memory.md.")
