"""The CP loss: local token-loss sums, a global normaliser, chunked logits, and a CP-group sum.

Legend: B batch, s local sequence, H hidden, V vocab, T = B * s local tokens, C chunk tokens.

DESIGN 3.1: the objective is (sum of token cross-entropies over the global batch) / (non-masked tokens
in the global batch). Each rank contributes its local sum divided by that global count; the shares of
all ranks add up to the objective. How the engine then combines per-rank gradients is the engine's
business (engine/grad_reduction.py multiplies the share by the factor the reduction path needs).

Logits are never all-gathered and never exist for the whole local sequence: lm_head + fp32
cross-entropy run on chunks of C tokens, each under activation checkpointing, so at most one
[C, V] fp32 block is alive in forward and in backward. Every rank runs the same number of chunks
(local lengths are equal across ranks), which ZeRO-3's collective parameter gathers require.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .batch import IGNORE_INDEX
from .comm import all_reduce_sum
from .topology import Topology


def _chunk_ce_sum(lm_head: torch.nn.Module, hidden_CH: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    logits_CV = lm_head(hidden_CH).float()  # fp32 logits for an exact softmax, one chunk at a time
    return F.cross_entropy(logits_CV, labels_C, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_lm_loss_sum(lm_head: torch.nn.Module, hidden_BsH: torch.Tensor, labels_Bs: torch.Tensor,
                        chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies over this rank's tokens, and how many tokens counted.

    labels are already shifted (shard_batch), -100 = no loss. Returns (fp32 scalar sum, int64 count).
    """
    if chunk_size <= 0:
        raise ValueError(f"loss chunk size must be positive, got {chunk_size} (trainer.loss_chunk_size)")
    hidden_TH = hidden_BsH.reshape(-1, hidden_BsH.shape[-1])
    labels_T = labels_Bs.reshape(-1)
    total = hidden_TH.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_TH.shape[0], chunk_size):
        h, y = hidden_TH[start:start + chunk_size], labels_T[start:start + chunk_size]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_ce_sum, lm_head, h, y, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(lm_head, h, y)
    return total, (labels_T != IGNORE_INDEX).sum()


def cp_sum(x: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Sum a per-rank partial (e.g. a sequence's log-prob sum) over the CP group, with autograd.

    For sequence-level objectives (GRPO/DPO): every CP rank gets the full-sequence value. The backward
    all-reduces gradients, so each rank must backprop a share of the objective such that the shares
    over the CP group sum to it (e.g. objective / cp when every rank computes the same objective).
    """
    return all_reduce_sum(x, topology.cp_group)
