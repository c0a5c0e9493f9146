"""Preemption: SIGTERM or SIGUSR1 (what schedulers send before killing a job) asks the run to checkpoint
and stop at the next step boundary; `trainer.save_every_minutes` asks for a checkpoint when that much wall
time has passed since the last one (a long-context step can take minutes, so a step count is a poor clock for
how much work a preemption may lose). `trainer.max_minutes` ends the run early, as a last step would (final
evaluation, checkpoint, HF export), after the first step that ends past that wall time: a job with a time limit
leaves a finished, exported model instead of a killed one.

A signal reaches ranks at different moments, and their clocks differ, so both flags are all-reduced (MAX)
once per step, the clock's from rank 0 alone: every rank stops or saves after the same step, and the
checkpoint is collective and complete. The all-reduce is two ints per step, negligible beside a long-context
step.
"""
from __future__ import annotations

import logging
import signal
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, save_every_minutes: float = 0.0, max_minutes: float = 0.0):
        self.requested = False
        self.save_every_s = 60.0 * save_every_minutes
        self.max_s = 60.0 * max_minutes
        self._start = self._last_save = time.monotonic()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame):
        self.requested = True
        log.warning("received %s: checkpointing and stopping after the current step", signal.Signals(signum).name)

    def saved(self) -> None:
        """A checkpoint was just written (by any trigger): the clock starts again."""
        self._last_save = time.monotonic()

    def agreed(self, device: torch.device, is_main: bool) -> tuple[bool, bool, bool]:
        """(stop, save, out_of_time) on every rank: stop once any rank has been signalled; save when rank 0's
        clock says a timed checkpoint is due; out_of_time when rank 0's clock passed trainer.max_minutes
        (collective)."""
        now = time.monotonic()
        due = is_main and self.save_every_s > 0 and now - self._last_save >= self.save_every_s
        late = is_main and self.max_s > 0 and now - self._start >= self.max_s
        flags = torch.tensor([int(self.requested), int(due), int(late)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, save, out_of_time = flags.tolist()
        return bool(stop), bool(save), bool(out_of_time)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
