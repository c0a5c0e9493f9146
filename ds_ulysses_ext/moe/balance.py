"""Load balancing that does not depend on the layout: the per-sequence aux loss and the expert-bias update.

Legend: B sequences in this micro-batch, s local sequence (a CP chunk), T = B*s tokens, E experts, k top-k.

Per-sequence balance loss (DeepSeek-V2/V3's sequence-wise loss), for one MoE layer and one sequence b with
n_b real tokens (padding excluded):

    f_be = E / (k n_b) * (tokens of b routed to e)      P_be = 1/n_b * sum_t p_te      L_b = sum_e f_be P_be

Under CP a sequence is split over the cp ranks of its group. The counts and n_b are summed over the CP group
(no gradient) before the product, and each rank keeps its own chunk's part of P_be, so the per-rank terms
sum_e f_be P_be^local add up, over the CP group, to the unsplit sequence's L_b, value and gradient alike. The
batch's loss is the mean of L_b over the sequences of the global batch (every dp rank and micro-batch), summed
over layers: a mean over sequences, never over chunks or ranks, so dp, cp and gradient accumulation cannot
change it. Megatron's `seq_aux_loss` reduces over its CP group in the same way; HF's Qwen3-MoE loss pools
over the whole batch and every layer and would not be per sequence.

Aux-loss-free balancing (`moe.balance=bias`, DeepSeek-V3): each router's fp32 `expert_bias` moves by
`rate * sign(mean - count_e)` once per optimizer step, with the counts summed over the whole global batch, so
every rank applies the same update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def sequence_balance_terms(experts_Tk: torch.Tensor, probs_TE: torch.Tensor, mask_Bs: torch.Tensor,
                           cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (this rank's share of sum_b L_b for its B sequences, differentiable; its routed counts per expert [E]).

    `mask_Bs` is 1 for real tokens, 0 for padding (float). Collective over `cp_group` when it has > 1 rank."""
    B, s = mask_Bs.shape
    E, k = probs_TE.shape[-1], experts_Tk.shape[-1]
    slot_mask = mask_Bs.reshape(B, s, 1).expand(B, s, k).reshape(B, s * k)
    with torch.no_grad():
        counts_BE = torch.zeros(B, E, dtype=torch.float32, device=probs_TE.device)
        counts_BE.scatter_add_(1, experts_Tk.reshape(B, s * k), slot_mask.float())
        local_counts_E = counts_BE.sum(0)
        stats = torch.cat([counts_BE, mask_Bs.float().sum(1, keepdim=True)], dim=1)
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(stats, group=cp_group)
        counts_BE, n_B = stats[:, :E], stats[:, E]
    probsum_BE = (probs_TE.reshape(B, s, E) * mask_Bs.reshape(B, s, 1).float()).sum(1)
    safe_n = n_B.clamp(min=1.0)
    f_BE = counts_BE * (E / k) / safe_n[:, None]
    terms_B = (f_BE * probsum_BE).sum(1) / safe_n
    return torch.where(n_B > 0, terms_B, torch.zeros_like(terms_B)).sum(), local_counts_E


def update_expert_bias(bias_E: torch.Tensor, global_counts_E: torch.Tensor, rate: float) -> None:
    """The aux-loss-free step: raise the bias of under-loaded experts, lower that of over-loaded ones."""
    with torch.no_grad():
        bias_E.add_(rate * torch.sign(global_counts_E.mean() - global_counts_E).to(bias_E.dtype))


def imbalance(global_counts_LE: torch.Tensor) -> float:
    """max / mean tokens per expert, the worst layer's (1.0 = perfectly balanced)."""
    mean = global_counts_LE.mean(dim=1).clamp(min=1e-12)
    return float((global_counts_LE.max(dim=1).values / mean).max())
