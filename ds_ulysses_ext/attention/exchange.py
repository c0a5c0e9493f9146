"""Autograd all-to-alls that move a tensor between the sequence-sharded and the head-sharded layout.

Legend: B batch, s local sequence (S / cp), S global sequence, H heads before the exchange,
h = H / cp heads after it, D head dim, cp the group size.

    seq_to_head:  [B, s, H, D]  ->  [B, S, h, D]     rank j keeps heads [j*h, (j+1)*h) of every chunk
    head_to_seq:  [B, S, h, D]  ->  [B, s, H, D]     the exact inverse

Each is one `all_to_all_single` and its backward is the other one (an all-to-all is a permutation of
data, so its adjoint is the inverse permutation: gradients are exact, nothing is summed or scaled).
With a group of size 1, or no group, both are the identity and no collective is issued.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import group_size


def _seq_to_head(x_BsHD: torch.Tensor, group) -> torch.Tensor:
    cp = group_size(group)
    if cp == 1:
        return x_BsHD
    B, s, H, D = x_BsHD.shape
    # expects [B s H D]: put the destination rank (head group) first so each peer gets one contiguous block
    send = x_BsHD.reshape(B, s, cp, H // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # [cp B s h D]
    recv = torch.empty_like(send)  # [cp(source = seq chunk) B s h D]
    dist.all_to_all_single(recv, send, group=group)
    # returns [B S h D]: chunks arrive in rank order, which is sequence order
    return recv.permute(1, 0, 2, 3, 4).reshape(B, cp * s, H // cp, D)


def _head_to_seq(x_BShD: torch.Tensor, group) -> torch.Tensor:
    cp = group_size(group)
    if cp == 1:
        return x_BShD
    B, S, h, D = x_BShD.shape
    # expects [B S h D]: the destination rank is the owner of each sequence chunk
    send = x_BShD.reshape(B, cp, S // cp, h, D).transpose(0, 1).contiguous()  # [cp B s h D]
    recv = torch.empty_like(send)  # [cp(source = head group) B s h D]
    dist.all_to_all_single(recv, send, group=group)
    # returns [B s H D]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, S // cp, cp * h, D)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BsHD, group):
        ctx.group = group
        return _seq_to_head(x_BsHD, group)

    @staticmethod
    def backward(ctx, grad_BShD):
        return _head_to_seq(grad_BShD.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BShD, group):
        ctx.group = group
        return _head_to_seq(x_BShD, group)

    @staticmethod
    def backward(ctx, grad_BsHD):
        return _seq_to_head(grad_BsHD.contiguous(), ctx.group), None


def seq_to_head(x_BsHD: torch.Tensor, group) -> torch.Tensor:
    """[B, s, H, D] sequence-sharded -> [B, S, H/cp, D] head-sharded, with autograd."""
    if group_size(group) == 1:
        return x_BsHD
    if x_BsHD.shape[2] % group_size(group):
        raise ValueError(f"{x_BsHD.shape[2]} heads cannot be split over {group_size(group)} ranks")
    return _SeqToHead.apply(x_BsHD, group)


def head_to_seq(x_BShD: torch.Tensor, group) -> torch.Tensor:
    """[B, S, h, D] head-sharded -> [B, S/cp, h*cp, D] sequence-sharded, with autograd."""
    if group_size(group) == 1:
        return x_BShD
    return _HeadToSeq.apply(x_BShD, group)
