"""A gated MLP, down(silu(gate(x)) * up(x)), in FP8 with delayed scales (fp8.recipe=delayed): one autograd Function
whose casts are kernels/fp8_casts.py's and whose seven GEMMs are torch._scaled_mm, as torchao's tensorwise recipe
calls them.

Legend: x [T, H] bf16 (the caller's [..., H] flattened); W_gate, W_up [I, H], W_down [H, I]; g, u [T, I] the gate
and up outputs (bf16); y, dy [T, H]; a suffix 8 is float8, `t` the transposed copy (kernels/fp8_casts.py).

    forward:   x8 = q(x); g = x8 W_gate8^T; u = x8 W_up8^T; h8 = q(silu(g) u); y = h8 W_down8^T
    backward:  dy8 = q(dy); dh = dy8 W_down8; dg8, du8 = q(SwiGLU'(dh, g, u)); h8t = q(h)^T
               dx = dg8 W_gate8 + du8 W_up8; dW_gate = dg8t x8; dW_up = du8t x8; dW_down = dy8t h8

Saved for backward: x8t, g, u and the weights' float8 transposes; h is formed again from g and u in the backward's
cast kernel, so nothing of the size of h is kept (less than the selective recompute keeps of a bf16 MLP).

Why our own rather than torchao's: with dynamic scaling each cast needs an amax pass over its operand first, and
inductor runs each as a kernel of its own; here the amax is taken in the cast's pass and used from the next step on,
which saved 0.74 ms of one MLP's 16 ms on the Llama-3.1-8B layer shape at 16k tokens (H100, docs/benchmarks.md).
Fast accumulation in the forward only, as torchao's tensorwise default has it.
"""
from __future__ import annotations

import torch

from .fp8_casts import D_GATE, D_UP, DTYPES, DY, H, W_DOWN, W_GATE, W_UP, X, cast, kernels_ok, swiglu_bwd, swiglu_fwd
from .fp8_scales import DelayedScales


def _reciprocals(scales: torch.Tensor) -> list:
    """Each scale's reciprocal as a tensor of its own: cuBLAS refuses (NOT_SUPPORTED) a scale pointer that is a view
    into a vector (8 bytes past an aligned start), which torch._scaled_mm passes on unchecked (measured on an H100)."""
    return [s.reciprocal() for s in scales.unbind()]


def _mm(a8, b8, inv_a, inv_b, fast: bool) -> torch.Tensor:
    """a8 [M, K] row-major @ b8 [K, N] column-major, dequantised by the reciprocal scales, bf16 out."""
    return torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast)


def _step(op, scales: torch.Tensor, amax: torch.Tensor, unseen: tuple, slots: tuple):
    """Run op(scales, amax). Where a slot has no history (`unseen`: step 1), first run op once into a probe for its
    amax, from which its scale is made (torchao's amax_to_scale), as tensorwise would; the real run then writes the
    outputs again."""
    own = [s for s in slots if unseen[s]]
    if own:
        from torchao.float8.float8_utils import amax_to_scale
        probe = torch.zeros_like(amax)
        op(scales, probe)
        for s in own:
            scales[s] = amax_to_scale(probe[s], DTYPES[s])
    return op(scales, amax)


class DelayedFp8Mlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, scales, amax, unseen: tuple, kernel: bool):
        if any(unseen):
            scales = scales.clone()  # filled op by op; the backward fills its own slots
        step = lambda op, *slots: _step(op, scales, amax, unseen, slots)  # noqa: E731
        x8, x8t = step(lambda s, a: cast(x, s, a, X, kernel), X)
        wg8, wg8t = step(lambda s, a: cast(w_gate, s, a, W_GATE, kernel), W_GATE)
        wu8, wu8t = step(lambda s, a: cast(w_up, s, a, W_UP, kernel), W_UP)
        wd8, wd8t = step(lambda s, a: cast(w_down, s, a, W_DOWN, kernel), W_DOWN)
        inv = _reciprocals(scales)
        g = _mm(x8, wg8.t(), inv[X], inv[W_GATE], True)
        u = _mm(x8, wu8.t(), inv[X], inv[W_UP], True)
        h8 = step(lambda s, a: swiglu_fwd(g, u, s, a, kernel), H)
        inv[H] = scales[H].reciprocal()  # made by the probe where h had no history
        ctx.save_for_backward(x8t, g, u, wg8t, wu8t, wd8t)
        # kept out of autograd's saved tensors: the backward raises amax, and scales may be filled (their version
        # counters would object)
        ctx.scales, ctx.amax, ctx.unseen, ctx.kernel = scales, amax, unseen, kernel
        return _mm(h8, wd8.t(), inv[H], inv[W_DOWN], True)

    @staticmethod
    def backward(ctx, dy):
        x8t, g, u, wg8t, wu8t, wd8t = ctx.saved_tensors
        scales, amax, unseen, kernel = ctx.scales, ctx.amax, ctx.unseen, ctx.kernel
        step = lambda op, *slots: _step(op, scales, amax, unseen, slots)  # noqa: E731
        dy = dy.contiguous()
        dy8, dy8t = step(lambda s, a: cast(dy, s, a, DY, kernel), DY)
        inv = _reciprocals(scales)
        dh = _mm(dy8, wd8t.t(), inv[DY], inv[W_DOWN], False)
        ht, dg, dgt, du, dut = step(lambda s, a: swiglu_bwd(dh, g, u, s, a, kernel), D_GATE, D_UP)
        inv[D_GATE], inv[D_UP] = scales[D_GATE].reciprocal(), scales[D_UP].reciprocal()  # as h's above
        dx = _mm(dg, wg8t.t(), inv[D_GATE], inv[W_GATE], False) + _mm(du, wu8t.t(), inv[D_UP], inv[W_UP], False)
        return (dx, _mm(dgt, x8t.t(), inv[D_GATE], inv[X], False), _mm(dut, x8t.t(), inv[D_UP], inv[X], False),
                _mm(dy8t, ht.t(), inv[DY], inv[H], False), None, None, None, None)


def bind_delayed_mlp(mlp: torch.nn.Module, state: DelayedScales, row: int) -> None:
    """mlp.forward becomes the Function on the MLP's own weights, with row `row` of the state. A training forward
    raises the state's amax; an eval forward raises a scratch one, so evaluation never moves the scales."""
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def forward(x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        amax = state.amax[row] if mlp.training else state.scratch
        kernel = flat.is_cuda and kernels_ok(flat.device)
        y = DelayedFp8Mlp.apply(flat, *weights, state.scales[row], amax, tuple(state.unseen[row].tolist()), kernel)
        return y.reshape(*shape[:-1], y.shape[-1])
    # memory/recompute.py's selective policy leaves this MLP as it is: it keeps no product of the size of h
    forward.keeps_no_product = True
    mlp.forward = forward
