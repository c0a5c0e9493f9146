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
`offload_inputs` (with "experts") keeps the dispatched inputs in pinned host memory until the backward.
"""
from __future__ import annotations

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
        if self.recompute == "experts":
            return _RecomputedExperts.apply(x_ND, self.gate_up_proj, self.down_proj, self, counts)
        return self._ffn(x_ND, counts, self.gate_up_proj, self.down_proj)

    def groups(self, counts: list[int]):
        """(first expert, last expert + 1, first row, rows) of each recompute group."""
        row = 0
        for first in range(0, self.num_local_experts, self.group_size):
            last = min(first + self.group_size, self.num_local_experts)
            n = sum(counts[first:last])
            yield first, last, row, n
            row += n

    def _ffn(self, x_ND: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The experts whose weights are given ([G, 2I, D], [G, D, I]) on their rows of x, grouped in order."""
        self.ffn_calls += 1
        if _grouped_mm_ok(x_ND, gate_up):
            offs = torch.tensor(counts, device=x_ND.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            h = torch._grouped_mm(x_ND, gate_up.transpose(-2, -1), offs=offs)
            a = checkpoint(_swiglu, h, use_reentrant=False) if self.recompute == "act" else _swiglu(h)
            return torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
        outs = []
        for e, rows in enumerate(torch.split(x_ND, counts)):
            h = F.linear(rows, gate_up[e])
            a = checkpoint(_swiglu, h, use_reentrant=False) if self.recompute == "act" else _swiglu(h)
            outs.append(F.linear(a, down[e]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class _RecomputedExperts(torch.autograd.Function):
    """moe.recompute=experts: keep only the dispatched rows (optionally in pinned host memory) and the weights.

    Backward reruns one group of experts at a time under autograd and writes that group's input and weight
    gradients straight into full-size buffers. (torch.utils.checkpoint per group would give each group's weight
    slice a gradient the size of the whole stacked weight, zero-filled and summed: E / group_size full-size passes.)
    """

    @staticmethod
    def forward(ctx, x_ND, gate_up, down, module: "GroupedExperts", counts: list[int]):
        with torch.no_grad():
            outs = [module._ffn(x_ND[r:r + n], counts[a:b], gate_up[a:b], down[a:b])
                    for a, b, r, n in module.groups(counts)]
        ctx.module, ctx.counts, ctx.device = module, counts, x_ND.device
        ctx.offloaded = module.offload_inputs
        if ctx.offloaded:  # the dispatched rows are all the experts keep: they wait for backward in host memory
            host = torch.empty(x_ND.shape, dtype=x_ND.dtype, device="cpu", pin_memory=x_ND.is_cuda)
            host.copy_(x_ND, non_blocking=True)
            ctx.save_for_backward(gate_up, down)
            ctx.host = host
        else:
            ctx.save_for_backward(gate_up, down, x_ND)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, grad_ND):
        if ctx.offloaded:
            gate_up, down = ctx.saved_tensors
            x_ND = ctx.host.to(ctx.device, non_blocking=True)
        else:
            gate_up, down, x_ND = ctx.saved_tensors
        module, counts = ctx.module, ctx.counts
        grad_x = torch.empty_like(x_ND)
        grad_gate_up, grad_down = torch.zeros_like(gate_up), torch.zeros_like(down)
        for a, b, r, n in module.groups(counts):
            with torch.enable_grad():
                x = x_ND[r:r + n].detach().requires_grad_()
                w1 = gate_up[a:b].detach().requires_grad_()
                w2 = down[a:b].detach().requires_grad_()
                y = module._ffn(x, counts[a:b], w1, w2)
                gx, g1, g2 = torch.autograd.grad(y, (x, w1, w2), grad_ND[r:r + n], allow_unused=True)
            grad_x[r:r + n] = gx if gx is not None else 0
            if g1 is not None:
                grad_gate_up[a:b] = g1
                grad_down[a:b] = g2
        return grad_x, grad_gate_up, grad_down, None, None


def _grouped_mm_ok(x_ND: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm: CUDA (SM90 for bf16), 16-byte aligned rows; the loop is the exact fallback elsewhere
    return (x_ND.is_cuda and x_ND.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and x_ND.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0
            and torch.cuda.get_device_capability(x_ND.device)[0] >= 9)
