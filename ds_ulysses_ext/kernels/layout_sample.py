"""A few rows of a tensor the run really hands a kernel, laid out in memory as the original is: what the fused
kernels' first-use checks (providers.Checked) run on.

Shapes: any [..., rows, W] -> [<=2, ..., <=ROWS, W] (every leading dim cut to 2, the rows to ROWS); 1-D tensors (a
weight [W], labels [T]) are kept whole unless the op's rule cuts them (the loss head's labels, its weight's rows).

Why not a fresh input: a kernel's indexing depends on the layout (the row stride of a slice of torch.split, a
transposed view, a storage offset), and a contiguous randn has none of it. `same_layout` rebuilds a cut in another
dtype with the cut's own strides, and its storage offset's alignment, on a storage of its own, so a check can run it
in fp32 and in the run's dtype and differentiate it (the gradient lands on that storage, gaps included).
"""
from __future__ import annotations

import torch

from ..batch import IGNORE_INDEX

ROWS = 67           # not a multiple of any kernel's tile of rows: the partial tile runs too
HEAD_VOCAB = 1000   # the loss head's weight rows kept (no power of two: the kernel's tail over the vocabulary)
ALIGN = 64          # elements: the storage offset is kept modulo this (its alignment), plus ALIGN when non-zero


def layout_key(t: torch.Tensor) -> tuple:
    """What a kernel's indexing can depend on; the first input of each key is checked."""
    return (t.dtype, t.dim(), t.shape[-1] if t.dim() else None, t.stride()[-2:], _rows_merge(t),
            t.storage_offset() % ALIGN != 0, t.storage_offset() != 0, t.is_contiguous())


def _rows_merge(t: torch.Tensor) -> bool:
    if t.dim() < 2:
        return True
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}, strides {t.stride()}, offset {t.storage_offset()}"


def cut(t: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """Leading dims cut to 2, the second-to-last to `rows`; narrow keeps the strides and the offset."""
    if t.dim() < 2:
        return t
    for d in range(t.dim() - 2):
        t = t.narrow(d, 0, min(2, t.shape[d]))
    return t.narrow(t.dim() - 2, 0, min(rows, t.shape[-2]))


def sample_rows(op: str, tensors) -> tuple:
    if op == "linear_cross_entropy_sum":
        hidden, weight, labels = tensors
        hidden, weight = cut(hidden), cut(weight, HEAD_VOCAB)
        labels = labels.narrow(0, 0, hidden.shape[0])
        labels = torch.where(labels < 0, labels, labels % weight.shape[0])
        labels[::7] = IGNORE_INDEX  # the kernel's ignore_index path, whatever these rows hold
        return hidden, weight, labels
    return tuple(cut(t) for t in tensors)


def same_layout(t: torch.Tensor, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage, view): a fresh 1-D storage in `dtype` (t's when None) and t's values in a view of it with t's sizes,
    strides and offset alignment. Broadcast dims (stride 0) stay broadcast."""
    dtype = dtype or t.dtype
    offset = _offset(t)
    extent = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
    base = torch.zeros(extent if t.numel() else 0, dtype=dtype, device=t.device)
    if t.numel():
        with torch.no_grad():
            sizes = [1 if s == 0 else n for n, s in zip(t.shape, t.stride())]
            base.as_strided(sizes, t.stride(), offset).copy_(_first_of_broadcast(t))
    return base, relayout(base, t)


def relayout(base: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t's layout over `base` (differentiable: a gradient flows back to base)."""
    sizes = [1 if s == 0 else n for n, s in zip(t.shape, t.stride())]
    return base.as_strided(sizes, t.stride(), _offset(t)).expand(t.shape)


def _offset(t: torch.Tensor) -> int:
    off = t.storage_offset()
    return off % ALIGN + (ALIGN if off else 0)


def _first_of_broadcast(t: torch.Tensor) -> torch.Tensor:
    for d, s in enumerate(t.stride()):
        if s == 0:
            t = t.narrow(d, 0, 1)
    return t
