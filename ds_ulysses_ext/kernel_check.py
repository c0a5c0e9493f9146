"""The first-use check of a fused kernel (ring_blocks.py, flash_varlen.py): where it runs, and how it compares.

A check runs at the kernel's first call, which is inside a model's forward: possibly under activation
checkpointing (whose saved-tensor hooks would count the check's tensors as the layer's, and the recompute, which
finds the check cached, would then save fewer and fail), under no_grad or inference mode (an eval first, where
the check's own backward could not run and the kernel would be left out for the whole run). `isolated()` gives
the check a context of its own: grad on, inference mode off, saved tensors kept as they are.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def isolated():
    with torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


def relative_error(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    # a log-sum-exp is an exponent: absolute error; everything else relative in the norm
    if name == "lse":
        return (got.float() - ref.float()).abs().max().item()
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
