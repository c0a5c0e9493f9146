"""Learning-rate schedule: linear warmup, then a decay to lr * min_lr_ratio at max_steps (trainer.lr_decay:
cosine, linear, or constant, which stays at the peak; Megatron's --lr-decay-style)."""
from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float, decay: str = "cosine") -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    remaining = 1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * remaining


def build_scheduler(trainer_cfg):
    """A callable DeepSpeed turns into the scheduler once it has built the optimizer."""
    import torch

    def make(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, warmup_steps=trainer_cfg.warmup_steps,
                                              max_steps=trainer_cfg.max_steps, min_lr_ratio=trainer_cfg.min_lr_ratio,
                                              decay=trainer_cfg.lr_decay))
    return make
