"""Preemption: SIGTERM or SIGUSR1 (what schedulers send before killing a job) asks the run to checkpoint
and stop at the next step boundary; `trainer.save_every_minutes` asks for a checkpoint when that much wall
time has passed since the last one (a long-context step can take minutes, so a step count is a poor clock for
how much work a preemption may lose).

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
    def __init__(self, save_every_minutes: float = 0.0):
        self.requested = False
        self.save_every_s = 60.0 * save_every_minutes
        self._last_save = time.monotonic()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame):
        self.requested = True
        log.warning("received %s: checkpointing and stopping after the current step", signal.Signals(signum).name)

    def saved(self) -> None:
        """A checkpoint was just written (by any trigger): the clock starts again."""
        self._last_save = time.monotonic()

    def agreed(self, device: torch.device, is_main: bool) -> tuple[bool, bool]:
        """(stop, save) on every rank: stop once any rank has been signalled; save when rank 0's clock says a
        timed checkpoint is due (collective)."""
        due = is_main and self.save_every_s > 0 and time.monotonic() - self._last_save >= self.save_every_s
        flags = torch.tensor([int(self.requested), int(due)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, save = flags.tolist()
        return bool(stop), bool(save)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
