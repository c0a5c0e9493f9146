"""ClippingAdamW: torch's fused AdamW on the parameters and their own .grad, the clip folded into its kernel.

deepspeed=zero0 (one rank, master weights in the model's dtype) hands DeepSpeed this optimizer with ZeRO off, and
the gradients live where autograd puts them, as in a plain torch loop: they grow layer by layer during backward
while the recompute checkpoints are freed. ZeRO-2 on one rank (DeepSpeed 0.19.8) allocates its whole flat gradient
partition at the first gradient of the backward, while every checkpoint is still alive, and copies it once more
into a second flat tensor for the step: on the H200 that put the 16k step's peak 1.5 GiB over HF + Liger's
(docs/benchmarks.md, section AI). No library optimizer clips by the global norm inside its step; DeepSpeed's
non-ZeRO clip (clip_fp32_gradients) is a separate pass over every gradient that reads the norm back to the host.
Here the norm is one multi-tensor pass and the clip coefficient a device scalar that torch's fused AdamW divides
each gradient by in-kernel (`grad_scale`, the hook GradScaler uses), so the step never syncs the host.
"""
from __future__ import annotations

import torch


def squared_norm(grads: list, device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squared L2 norms, an fp32 device scalar, in one multi-tensor pass: fp32 per-tensor
    norms (bf16 ones would round to 8 bits), their squares summed in fp64 as DeepSpeed sums its own."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).double().pow(2).sum().float()


def clip_divisor(norm: torch.Tensor, clip: float, loss_scale: float = 1.0) -> torch.Tensor:
    """What every gradient is divided by, DeepSpeed's formula as a device scalar: max(1, (norm / loss_scale + 1e-6) /
    clip) x loss_scale. A non-finite norm, or DeepSpeed's -1 sentinel for one, clips as an infinite norm does."""
    norm = norm.to(torch.float32)
    norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, float("inf")))
    return (torch.clamp((norm / loss_scale + 1e-6) / clip, min=1.0) * loss_scale).reshape(())


class ClippingAdamW(torch.optim.AdamW):
    """AdamW(fused=True) that clips by the global gradient norm as DeepSpeed does: every gradient divided by
    max(1, (norm + 1e-6) / clip) (a non-finite norm clips as an infinite one); `_global_grad_norm` (before clipping)
    is where DeepSpeed's engine reads the norm after the step. `clip` = 0 turns clipping off.

    `skip_nonfinite` (trainer.on_nonfinite=skip): a step whose norm is inf/NaN changes no weight, moment or step
    count (torch's fused kernel skips on `found_inf`, GradScaler's flag), and `overflow` tells DeepSpeed's engine, as
    its ZeRO optimizers do, so that it counts a skipped step and leaves the lr schedule where it was. That flag is a
    Python bool: one host sync per step, paid only under skip (ZeRO-2's overflow scan syncs too)."""

    def __init__(self, params, clip: float, skip_nonfinite: bool = False, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self.clip = float(clip)
        self.skip_nonfinite = skip_nonfinite
        self._global_grad_norm = None
        if skip_nonfinite:
            self.overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = squared_norm(grads, self.param_groups[0]["params"][0].device).sqrt()
        self._global_grad_norm = norm
        self.grad_scale = None
        if self.skip_nonfinite:
            self.found_inf = (~torch.isfinite(norm)).float()
            self.overflow = bool(self.found_inf)
        if self.clip > 0.0:
            self.grad_scale = clip_divisor(norm, self.clip)
        return super().step(closure)
