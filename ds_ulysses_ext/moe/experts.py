"""GroupedExperts: the local experts' SwiGLU FFNs, stored stacked in HF's layout (Qwen3-MoE's or GPT-OSS's).

Legend: N dispatched token-slots on this rank (grouped by local expert), D expert width (hidden, or the
latent size in LatentMoE), I expert intermediate size, El local experts (E / ep).

layout="qwen3" (HF's Qwen3MoeExperts; weights act as x @ W^T), activation="swiglu", no biases:

    gate_up_proj [El, 2I, D]  (gate rows first, then up)
    down_proj    [El, D, I]
    y_e = down_e( silu(gate_e x) * up_e x )

layout="gpt_oss" (HF's GptOssExperts; weights act as x @ W), bias=True, activation="gpt_oss":

    gate_up_proj [El, D, 2I]   gate_up_proj_bias [El, 2I]   (gate and up INTERLEAVED: columns 0, 2, 4.. are gate)
    down_proj    [El, I, D]    down_proj_bias    [El, D]
    h = x @ gate_up_e + b_e;  gate = min(h[..., ::2], limit);  up = clamp(h[..., 1::2], -limit, limit)
    y_e = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_e + c_e       (alpha 1.702, limit 7.0 in GPT-OSS)

Both are stored as HF stores them, so a checkpoint loads as is and the export writes HF's layout back; the GPT-OSS
layout is already mat2 [E, K, N] for torch._grouped_mm (no transpose). The clamp's gradient is zero where it
clips, as in HF's own forward (the same torch op).

Stacked (one parameter per projection, not one module per expert) so that every local expert's weights are
used in every forward whatever the routing: ZeRO-3 gathers and reduces the same parameters in the same order on
every rank, which is what makes routing-dependent execution safe under it (an expert that receives no token
still gets a zero gradient, through an empty matmul).

Kernels: `torch._grouped_mm` on CUDA in bf16 (one launch for all experts); a loop of plain matmuls everywhere
else, which is the reference. The grouped path adds each row's expert bias from the rows' expert-major order and
sums the bias gradient per expert with a segment reduction in fp32 (no scatter-add: HF's bias[expert_ids] gather
would backprop through bf16 atomics). Memory (`recompute`):
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

from ..kernels.glu import FusedSwiGLU, glu_ok
from . import grouped
from .grouped import _swiglu
from .lean_pass import LeanExpertPass

RECOMPUTE_MODES = ("none", "act", "experts")
LAYOUTS = ("qwen3", "gpt_oss")
# the layouts whose torch._grouped_mm path has passed its GPU test (tests/test_moe_gpt_oss.py -k grouped, both
# layouts, on an H200 2026-12-01; Qwen3's is measured in docs/benchmarks.md section J); others run the exact loop
GROUPED_LAYOUTS = ("qwen3", "gpt_oss")
ACTIVATIONS = ("swiglu", "gpt_oss")


def _gpt_oss_glu(h_N2I: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """HF's GptOssExperts._apply_gate: interleaved gate/up, gate clamped above, up clamped both ways, (up + 1)."""
    gate, up = h_N2I[..., ::2], h_N2I[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(torch.nn.Module):
    def __init__(self, num_local_experts: int, dim: int, intermediate_size: int, recompute: str = "none",
                 group_size: int = 1, offload_inputs: bool = False, *, layout: str = "qwen3", bias: bool = False,
                 activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        for what, value, choices in (("moe.recompute", recompute, RECOMPUTE_MODES), ("expert layout", layout, LAYOUTS),
                                     ("expert activation", activation, ACTIVATIONS)):
            if value not in choices:
                raise ValueError(f"{what}={value!r} is not one of {choices}")
        self.num_local_experts, self.dim, self.intermediate_size = num_local_experts, dim, intermediate_size
        self.layout, self.bias, self.activation, self.alpha, self.limit = layout, bias, activation, alpha, limit
        I2 = 2 * intermediate_size
        gate_up, down = ((I2, dim), (dim, intermediate_size)) if layout == "qwen3" else ((dim, I2), (intermediate_size, dim))
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_local_experts, *gate_up))
        self.down_proj = torch.nn.Parameter(torch.empty(num_local_experts, *down))
        if bias:  # the names HF's GptOssExperts uses
            self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(num_local_experts, I2))
            self.down_proj_bias = torch.nn.Parameter(torch.empty(num_local_experts, dim))
        self.recompute, self.group_size, self.offload_inputs = recompute, max(1, group_size), offload_inputs
        # on CUDA, Qwen3's SwiGLU through kernels/glu.py (checked at first use); false: the torch path, the reference
        self.fused = True
        self.ffn_calls = 0  # expert-group FFN evaluations, forward and recompute alike (tests count recompute)

    @property
    def options(self) -> dict:
        """The keyword options that shape this module (MoEBlock.shard builds the local shard with them)."""
        return dict(layout=self.layout, bias=self.bias, activation=self.activation, alpha=self.alpha, limit=self.limit)

    def weights(self) -> tuple:
        """Every stacked parameter, in _ffn's order; each is [El, ...], so a slice [a:b] is experts a..b-1."""
        if self.bias:
            return self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias
        return self.gate_up_proj, self.down_proj

    def forward(self, x_ND: torch.Tensor, counts, route=None) -> torch.Tensor:
        """`counts`: rows per local expert, a host list or (ep=1) a device tensor, read on the host only where a
        path slices rows by expert (the loop, recompute groups).

        `route` = (weights [T, k], order [N], inverse [N]) (layer.py, where lean_pass.applies): x is then the tokens
        [T, D], and this runs the whole lean pass, dispatch to weighted combine, returning [T, D]. Through this
        module's forward so that ZeRO-3 gathers these weights around it as around any expert forward."""
        if route is not None:
            self.ffn_calls += 1
            weights_Tk, order_N, inverse_N = route
            return LeanExpertPass.apply(x_ND, weights_Tk, self.gate_up_proj, self.down_proj, order_N, inverse_N,
                                        counts, x_ND.is_cuda, self.recompute == "experts")
        if self.recompute == "experts":
            return _RecomputedExperts.apply(x_ND, self, host_counts(counts), *self.weights())
        return self._ffn(x_ND, counts, *self.weights())

    def _act(self, h_N2I: torch.Tensor) -> torch.Tensor:
        if self.activation == "gpt_oss":
            return _gpt_oss_glu(h_N2I, self.alpha, self.limit)
        if self.fused and h_N2I.is_cuda and glu_ok(h_N2I.device, h_N2I.dtype):
            return FusedSwiGLU.apply(h_N2I)
        return _swiglu(h_N2I)

    def groups(self, counts: list[int]):
        """(first expert, last expert + 1, first row, rows) of each recompute group."""
        row = 0
        for first in range(0, self.num_local_experts, self.group_size):
            last = min(first + self.group_size, self.num_local_experts)
            n = sum(counts[first:last])
            yield first, last, row, n
            row += n

    def _ffn(self, x_ND: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
             gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """The experts whose weights are given (G experts, in this module's layout) on their rows of x, grouped in
        order."""
        self.ffn_calls += 1
        act = (lambda h: checkpoint(self._act, h, use_reentrant=False)) if self.recompute == "act" else self._act
        qwen3 = self.layout == "qwen3"
        if self.layout in GROUPED_LAYOUTS and grouped._grouped_mm_ok(x_ND, gate_up, down):
            counts_G = counts if torch.is_tensor(counts) else torch.tensor(counts, device=x_ND.device, dtype=torch.int64)
            offs = counts_G.cumsum(0, dtype=torch.int32)
            # mat2 [G, K, N]: Qwen3's [G, N, K] weights transposed (a view); GPT-OSS's are stored that way
            h = torch._grouped_mm(x_ND, gate_up.transpose(-2, -1) if qwen3 else gate_up, offs=offs)
            if gate_up_bias is not None:
                h = _SegmentBias.apply(h, gate_up_bias, counts_G)
            y = torch._grouped_mm(act(h), down.transpose(-2, -1) if qwen3 else down, offs=offs)
            return y if down_bias is None else _SegmentBias.apply(y, down_bias, counts_G)
        outs = []
        for e, rows in enumerate(torch.split(x_ND, host_counts(counts))):
            if qwen3:
                h = F.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
                y = F.linear(act(h), down[e], None if down_bias is None else down_bias[e])
            else:  # x @ W + b, as HF's GptOssExperts writes it
                h = rows @ gate_up[e]
                h = h if gate_up_bias is None else h + gate_up_bias[e]
                y = act(h) @ down[e]
                y = y if down_bias is None else y + down_bias[e]
            outs.append(y)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class _SegmentBias(torch.autograd.Function):
    """h [N, F] + the bias [G, F] of each row's expert, the rows grouped by expert (counts [G] on the device).

    The backward sums each expert's rows with one segment reduction in fp32: deterministic, no scatter-add."""

    @staticmethod
    def forward(ctx, h_NF, bias_GF, counts_G):
        ctx.save_for_backward(counts_G)
        return h_NF + bias_GF.repeat_interleave(counts_G, dim=0, output_size=h_NF.shape[0])

    @staticmethod
    def backward(ctx, grad_NF):
        counts_G, = ctx.saved_tensors
        grad_bias = torch.segment_reduce(grad_NF.float(), "sum", lengths=counts_G, axis=0, unsafe=True)
        return grad_NF, grad_bias.to(grad_NF.dtype), None


class _RecomputedExperts(torch.autograd.Function):
    """moe.recompute=experts: keep only the dispatched rows (optionally in pinned host memory) and the weights.

    Backward reruns one group of experts at a time under autograd and writes that group's input and weight
    gradients straight into full-size buffers. (torch.utils.checkpoint per group would give each group's weight
    slice a gradient the size of the whole stacked weight, zero-filled and summed: E / group_size full-size passes.)
    """

    @staticmethod
    def forward(ctx, x_ND, module: "GroupedExperts", counts: list[int], *weights):
        # weights: module.weights(), every one stacked over the local experts (biases too), sliced per group
        with torch.no_grad():
            outs = [module._ffn(x_ND[r:r + n], counts[a:b], *(w[a:b] for w in weights))
                    for a, b, r, n in module.groups(counts)]
        ctx.module, ctx.counts, ctx.device, ctx.num_weights = module, counts, x_ND.device, len(weights)
        ctx.offloaded = module.offload_inputs
        if ctx.offloaded:  # the dispatched rows are all the experts keep: they wait for backward in host memory
            host = torch.empty(x_ND.shape, dtype=x_ND.dtype, device="cpu", pin_memory=x_ND.is_cuda)
            host.copy_(x_ND, non_blocking=True)
            ctx.save_for_backward(*weights)
            ctx.host = host
        else:
            ctx.save_for_backward(*weights, x_ND)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, grad_ND):
        saved = ctx.saved_tensors
        weights = saved[:ctx.num_weights]
        x_ND = ctx.host.to(ctx.device, non_blocking=True) if ctx.offloaded else saved[ctx.num_weights]
        module, counts = ctx.module, ctx.counts
        grad_x = torch.empty_like(x_ND)
        grad_weights = [torch.zeros_like(w) for w in weights]
        for a, b, r, n in module.groups(counts):
            with torch.enable_grad():
                x = x_ND[r:r + n].detach().requires_grad_()
                ws = [w[a:b].detach().requires_grad_() for w in weights]
                y = module._ffn(x, counts[a:b], *ws)
                gx, *gws = torch.autograd.grad(y, (x, *ws), grad_ND[r:r + n], allow_unused=True)
            grad_x[r:r + n] = gx if gx is not None else 0
            for full, g in zip(grad_weights, gws):
                if g is not None:
                    full[a:b] = g
        return (grad_x, None, None, *grad_weights)


def host_counts(counts) -> list:
    return counts.tolist() if torch.is_tensor(counts) else counts
