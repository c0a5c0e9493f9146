"""The scales of fp8.recipe=delayed: each operand of each delayed MLP casts with a scale made from the amaxes of earlier
steps (Transformer Engine's delayed scaling), not from a pass over the operand itself.

Legend: n the delayed sites (a gated MLP, or linears reading one input: q/k/v, o_proj), each a row of S = 8 operand
slots of its kind (kernels/fp8_casts.py SLOTS), L = fp8.amax_history.

    amax     [n, S]     this step's, raised (max) by every cast: forward, recomputed forward and backward alike, and
                        over the micro-steps of one optimizer step
    history  [L, n, S]  the last L steps' amaxes, newest first
    scales   [n, S]     float8 max / max(history): what this step casts with
    covered  [n, S]     max(history) at the last roll: the largest |value| a scale represents without clamping
    unseen   [n, S]     host bools: covered == 0 in a slot the row's kind uses: those take their own amax this step

Why a step's state changes only in `finish_step` (after the optimizer step): a recomputed forward must cast as its
first run did, and every micro-step of a step with the same scales; raising the amax with a max makes both
idempotent. The first step has no history: each op takes its operand's own amax first, as tensorwise does (so does any
slot whose history is all zero, and a resumed run whose checkpoint holds no history).

Across ranks the amaxes are all-reduced (max) at the roll, so every rank casts with the same scales; dynamic tensorwise
scaling gives each rank the amax of its own tokens.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from typing import Sequence

from .fp8_casts import DTYPES, JOINED, SLOTS, WIDTH


class DelayedScales:
    def __init__(self, kinds: Sequence[str], history: int, device: torch.device) -> None:
        """kinds: each row's, "mlp" or "linears" (kernels/fp8_casts.py SLOTS)."""
        if history < 1:
            raise ValueError(f"fp8.amax_history must be >= 1, got {history}")
        self.kinds = tuple(kinds)
        n = len(self.kinds)
        self.amax = torch.zeros(n, WIDTH, device=device)
        self.history = torch.zeros(history, n, WIDTH, device=device)
        self.scratch = torch.zeros(WIDTH, device=device)  # eval forwards raise this, which nothing reads
        self._fmax = torch.tensor([[torch.finfo(d).max for d in DTYPES[k]] for k in self.kinds], device=device,
                                  dtype=torch.float64).reshape(n, WIDTH)
        self._used = torch.tensor([[name is not None for name in SLOTS[k]] for k in self.kinds]).reshape(n, WIDTH)
        self._rescale()

    def finish_step(self, group=None) -> dict:
        """After each optimizer step, on every rank together (one all-reduce): roll the history, make the next step's
        scales, and say which operands clamped this step. Returns metrics for the step's row."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.amax, op=dist.ReduceOp.MAX, group=group)
        finite = torch.isfinite(self.amax)
        # a non-finite amax (an overflowing step, skipped or not) would make a scale of 0 for L steps: left out
        amax = torch.where(finite, self.amax, torch.zeros_like(self.amax))
        # slots that cast with a scale from the history, not their own amax
        held = (self._used & ~self.unseen).to(amax.device)
        over = torch.where(held, amax / self.covered.clamp(min=1e-30), torch.zeros_like(amax))
        clamped = (over > 1).cpu()
        record = {"fp8_saturated": int(clamped.sum()),  # operand slots whose values clamped this step
                  # which operands those are (x, h, the weights, the gradients), summed over the sites
                  "fp8_saturated_by_operand": dict(Counter(SLOTS[self.kinds[row]][slot]
                                                           for row, slot in clamped.nonzero().tolist())),
                  # the largest amax against what its scale covered: above 1, by how much the worst operand clamped
                  "fp8_amax_over_scale": float(over.max()),
                  "fp8_dynamic": int(self.unseen.sum()),  # slots that took their own amax (no history: step 1)
                  "fp8_nonfinite_amax": int((~finite).sum())}
        self.history = torch.roll(self.history, 1, dims=0)
        self.history[0] = amax
        self._rescale()
        self.amax.zero_()
        return record

    def _rescale(self) -> None:
        # torchao's amax_to_scale for each slot's dtype: float8 max / amax in fp64, the amax clamped at 1e-12. A slot
        # whose history is all zero (step 1, or an operand that was zero throughout) has no scale to trust: it takes
        # its own amax, as tensorwise does, rather than a scale of float8 max / 1e-12 that would flush it to zero
        self.covered = self.history.amax(0)
        self.scales = (self._fmax / self.covered.double().clamp(min=1e-12)).float()
        self.unseen = (self.covered == 0).cpu() & self._used  # read on the host by each forward: one copy a step

    def set_scales(self, row: int, scales: torch.Tensor) -> None:
        """Fixed scales for one row, as if its history had made them (tests and scripts/bench/bench_fp8_mlp.py)."""
        self.scales[row] = scales.to(self.scales)
        self.covered[row] = (self._fmax / self.scales[row].double()).float()
        self.unseen[row] = False

    def state_dict(self) -> dict:
        return {"slots": [SLOTS[k] for k in self.kinds], "history": self.history.cpu()}  # slots name the kinds

    def load_state_dict(self, state: dict) -> None:
        slots = [tuple(r) for r in state["slots"]]
        saved = state["history"].to(self.history.device)
        rows = None
        if len(slots) == len(self.kinds) and saved.shape[2:] == self.history.shape[2:]:
            rows = [_joined(saved[:, row], old, SLOTS[kind]) for row, (old, kind) in enumerate(zip(slots, self.kinds))]
        if rows is None or any(r is None for r in rows):
            raise RuntimeError(f"the checkpoint's fp8.recipe=delayed history is of {tuple(state['history'].shape)} "
                               f"({len(slots)} sites), this model's of {tuple(self.history.shape)} ({len(self.kinds)} "
                               "sites, or of other kinds): resume with the model and fp8.linears that wrote it")
        saved = torch.stack(rows, 1)
        length = min(len(saved), len(self.history))  # fp8.amax_history changed: keep the newest that fit
        self.history.zero_()
        self.history[:length] = saved[:length]
        self._rescale()


def _joined(history: torch.Tensor, old: tuple, new: tuple):
    """One site's history [L, WIDTH] by the slots `old` named, as slots `new`: a slot named alike is kept, and a joint
    slot takes the max over the per-linear slots it replaced (JOINED: checkpoints from before the joint casts of
    kernels/fp8_delayed.py), the amax its scale would have been made from. None where a slot of `new` finds none."""
    if old == new:
        return history
    out = torch.zeros_like(history)
    for j, name in enumerate(new):
        if name is None:
            continue
        src = [i for i, o in enumerate(old) if o is not None and (o == name or o in JOINED.get(name, ()))]
        if not src:
            return None
        out[:, j] = history[:, src].amax(-1)
    return out
