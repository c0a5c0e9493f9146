"""Learning-rate schedule: linear warmup, then a decay to lr * min_lr_ratio at max_steps (trainer.lr_decay:
cosine, linear, or constant, which stays at the peak; Megatron's --lr-decay-style).

The last step of the run (0-based max_steps - 1) is the one that runs at lr * min_lr_ratio, as the docs promise:
the decay counts from the first step after warmup (at the peak) to the last, so with a short run the floor is
still reached, not the value one step before it (1.5x the floor for linear over 4 steps)."""
from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float, decay: str = "cosine") -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    decay_steps = max_steps - 1 - warmup_steps  # from the first step after warmup to the last step
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
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
