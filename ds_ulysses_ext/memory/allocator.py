"""The CUDA caching allocator's settings for long context, and the peak-memory report.

`allocator_env` returns the environment the engine sets before CUDA is initialised (the allocator
reads PYTORCH_CUDA_ALLOC_CONF once, at its first allocation). expandable_segments lets a segment grow
in place instead of leaving differently sized blocks behind, which at long context is what turns a
fitting step into an OOM with many GiB reserved but unallocated.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def allocator_env(memory_cfg, current: Optional[str] = None) -> dict:
    """{"PYTORCH_CUDA_ALLOC_CONF": ...} to set before CUDA init, or {} when nothing is to change.

    Other options already in the variable (`current`, default: the process environment) are kept; an
    explicit expandable_segments setting there wins over the config.
    """
    if not memory_cfg.expandable_segments:
        return {}
    current = os.environ.get(ALLOC_CONF, "") if current is None else current
    options = [o for o in current.split(",") if o.strip()]
    if any(o.split(":")[0].strip() == "expandable_segments" for o in options):
        return {}
    return {ALLOC_CONF: ",".join(options + [EXPANDABLE])}


def memory_report(device=None) -> dict:
    """Peak allocated / reserved GiB on a CUDA device since the last reset; zeros elsewhere."""
    device = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
