"""Held-out loss, scored under the training contract (sum of token cross-entropies over all held-out samples /
their counted target tokens, docs/design.md §1.1). The samples are the last data.eval_samples of the training
data (never trained on), or every sample of data.eval_path.

Every layout gives the same number. dp rank r takes samples r, r + dp, ... of the held-out list. Each rank runs
the same number of micro-batches, because ZeRO-3 gathers parameters collectively in every forward; the missing
samples are filled with a fully masked one, which counts no tokens. The sums and counts are all-reduced over
every rank. CP ranks of a group hold chunks of the same sample, as in training.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.distributed as dist

from ds_ulysses_ext import IGNORE_INDEX, Topology, shard_batch

from ..data import build_dataset, collate


def eval_set(data_cfg, dataset: Sequence[dict], seed: int, vocab_size: int) -> tuple[int, Sequence[dict], list[int]]:
    """(training samples, evaluation dataset, its indices to score)."""
    if not data_cfg.eval_path:
        num_train, indices = eval_split(len(dataset), data_cfg.eval_samples)
        return num_train, dataset, indices
    held, _, _ = build_dataset(dataclasses.replace(data_cfg, path=data_cfg.eval_path), seed=seed, vocab_size=vocab_size)
    if len(held) == 0:
        raise ValueError(f"data.eval_path={data_cfg.eval_path} holds no sample of at most data.seq_len tokens; "
                         "check the file, or data.overlong")
    return len(dataset), held, list(range(len(held)))


def eval_split(num_samples: int, eval_samples: int) -> tuple[int, list[int]]:
    """(training samples, held-out indices): the held-out samples are the last ones, so training keeps 0..n-1."""
    if not 0 <= eval_samples < num_samples:
        raise ValueError(f"data.eval_samples={eval_samples} must be in [0, {num_samples}) for a dataset of "
                         f"{num_samples} samples, leaving some to train on; lower data.eval_samples or add data")
    return num_samples - eval_samples, list(range(num_samples - eval_samples, num_samples))


def local_eval_batches(indices: list[int], dp_rank: int, dp: int, micro_batch_size: int) -> list[list]:
    """This dp rank's micro-batches of held-out indices; None marks a filler slot. Same count on every rank."""
    per_rank = math.ceil(len(indices) / dp)
    per_rank = math.ceil(per_rank / micro_batch_size) * micro_batch_size
    mine = indices[dp_rank::dp]
    mine = mine + [None] * (per_rank - len(mine))
    return [mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]


def _masked(sample: dict) -> dict:
    return {**sample, "labels": torch.full_like(sample["labels"], IGNORE_INDEX)}


@torch.no_grad()
def evaluate(engine, dataset, indices: list[int], topo: Topology, dp: int, micro_batch_size: int,
             seq_len: int, pad_id: int, device: torch.device) -> tuple[float, int]:
    """(held-out loss, counted target tokens), the same on every rank."""
    filler = _masked(dataset[indices[0]])
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    engine.eval()
    try:
        for idx in local_eval_batches(indices, topo.dp_rank, dp, micro_batch_size):
            batch = collate([dataset[i] if i is not None else filler for i in idx], seq_len, pad_id)
            shard = {k: v.to(device) for k, v in shard_batch(batch, topo, pad_id).items()}
            local_sum, local_count = engine(**shard)
            total += torch.stack([local_sum.double(), local_count.double()])
    finally:
        engine.train()
    dist.all_reduce(total)  # every dp x cp rank scored its own chunks
    return float(total[0]) / max(float(total[1]), 1.0), int(total[1])
