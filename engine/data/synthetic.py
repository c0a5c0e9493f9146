"""`SyntheticDataset`: random token sequences with some masked labels, deterministic from the seed.

Each sample is generated on access from its own generator, seeded by (seed, index), so the dataset costs no
memory at long seq_len, any rank can read any index, and sample i is the same whoever asks and in what order.
The global RNG is never touched.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from .batch import IGNORE_INDEX

# Every 4th sample (index % 4 == 0) also has this leading share of its labels masked. More than half, so that
# after the causal shift the first cp chunk is entirely masked for every cp >= 2: the case where a rank holds
# no target at all must be exercised by tests, not left to chance.
MASKED_RUN_FRACTION = 0.6


def masked_run_length(seq_len: int) -> int:
    return math.ceil(MASKED_RUN_FRACTION * seq_len)


class SyntheticDataset(Sequence):
    """`num_samples` sequences of exactly `seq_len` tokens drawn uniformly from [0, vocab_size).

    Labels are the input ids with `round(masked_fraction * seq_len)` random positions set to -100; when
    `masked_fraction > 0`, samples with index % 4 == 0 additionally have their first
    `ceil(0.6 * seq_len)` labels masked, so the dataset-wide masked share is somewhat above
    `masked_fraction`. `masked_fraction = 0` gives fully unmasked data.
    """

    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, masked_fraction: float, seed: int):
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.masked_fraction = masked_fraction
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not isinstance(index, int):
            raise TypeError(f"SyntheticDataset indices must be int, got {type(index).__name__}")
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        g = torch.Generator().manual_seed(self._sample_seed(index))
        input_ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g, dtype=torch.long)
        labels = input_ids.clone()
        if self.masked_fraction > 0:
            k = round(self.masked_fraction * self.seq_len)
            labels[torch.randperm(self.seq_len, generator=g)[:k]] = IGNORE_INDEX
            if index % 4 == 0:
                labels[: masked_run_length(self.seq_len)] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}

    def _sample_seed(self, index: int) -> int:
        # A hash rather than seed * n + index: neighbouring seeds must not give shifted copies of one dataset.
        digest = hashlib.blake2b(f"synthetic/{self.seed}/{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)
