"""GroupedExperts: the local experts' SwiGLU FFNs, stored stacked in HF's Qwen3-MoE layout.

Legend: N dispatched token-slots on this rank (grouped by local expert), D expert width (hidden, or the
latent size in LatentMoE), I expert intermediate size, El local experts (E / ep).

    gate_up_proj [El, 2I, D]  (gate rows first, then up: HF's Qwen3MoeExperts)
    down_proj    [El, D, I]
    y_e = down_e( silu(gate_e x) * up_e x )

Stacked (one parameter per projection, not one module per expert) so that every local expert's weights are
used in every forward whatever the routing: ZeRO-3 gathers and reduces the same parameters in the same order on
every rank, which is what makes routing-dependent execution safe under it (an expert that receives no token
still gets a zero gradient, through an empty matmul).

Kernels: `torch._grouped_mm` on CUDA in bf16 (one launch for all experts); a loop of plain matmuls everywhere
else, which is the reference. Memory (`recompute`):
- "none": autograd keeps every intermediate;
- "act": the SwiGLU activation (silu(gate) * up) is recomputed in backward instead of kept;
- "experts": only the dispatched inputs are kept; each group of `group_size` experts runs its whole FFN again in
  backward, so at most one group's intermediates are alive at a time.
`offload_inputs` keeps what autograd saves here in pinned host memory (with "experts", exactly the dispatched
inputs) and brings it back for the backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "act", "experts")


def _swiglu(h_N2I: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2I.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedExperts(torch.nn.Module):
    def __init__(self, num_local_experts: int, dim: int, intermediate_size: int, recompute: str = "none",
                 group_size: int = 1, offload_inputs: bool = False):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"moe.recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
        self.num_local_experts, self.dim, self.intermediate_size = num_local_experts, dim, intermediate_size
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, dim))
        self.down_proj = torch.nn.Parameter(torch.empty(num_local_experts, dim, intermediate_size))
        self.recompute, self.group_size, self.offload_inputs = recompute, max(1, group_size), offload_inputs
        self.ffn_calls = 0  # expert-group FFN evaluations, forward and recompute alike (tests count recompute)

    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        with self._offload():
            if self.recompute == "experts":
                return self._grouped_recompute(x_ND, counts)
            return self._ffn(x_ND, counts, 0, self.num_local_experts)

    def _offload(self):
        if not self.offload_inputs:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())

    def _grouped_recompute(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for first in range(0, self.num_local_experts, self.group_size):
            last = min(first + self.group_size, self.num_local_experts)
            n = sum(counts[first:last])
            outs.append(checkpoint(self._ffn, x_ND[start:start + n], counts, first, last, use_reentrant=False))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _ffn(self, x_ND: torch.Tensor, counts: list[int], first: int, last: int) -> torch.Tensor:
        """Experts first..last-1 on their rows of x (grouped by expert, in order)."""
        self.ffn_calls += 1
        gate_up, down = self.gate_up_proj[first:last], self.down_proj[first:last]
        group_counts = counts[first:last]
        if _grouped_mm_ok(x_ND, gate_up):
            return self._grouped_mm(x_ND, gate_up, down, group_counts)
        outs = []
        for e, rows in enumerate(torch.split(x_ND, group_counts)):
            h = F.linear(rows, gate_up[e])
            a = checkpoint(_swiglu, h, use_reentrant=False) if self.recompute == "act" else _swiglu(h)
            outs.append(F.linear(a, down[e]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _grouped_mm(self, x_ND, gate_up, down, group_counts):
        offs = torch.tensor(group_counts, device=x_ND.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        h = torch._grouped_mm(x_ND, gate_up.transpose(-2, -1), offs=offs)
        a = checkpoint(_swiglu, h, use_reentrant=False) if self.recompute == "act" else _swiglu(h)
        return torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)


def _grouped_mm_ok(x_ND: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm: CUDA (SM90 for bf16), 16-byte aligned rows; the loop is the exact fallback elsewhere
    return (x_ND.is_cuda and x_ND.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and x_ND.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0
            and torch.cuda.get_device_capability(x_ND.device)[0] >= 9)
