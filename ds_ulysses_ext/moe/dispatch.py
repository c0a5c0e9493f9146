"""Token dispatchers: send each token's top-k copies to the EP rank that holds the chosen expert, and back.

Legend: T tokens on this rank, D token width (hidden, or latent), k top-k, E experts, El = E / ep local experts,
N token-slots this rank's experts receive, R = ep ranks of the EP group.

    dispatch:  x [T, D], experts [T, k]  ->  x_recv [N, D] grouped by local expert (counts [El])
    combine:   y [N, D]                  ->  out [T, D] = sum_j weights[t, j] * y(t, j)   (fp32 accumulation)

Dropless: every slot is delivered (capacity would depend on the local chunk, i.e. on the layout). Weights are
applied in combine, in fp32, so that the sum over a token's k experts rounds the same whatever the layout
(DeepEP's normal-mode combine is an unweighted fp32 sum too, so the weights go before it there).

`AllToAllDispatcher` is the reference: torch's autograd `all_to_all_single` over the EP group with uneven
splits, exact on CPU (gloo) and GPU (NCCL). With one EP rank it only permutes locally. `DeepEPDispatcher`
(deepep.py) is the optional GPU backend with the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass
class Handle:
    """What combine needs to undo a dispatch."""
    num_tokens: int
    token_of_slot_N: torch.Tensor  # sorted slot -> its token (the slots of this rank's tokens, expert-major)
    weights_N: torch.Tensor  # fp32 routing weight of each sorted slot
    local_counts: list[int]  # received slots per local expert
    send_splits: Optional[list[int]] = None
    recv_splits: Optional[list[int]] = None
    to_expert_major_N: Optional[torch.Tensor] = None  # received order (source-rank-major) -> expert-major


class AllToAllDispatcher:
    name = "alltoall"

    def __init__(self, num_experts: int, ep_group=None):
        self.group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep} ranks")
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def dispatch(self, x_TD: torch.Tensor, experts_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        T, k = experts_Tk.shape
        flat = experts_Tk.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: a token's k slots keep their order inside an expert
        token_of_slot = order // k
        x_sorted = x_TD[token_of_slot]
        weights_N = weights_Tk.reshape(-1)[order].float()
        counts_E = torch.bincount(flat, minlength=self.num_experts)
        if self.ep == 1:
            return x_sorted, Handle(T, token_of_slot, weights_N, counts_E.tolist())
        counts_RE = counts_E.view(self.ep, self.num_local)
        recv_RE = torch.empty_like(counts_RE)
        dist.all_to_all_single(recv_RE, counts_RE, group=self.group)  # how many slots each source sends per expert
        send, recv = counts_RE.sum(1).tolist(), recv_RE.sum(1).tolist()  # one host sync: the splits must be known
        x_recv = _exchange(x_sorted, recv, send, self.group)
        perm = _source_major_to_expert_major(recv_RE, sum(recv))
        handle = Handle(T, token_of_slot, weights_N, recv_RE.sum(0).tolist(), send, recv, perm)
        return x_recv[perm], handle

    def combine(self, y_ND: torch.Tensor, handle: Handle) -> torch.Tensor:
        if handle.to_expert_major_N is not None:
            inverse = torch.empty_like(handle.to_expert_major_N)
            inverse[handle.to_expert_major_N] = torch.arange(inverse.numel(), device=inverse.device)
            y_source_major = y_ND[inverse]
            y_ND = _exchange(y_source_major, handle.send_splits, handle.recv_splits, self.group)
        weighted = y_ND.float() * handle.weights_N[:, None]
        out = weighted.new_zeros(handle.num_tokens, y_ND.shape[1]).index_add(0, handle.token_of_slot_N, weighted)
        return out.to(y_ND.dtype)


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
