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


HALF = (torch.bfloat16, torch.float16)
TOLERANCE = 2e-2  # bf16 inputs: a fused kernel and the exact one differ by rounding only (~1e-3)


def fused_shape_ok(t: torch.Tensor) -> bool:
    """What the fused CUDA kernels (cuDNN's, flash) take: a CUDA tensor in bf16/fp16, head dim a multiple of 8 up
    to 256. Whether a kernel then passes its first-use check is each caller's own."""
    D = t.shape[-1]
    return t.is_cuda and t.dtype in HALF and D % 8 == 0 and D <= 256


def relative_error(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    # a log-sum-exp is an exponent: absolute error; everything else relative in the norm
    if name == "lse":
        return (got.float() - ref.float()).abs().max().item()
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def first_disagreement(named, tolerance: float = TOLERANCE) -> "tuple[str, float] | None":
    """(name, error) of the first (name, got, ref) over `tolerance`, or None when all agree."""
    for name, got, ref in named:
        err = relative_error(name, got, ref)
        if not err < tolerance:
            return name, err
    return None
