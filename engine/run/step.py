"""One optimizer step: shard the micro-batches, count the global tokens, forward/backward, step.

The normaliser (non-masked targets in the whole global batch, all dp ranks and micro-batches) is
all-reduced BEFORE the first backward, so every micro-batch's share is final when it is backpropagated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ds_ulysses_ext import IGNORE_INDEX, Topology, shard_batch

from ..observe.profile import phase


@dataclass
class StepResult:
    loss: float          # global-batch mean token cross-entropy (docs/design.md §1.1)
    grad_norm: float     # global gradient norm before clipping, as DeepSpeed computed it
    tokens: int          # non-masked target tokens in the global batch
    input_tokens: int    # sequence positions processed in the global batch (padding to seq_len included)
    moe_aux_loss: Optional[float] = None  # MoE: the per-sequence balance loss, mean over sequences, sum over layers
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
               pad_token_id: int = 0, phase_times: bool = False, moe_aux_coef: Optional[float] = None) -> StepResult:
    """`moe_aux_coef`: None for a dense model; for an MoE model the balance loss's weight (0 = logged only)."""
    shards = [{k: v.to(device) for k, v in _shard(mb, topo, pad_token_id, moe_aux_coef is not None).items()}
              for mb in micro_batches]
    counts = torch.tensor([sum(int((s["labels"] != IGNORE_INDEX).sum()) for s in shards),
                           sum(s["input_ids"].numel() for s in shards),
                           sum(s["input_ids"].shape[0] for s in shards) / topo.cp_size],
                          dtype=torch.float64, device=device)
    dist.all_reduce(counts)  # over all dp x cp ranks: each rank counted its own chunks (a row once per cp rank)
    global_tokens = int(counts[0])
    denom = max(global_tokens, 1)  # a fully masked global batch has loss 0 and zero gradients
    rows = max(float(counts[2]), 1.0)  # sequences in the global batch: the balance loss is a mean over them
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_seen = False  # moe.balance=aux only
    clock = _PhaseClock(phase_times, device)
    clock.mark()
    for shard in shards:
        with phase("forward"):
            local_sum, _ = engine(**shard)
            share = local_sum * (scale / denom)
            aux = getattr(engine.module, "moe_aux_share", None)
            if aux is not None:  # this rank's part of the sequences' balance loss (ds_ulysses_ext/moe/balance.py)
                aux_seen = True
                aux_sum += aux.detach().double()
                if moe_aux_coef:
                    share = share + aux * (scale * moe_aux_coef / rows)
        clock.mark("forward")
        with phase("backward"):
            engine.backward(share, scale_wrt_gas=False)
        clock.mark("backward")
        with phase("optimizer"):
            engine.step()  # the optimizer runs only at the accumulation boundary
        clock.mark("optimizer")
        loss_sum += local_sum.detach().double()
    totals = torch.stack([loss_sum, aux_sum])
    dist.all_reduce(totals)
    grad_norm = engine.get_global_grad_norm()
    return StepResult(loss=float(totals[0]) / denom, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                      tokens=global_tokens, input_tokens=int(counts[1]), phase_s=clock.totals,
                      moe_aux_loss=float(totals[1]) / rows if aux_seen else None)


def _shard(micro_batch: dict, topo: Topology, pad_token_id: int, moe: bool) -> dict:
    shard = shard_batch(micro_batch, topo, pad_token_id)
    if moe:  # the balance statistics count real tokens only: the mask, split and padded exactly like the tokens
        mask = micro_batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(micro_batch["input_ids"])
        shard["moe_token_mask"] = shard_batch({"input_ids": mask}, topo, 0)["input_ids"]
    return shard
