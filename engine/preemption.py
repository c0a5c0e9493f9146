"""Preemption: SIGTERM or SIGUSR1 (what schedulers send before killing a job) asks the run to checkpoint
and stop at the next step boundary.

A signal reaches ranks at different moments, so the flag is all-reduced (MAX) once per step: every rank
stops after the same step and the checkpoint is collective and complete. The all-reduce is one int per
step, negligible beside a long-context step.
"""
from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame):
        self.requested = True
        log.warning("received %s: checkpointing and stopping after the current step", signal.Signals(signum).name)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has been signalled (collective)."""
        flag = torch.tensor([int(self.requested)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
