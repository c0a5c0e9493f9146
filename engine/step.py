"""One optimizer step: shard the micro-batches, count the global tokens, forward/backward, step.

The normaliser (non-masked targets in the whole global batch, all dp ranks and micro-batches) is
all-reduced BEFORE the first backward, so every micro-batch's share is final when it is backpropagated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ds_ulysses_ext import IGNORE_INDEX, Topology, shard_batch

from .profile import phase


@dataclass
class StepResult:
    loss: float          # global-batch mean token cross-entropy (docs/design.md §1.1)
    grad_norm: float     # global gradient norm before clipping, as DeepSpeed computed it
    tokens: int          # non-masked target tokens in the global batch
    input_tokens: int    # sequence positions processed in the global batch (padding to seq_len included)
    phase_s: dict = field(default_factory=dict)  # forward / backward / optimizer seconds, when timed


class _PhaseClock:
    """Accumulates wall time per phase, synchronising the device at each boundary (only when enabled)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.totals = enabled, device, {}
        self._t = None

    def mark(self, phase: str = None) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if phase is not None:
            self.totals[phase] = self.totals.get(phase, 0.0) + now - self._t
        self._t = now


def train_step(engine, micro_batches: list[dict], topo: Topology, scale: float, device: torch.device,
               pad_token_id: int = 0, phase_times: bool = False) -> StepResult:
    shards = [{k: v.to(device) for k, v in shard_batch(mb, topo, pad_token_id).items()} for mb in micro_batches]
    counts = torch.tensor([sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in shards),
                           sum(s["input_ids"].numel() for s in shards)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)  # over all dp x cp ranks: each rank counted its own chunks
    global_tokens = int(counts[0])
    denom = max(global_tokens, 1)  # a fully masked global batch has loss 0 and zero gradients
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    clock = _PhaseClock(phase_times, device)
    clock.mark()
    for shard in shards:
        with phase("forward"):
            local_sum, _ = engine(**shard)
        clock.mark("forward")
        with phase("backward"):
            engine.backward(local_sum * (scale / denom), scale_wrt_gas=False)
        clock.mark("backward")
        with phase("optimizer"):
            engine.step()  # the optimizer runs only at the accumulation boundary
        clock.mark("optimizer")
        loss_sum += local_sum.detach().double()
    dist.all_reduce(loss_sum)
    grad_norm = engine.get_global_grad_norm()
    return StepResult(loss=float(loss_sum) / denom, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                      tokens=global_tokens, input_tokens=int(counts[1]), phase_s=clock.totals)
