"""The batch convention: the ignore label, right-padding into a `[B, seq_len]` batch, and the target count.

Labels stay UNSHIFTED here (HF convention: `labels[i]` is the target of position `i` before the causal shift).
The shift happens later on the full sequence, before it is split over cp ranks, so that the first token of
every cp chunk is still predicted by the previous chunk's last position (docs/design.md §1.1).
"""

from __future__ import annotations

import torch

from ds_ulysses_ext import IGNORE_INDEX  # one definition: the label shift and the loss use it too

from .errors import DataError


def collate(samples: list[dict], seq_len: int, pad_id: int) -> dict:
    """Right-pads every sample to exactly `seq_len` (not to a multiple of cp: sharding does that later).

    Returns `input_ids` (pad = `pad_id`), `labels` (pad = -100) and `attention_mask` (1 real, 0 pad), all
    `[B, seq_len]` long. A fixed width keeps every micro-batch the same shape whatever the layout. Packed rows
    (data.pack, packing.py) also carry `position_ids`, restarting per document; the pads continue the last
    document's positions, so they open no document of their own.
    """
    if not samples:
        raise DataError("collate got an empty list of samples; a micro-batch needs at least one sample")
    b = len(samples)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, seq_len), dtype=torch.long)
    packed = "position_ids" in samples[0]
    position_ids = torch.zeros((b, seq_len), dtype=torch.long) if packed else None
    for row, s in enumerate(samples):
        n = s["input_ids"].numel()
        if s["labels"].numel() != n:
            raise DataError(f"sample {row} has {n} input_ids but {s['labels'].numel()} labels; they must align")
        if not 1 <= n <= seq_len:
            raise DataError(
                f"sample {row} has {n} tokens but data.seq_len={seq_len}; build_dataset should have truncated or "
                "dropped it: build the dataset and the batches with the same data.seq_len"
            )
        input_ids[row, :n] = s["input_ids"]
        labels[row, :n] = s["labels"]
        attention_mask[row, :n] = 1
        if packed:
            position_ids[row, :n] = s["position_ids"]
            position_ids[row, n:] = s["position_ids"][-1] + torch.arange(1, seq_len - n + 1)
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if packed:
        out["position_ids"] = position_ids
    return out


def count_target_tokens(labels_unshifted: torch.Tensor) -> int:
    """Number of non-masked targets after the causal shift: `(labels[..., 1:] != -100).sum()`.

    This is the count that goes into the global loss normaliser (docs/design.md §1.1): summed over every sample of
    the global batch (all dp ranks, all micro-batches) it is the denominator of the step's loss and the
    `tokens` metric. Position 0's label is never a target (nothing precedes it), hence the `1:`. Accepts
    `[L]` or `[B, L]`; padding is -100 so padded batches count the same as unpadded samples.
    """
    return int((labels_unshifted[..., 1:] != IGNORE_INDEX).sum().item())
