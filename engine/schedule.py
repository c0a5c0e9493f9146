"""Learning-rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio at max_steps."""
from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(trainer_cfg):
    """A callable DeepSpeed turns into the scheduler once it has built the optimizer."""
    import torch

    def make(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, warmup_steps=trainer_cfg.warmup_steps,
                                              max_steps=trainer_cfg.max_steps, min_lr_ratio=trainer_cfg.min_lr_ratio))
    return make
