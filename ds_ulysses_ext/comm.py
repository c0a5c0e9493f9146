"""Autograd collectives shared outside attention: the group size and a sum with its exact adjoint.

The Ulysses all-to-alls that move attention between the sequence and the head layout live in
attention/exchange.py.

Shapes: all_reduce_sum takes and returns any shape (elementwise sum over the group); nothing is split.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward all-reduces the gradient too (the adjoint of a replicated sum).

    That adjoint is right when every rank's downstream loss is one additive share of the objective,
    which is how every CP loss here is built (the shares over ranks sum to the objective).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
