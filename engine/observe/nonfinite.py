"""What a step with an inf/NaN loss or gradient norm does: stop the run loudly, or (asked for) be skipped.

Both numbers are global (all-reduced), so every rank reaches the same verdict and no rank waits alone in a
collective. The gradient norm is non-finite whenever any gradient element is, so it stands in for DeepSpeed's
per-tensor overflow scan, which trainer.on_nonfinite=skip alone turns on (engine/ds/config.py).
"""
from __future__ import annotations

import math

from ..run.step import StepResult


class NonFiniteStep(RuntimeError):
    """The run stopped at a step whose loss or gradient norm was inf or NaN (trainer.on_nonfinite=abort)."""

    def __init__(self, step: int, result: StepResult, latest_checkpoint: str | None):
        where = f"the latest checkpoint is {latest_checkpoint}" if latest_checkpoint else "no checkpoint was saved"
        super().__init__(
            f"step {step}: loss={result.loss} grad_norm={result.grad_norm} is not finite, so the run stops "
            f"(trainer.on_nonfinite=abort); the step is in metrics.jsonl, nothing after it is saved, and {where}. "
            "Usual causes: a learning rate too high for the warmup, a corrupt sample, or an overflow in a custom "
            "layer. To drop such steps and go on instead: trainer.on_nonfinite=skip"
        )


def judge(result: StepResult, policy: str) -> tuple[bool, bool]:
    """(skipped, fatal) for a finished step. A non-finite gradient norm means DeepSpeed dropped the update (skip
    turns on its bf16 ZeRO-2 scan; its other paths drop by the norm); skip reports that, abort stops. A
    non-finite loss beside finite gradients was applied, so it is fatal under both."""
    grad_ok, loss_ok = math.isfinite(result.grad_norm), math.isfinite(result.loss)
    skipped = policy == "skip" and not grad_ok
    fatal = not skipped and not (grad_ok and loss_ok)
    return skipped, fatal


def skipped_warning(step: int, result: StepResult) -> str:
    return (f"step {step} skipped: grad_norm={result.grad_norm} is not finite (loss={result.loss}); DeepSpeed "
            "left the weights and optimizer state as they were (trainer.on_nonfinite=skip)")
