"""The first-use check every hand-written Triton kernel passes before it replaces its torch path: run the kernel and
the torch path on a small case, compare them norm-wise, log the verdict. Never raises: a kernel that fails to build,
to launch or to agree leaves the torch path in place (slower, never wrong), and the log says why."""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

log = logging.getLogger(__name__)


def agrees(what: str, device: torch.device, dtype: torch.dtype,
           pairs: Callable[[], Iterable[tuple[str, torch.Tensor, torch.Tensor, float]]]) -> bool:
    """`pairs()` -> (name, kernel's tensor, torch's tensor, relative tolerance of the difference's norm) each."""
    try:
        bad = [name for name, got, ref, tol in pairs()
               if not float((got.float() - ref.float()).norm()) <= tol * float(ref.float().norm())]
    except Exception as err:  # a Triton build or launch failure: the torch path still trains
        log.warning("%s failed on %s %s (%s: %s); using torch's", what, device, dtype, type(err).__name__, err)
        return False
    if bad:
        log.warning("%s disagree with torch on %s %s (%s); using torch's", what, device, dtype, ", ".join(bad))
        return False
    log.info("%s checked against torch on %s (%s)", what, device, dtype)
    return True
