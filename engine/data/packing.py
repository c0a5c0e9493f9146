"""`data.pack=true`: documents packed greedily into rows of `data.seq_len` tokens, the same rows on every layout.

A row is a list of dataset indices. Packing reads only the samples' lengths, in dataset order, so the rows
depend on the data and seq_len alone, never on the world size or cp; the step sampler then draws rows as it
drew samples. Each sample goes into the open row with the least room that still holds it (best fit), else
opens a new row; ties go to the older row. That keeps dataset order within a row and wastes little: the
data summary line reports the efficiency, real tokens / (rows x seq_len).

A packed row carries `position_ids` restarting at 0 for each document (HF's packing convention): shard_batch
turns them into the documents' boundaries, so attention and labels never cross from one document into the
next. The first label of every document is set to -100 too, as HF's DataCollatorWithFlattening does: it is
never a target (nothing in its document precedes it), and the row's target count then equals its documents'.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import dataclasses
from typing import Any

import torch

from .batch import IGNORE_INDEX
from .errors import DataError
from .stats import DataStats
from .synthetic import SyntheticDataset


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Greedy best-fit packing of samples (in index order) into rows of at most seq_len tokens."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row index), sorted: best fit is the first that fits
    for index, n in enumerate(lengths):
        if not 1 <= n <= seq_len:
            raise ValueError(f"sample {index} has {n} tokens; packing needs 1..data.seq_len={seq_len}")
        at = bisect.bisect_left(open_rows, (n, -1))
        if at == len(open_rows):
            row, room = len(rows), seq_len - n
            rows.append([index])
        else:
            room, row = open_rows.pop(at)
            room -= n
            rows[row].append(index)
        if room > 0:
            bisect.insort(open_rows, (room, row))
    return rows


def sample_lengths(dataset: Sequence[dict]) -> list[int]:
    if isinstance(dataset, SyntheticDataset):  # every sample is seq_len long; generating them would cost
        return [dataset.seq_len] * len(dataset)
    return [int(sample["input_ids"].numel()) for sample in dataset]


class PackedDataset(Sequence):
    """Rows of packed samples: {"input_ids", "labels", "position_ids"} of at most seq_len tokens each."""

    def __init__(self, samples: Sequence[dict], seq_len: int):
        self.samples = samples
        self.seq_len = seq_len
        lengths = sample_lengths(samples)
        self.rows = pack_rows(lengths, seq_len)
        self.num_tokens = sum(lengths)

    @property
    def efficiency(self) -> float:
        return self.num_tokens / max(len(self.rows) * self.seq_len, 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        docs = [self.samples[i] for i in self.rows[index]]
        labels = [d["labels"].clone() for d in docs]
        for lab in labels:
            lab[0] = IGNORE_INDEX
        return {"input_ids": torch.cat([d["input_ids"] for d in docs]),
                "labels": torch.cat(labels),
                "position_ids": torch.cat([torch.arange(d["input_ids"].numel()) for d in docs])}


def pack_dataset(samples: Sequence[dict], stats: DataStats, cfg: Any) -> tuple["PackedDataset", DataStats]:
    """(rows, stats with the packing's row count and efficiency) for data.pack=true."""
    if cfg.source == "passkey":
        raise DataError("data.pack=true packs documents of a file (data.source=jsonl or demo); passkey samples are "
                        "generated at their own lengths, one per row. Set data.pack=false")
    packed = PackedDataset(samples, cfg.seq_len)
    return packed, dataclasses.replace(stats, num_rows=len(packed), pack_efficiency=packed.efficiency,
                                       pack_seq_len=cfg.seq_len)
