"""`GlobalBatchSampler`: which dataset indices make up optimizer step k, the same for every layout.

docs/design.md §1.1: the samples of step k depend only on the seed, the data and the global batch size, never on
world size, dp/cp layout or gradient accumulation. So the sampler first fixes the step's global list of
`global_batch_size` indices, and only then cuts it into dp-rank parts and micro-batches.

Resume: the sampler holds no state that training advances; step k's indices are a pure function of
(num_samples, global_batch_size, seed, k). A resumed run only needs the step number to continue exactly.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class GlobalBatchSampler:
    """Epochs of fresh permutations, concatenated, read `global_batch_size` at a time.

    Epoch e is `torch.randperm(num_samples)` from `torch.Generator().manual_seed(seed + e)`; step k takes
    positions `[k*G, (k+1)*G)` of the concatenated stream. One adjustment keeps a step free of duplicates when
    it straddles an epoch boundary: the new epoch's samples that the step already holds from the end of the old
    epoch are moved back, just behind the step, keeping their order (a stable partition). Every epoch is still
    a permutation, so each epoch covers the dataset exactly once and no sample is skipped.
    """

    _CACHE_EPOCHS = 3  # a step touches at most two epochs; one more avoids recomputing on the way forward

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (num_samples={num_samples}); check data.path / data.num_samples")
        if global_batch_size < 1:
            raise ValueError(f"trainer.global_batch_size={global_batch_size} must be >= 1")
        if global_batch_size > num_samples:
            raise ValueError(
                f"trainer.global_batch_size={global_batch_size} is larger than the dataset ({num_samples} samples), "
                "so a step would have to repeat samples; lower trainer.global_batch_size or use more data "
                "(data.num_samples for synthetic data)"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._orders: OrderedDict[int, torch.Tensor] = OrderedDict()  # least recently used first

    def indices_for_step(self, step: int) -> list[int]:
        """The `global_batch_size` dataset indices of optimizer step `step` (0-based), in a fixed order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, g = self.num_samples, self.global_batch_size
        out: list[int] = []
        pos, end = step * g, (step + 1) * g
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            out += self._order(epoch)[offset : offset + take].tolist()
            pos += take
        return out

    def local_indices(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[list[int]]:
        """This dp rank's micro-batches of step `step`, in gradient-accumulation order.

        The global list is cut into `dp_size` equal contiguous parts (rank r takes part r), and each part into
        micro-batches of `micro_batch_size`. Concatenating all ranks' micro-batches in rank order gives back
        `indices_for_step(step)`.
        """
        g = self.global_batch_size
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must be >= 1")
        if g % dp_size:
            raise ValueError(
                f"trainer.global_batch_size={g} is not divisible by the data-parallel size dp={dp_size}; "
                f"choose a global batch size that is a multiple of {dp_size}"
            )
        per_rank = g // dp_size
        if per_rank % micro_batch_size:
            raise ValueError(
                f"each dp rank gets trainer.global_batch_size / dp = {g} / {dp_size} = {per_rank} samples, which "
                f"trainer.micro_batch_size={micro_batch_size} does not divide; choose a micro batch size that "
                f"divides {per_rank}, or a global batch size that is a multiple of dp x micro = "
                f"{dp_size * micro_batch_size}"
            )
        mine = self.indices_for_step(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]

    # -- epoch orders -------------------------------------------------------------------------------------

    def _raw(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _straddle(self, epoch: int) -> int:
        """How many samples of epoch-1 share a step with the start of `epoch` (0: the boundary is a step edge)."""
        return (epoch * self.num_samples) % self.global_batch_size if epoch > 0 else 0

    def _tail_is_raw(self, epoch: int) -> bool:
        """Whether the tail of `epoch` that the next epoch needs is untouched by `epoch`'s own adjustment.

        The adjustment only rearranges the first G positions of an epoch, so the tail of length r is raw when
        there was no adjustment or G + r <= num_samples. That lets a far-away epoch be computed directly
        instead of walking from epoch 0 (which only small datasets, num_samples < 2G, need).
        """
        r_next = self._straddle(epoch + 1)
        return self._straddle(epoch) == 0 or self.global_batch_size + r_next <= self.num_samples

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch in self._orders:
            self._orders.move_to_end(epoch)
            return self._orders[epoch]
        start = epoch
        while (
            start > 0 and self._straddle(start) and start - 1 not in self._orders and not self._tail_is_raw(start - 1)
        ):
            start -= 1
        for e in range(start, epoch + 1):
            r = self._straddle(e)
            if r == 0:
                order = self._raw(e)
            else:
                prev = self._orders[e - 1] if e - 1 in self._orders else self._raw(e - 1)
                order = self._separate(self._raw(e), prev[-r:])
            self._orders[e] = order
            while len(self._orders) > self._CACHE_EPOCHS:  # e and e - 1 are the newest, so they stay
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def _separate(self, perm: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """Stable-partition the head of `perm` so that its first G - len(tail) entries avoid `tail`."""
        head_len = self.global_batch_size - tail.numel()
        window = perm[: self.global_batch_size]  # head_len picks + at most len(tail) clashes fit in G entries
        clash = torch.isin(window, tail)
        picks = (~clash).nonzero().flatten()[:head_len]
        scan_end = int(picks[-1]) + 1
        skipped = window[:scan_end][clash[:scan_end]]
        return torch.cat([window[picks], skipped, perm[scan_end:]])
