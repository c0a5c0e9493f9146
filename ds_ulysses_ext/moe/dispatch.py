"""Token dispatchers: send each token's top-k copies to the EP rank that holds the chosen expert, and back.

Legend: T tokens on this rank, D token width (hidden, or latent), k top-k, E experts, El = E / ep local experts,
N token-slots this rank's experts receive, R = ep ranks of the EP group.

    dispatch:  x [T, D], experts [T, k]  ->  x_recv [N, D] grouped by local expert (counts [El])
    combine:   y [N, D]                  ->  out [T, D] = sum_j weights[t, j] * y(t, j)   (fp32 accumulation)

Dropless: every slot is delivered (capacity would depend on the local chunk, i.e. on the layout). Weights are
applied in combine, by one batched GEMM per token's k slots (fp32 accumulation, one rounding), so the sum rounds
the same whatever the layout. Every reordering is a gather with a gather as its backward: no scatter-add, whose
bf16 atomics are slow and nondeterministic on GPU. (DeepEP's normal-mode combine is an unweighted fp32 sum, so
there the weights go before it: deepep.py.)

`AllToAllDispatcher` is the reference: torch's autograd `all_to_all_single` over the EP group with uneven
splits, exact on CPU (gloo) and GPU (NCCL). With one EP rank it only permutes locally. On CUDA (`fused`) the
combine and the expansion's backward are kernels/slot_sum.py's per-token gathers, with the same sums in fp32. `DeepEPDispatcher`
(deepep.py) is the optional GPU backend with the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ..kernels.slot_sum import reference_slot_sum, slot_sum, slot_sum_backward, slot_sum_ok


@dataclass
class Handle:
    """What combine needs to undo a dispatch."""
    num_tokens: int
    token_of_slot_N: torch.Tensor  # sorted slot -> its token (the slots of this rank's tokens, expert-major)
    weights_N: Optional[torch.Tensor]  # routing weight of each sorted slot (DeepEP's combine uses these)
    local_counts: "list[int] | torch.Tensor"  # received slots per local expert (ep=1: a device tensor, never synced)
    weights_Tk: Optional[torch.Tensor] = None  # routing weights in token order (the all-to-all combine's)
    slot_order_N: Optional[torch.Tensor] = None  # sorted position -> flat slot t * k + j
    slot_inverse_N: Optional[torch.Tensor] = None  # flat slot -> sorted position
    send_splits: Optional[list[int]] = None
    recv_splits: Optional[list[int]] = None
    to_expert_major_N: Optional[torch.Tensor] = None  # received order (source-rank-major) -> expert-major
    to_source_major_N: Optional[torch.Tensor] = None  # its inverse


class AllToAllDispatcher:
    name = "alltoall"

    def __init__(self, num_experts: int, ep_group=None, fused: bool = True):
        self.group, self.fused = ep_group, fused
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep} ranks")
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def dispatch(self, x_TD: torch.Tensor, experts_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        T, k = experts_Tk.shape
        order, inverse, counts_E = sort_slots(experts_Tk, self.num_experts)
        x_sorted = _ExpandToSlots.apply(x_TD, order, inverse, k, self.fused)
        handle = Handle(T, order // k, None, [], weights_Tk=weights_Tk, slot_order_N=order, slot_inverse_N=inverse)
        if self.ep == 1:  # the counts stay on the device: the grouped experts read them there, no host sync
            handle.local_counts = counts_E
            return x_sorted, handle
        counts_RE = counts_E.view(self.ep, self.num_local)
        recv_RE = torch.empty_like(counts_RE)
        dist.all_to_all_single(recv_RE, counts_RE, group=self.group)  # how many slots each source sends per expert
        # the layer's one host sync: the all-to-all's splits must be known there; the experts' counts come with them
        host = torch.cat([counts_RE.sum(1), recv_RE.sum(1), recv_RE.sum(0)]).tolist()
        send, recv, local = host[:self.ep], host[self.ep:2 * self.ep], host[2 * self.ep:]
        x_recv = _exchange(x_sorted, recv, send, self.group)
        perm = _source_major_to_expert_major(recv_RE, sum(recv))
        handle.local_counts, handle.send_splits, handle.recv_splits = local, send, recv
        handle.to_expert_major_N, handle.to_source_major_N = perm, _inverse(perm)
        return _Permute.apply(x_recv, perm, handle.to_source_major_N), handle

    def combine(self, y_ND: torch.Tensor, handle: Handle) -> torch.Tensor:
        if handle.to_expert_major_N is not None:
            y_source_major = _Permute.apply(y_ND, handle.to_source_major_N, handle.to_expert_major_N)
            y_ND = _exchange(y_source_major, handle.send_splits, handle.recv_splits, self.group)
        T, k = handle.weights_Tk.shape
        w_Tk = handle.weights_Tk.to(y_ND.dtype)
        if self.fused and _slot_sum_ok(y_ND):
            return _WeightedSlotSum.apply(y_ND, handle.slot_inverse_N.view(T, k), w_Tk)
        y_TkD = _Permute.apply(y_ND, handle.slot_inverse_N, handle.slot_order_N).view(T, k, -1)
        # one batched [1, k] x [k, D] product per token: the weighted sum of its k experts, accumulated in fp32 by
        # the GEMM and rounded once (no scatter-add: no atomics, the same order on every layout)
        return torch.bmm(w_Tk.unsqueeze(1), y_TkD).squeeze(1)


def sort_slots(experts_Tk: torch.Tensor, num_experts: int):
    """-> (order [N]: sorted position -> flat slot, inverse [N], counts [E] on the device). Stable, so a token's k
    slots keep their order inside an expert; counts by a scatter-add, not bincount (which sizes its output from the
    largest id: a host read on CUDA)."""
    flat = experts_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = _inverse(order)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                       torch.ones_like(flat))
    return order, inverse, counts


class _Permute(torch.autograd.Function):
    """x[perm] for a permutation `perm` with inverse `inv`: the backward is a gather too, not a scatter-add."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, grad):
        inv, = ctx.saved_tensors
        return grad[inv], None, None


class _ExpandToSlots(torch.autograd.Function):
    """x [T, D] -> one row per (token, choice) slot [T*k, D], in sorted slot order. The backward sums each token's
    k slot gradients (a reduction in fp32 accumulation, deterministic) instead of scatter-adding them."""

    @staticmethod
    def forward(ctx, x_TD, order, inverse, k, fused=False):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.fused = k, fused
        return x_TD[order // k]

    @staticmethod
    def backward(ctx, grad_ND):
        inverse, = ctx.saved_tensors
        total = slot_sum if ctx.fused and _slot_sum_ok(grad_ND) else reference_slot_sum
        return total(grad_ND, inverse.view(-1, ctx.k)), None, None, None, None


class _WeightedSlotSum(torch.autograd.Function):
    """out [T, D] = sum_j w[t, j] * y[pos[t, j]] through kernels/slot_sum.py (the torch path's values)."""

    @staticmethod
    def forward(ctx, y_ND, pos_Tk, w_Tk):
        ctx.save_for_backward(y_ND, pos_Tk, w_Tk)
        return slot_sum(y_ND, pos_Tk, w_Tk)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, pos_Tk, w_Tk = ctx.saved_tensors
        grad_y, grad_w = slot_sum_backward(grad_TD, y_ND, pos_Tk, w_Tk)
        return grad_y, None, grad_w


def _slot_sum_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and slot_sum_ok(t.device, t.dtype)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _exchange(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with autograd (its backward is the reverse exchange); waits for the result here."""
    out = all_to_all_single_autograd(x_ND.contiguous(), out_splits, in_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def _source_major_to_expert_major(recv_RE: torch.Tensor, total: int) -> torch.Tensor:
    """Indices that reorder received slots from (source rank, local expert) blocks to (local expert, source rank).

    On the device, with no host sync: output position p of block j reads starts[j] + (p - out_starts[j])."""
    R, El = recv_RE.shape
    sizes = recv_RE.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # block (r, e) starts here in the received buffer
    by_expert = torch.arange(R * El, device=recv_RE.device).view(R, El).t().reshape(-1)
    sizes_o, starts_o = sizes[by_expert], starts[by_expert]
    out_starts = torch.cumsum(sizes_o, 0) - sizes_o
    shift = torch.repeat_interleave(starts_o - out_starts, sizes_o, output_size=total)
    return torch.arange(total, device=recv_RE.device) + shift
