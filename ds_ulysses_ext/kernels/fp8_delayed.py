"""FP8 with delayed scales (fp8.recipe=delayed): a gated MLP, or linears reading one input (q/k/v; o_proj alone), as
one autograd Function whose casts are kernels/fp8_casts.py's and whose GEMMs are torch._scaled_mm, called as
torchao's tensorwise recipe calls them (fast accumulation in the forward only).

Legend: x [T, H] bf16 (the caller's [..., H] flattened); q(.) a cast with the slot's scale; a suffix 8 is float8,
`t` the transposed copy (kernels/fp8_casts.py).

MLP: W_gate, W_up [I, H], W_down [H, I]; g, u [T, I] the gate and up outputs (bf16); y, dy [T, H].
    forward:   x8 = q(x); g = x8 W_gate8^T; u = x8 W_up8^T; h8 = q(silu(g) u); y = h8 W_down8^T
    backward:  dy8 = q(dy); dh = dy8 W_down8; dg8, du8 = q(SwiGLU'(dh, g, u)); h8t = q(h)^T
               dx = dg8 W_gate8 + du8 W_up8; dW_gate = dg8t x8; dW_up = du8t x8; dW_down = dy8t h8
    saved: x8t, g, u and the weights' float8 transposes; h is formed again from g and u in the backward's cast
    kernel, so nothing of the size of h is kept (less than the selective recompute keeps of a bf16 MLP).

Linears: W_i [O_i, H], y_i, dy_i [T, O_i], i < n <= 3; W [O, H] = [W_0; ...; W_n-1], dY [T, O] = [dy_0 ... dy_n-1],
O = sum_i O_i: the weights cast with one scale into one buffer, the output gradients with one scale into another, as
a fused QKV weight is cast (Megatron-Core's, Transformer Engine's), so each product is one GEMM.
    forward:   x8 = q(x); W8 = q(W); y = x8 W8^T [T, O]; y_i = y[:, O_i's columns] (views)
    backward:  dY8 = q(dY); dx = dY8 W8; dW = dY8t x8; dW_i = dW[O_i's rows] (views)
    saved: x8t and W8t.
Why one GEMM: torch._scaled_mm cannot accumulate into its output, so a GEMM per linear left dx's sum to separate bf16
adds: two a layer for q/k/v, 32 of the 48 adds that cost 6.3 ms of the 1B shape's FP8 step at 32k (H100,
docs/benchmarks.md); and k's and v's own GEMMs, N = 512 there, ran far from the GEMM's peak. The cost: a weight whose
amax is far below its siblings' keeps fewer of e4m3's normal values (a factor of 2^17 below the shared amax is where
they end), which Transformer Engine's fused QKV accepts as well.

Why our own rather than torchao's: with dynamic scaling each cast needs an amax pass over its operand first, and
inductor runs each as a kernel of its own; here the amax is taken in the cast's pass and used from the next step on,
which saved 0.74 ms of one MLP's 16 ms on the Llama-3.1-8B layer shape at 16k tokens (H100, docs/benchmarks.md).
"""
from __future__ import annotations

import itertools

import torch

from ..errors import UnsupportedError
from .fp8_casts import (D_GATE, D_UP, DTYPES, DY, H, LDY, LW, W_DOWN, W_GATE, W_UP, X, cast, kernels_ok, swiglu_bwd,
                        swiglu_fwd)
from .fp8_scales import DelayedScales

MLP_DTYPES = DTYPES["mlp"]
LINEAR_DTYPES = DTYPES["linears"]


def _reciprocals(scales: torch.Tensor) -> list:
    """Each scale's reciprocal as a tensor of its own: cuBLAS refuses (NOT_SUPPORTED) a scale pointer that is a view
    into a vector (8 bytes past an aligned start), which torch._scaled_mm passes on unchecked (measured on an H100)."""
    return [s.reciprocal() for s in scales.unbind()]


def _mm(a8, b8, inv_a, inv_b, fast: bool) -> torch.Tensor:
    """a8 [M, K] row-major @ b8 [K, N] column-major, dequantised by the reciprocal scales, bf16 out."""
    return torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast)


def _step(op, scales: torch.Tensor, amax: torch.Tensor, unseen: tuple, dtypes: tuple, slots: tuple):
    """Run op(scales, amax). Where a slot has no history (`unseen`: step 1), first run op once into a probe for its
    amax, from which its scale is made (torchao's amax_to_scale), as tensorwise would; the real run then writes the
    outputs again."""
    own = [s for s in slots if unseen[s]]
    if own:
        from torchao.float8.float8_utils import amax_to_scale
        probe = torch.zeros_like(amax)
        op(scales, probe)
        for s in own:
            scales[s] = amax_to_scale(probe[s], dtypes[s])
    return op(scales, amax)


def _cast(t, scales, amax, unseen, dtypes, slot, kernel):
    return _step(lambda s, a: cast(t, s, a, slot, dtypes[slot], kernel), scales, amax, unseen, dtypes, (slot,))


class DelayedFp8Mlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, scales, amax, unseen: tuple, kernel: bool):
        if any(unseen):
            scales = scales.clone()  # filled op by op; the backward fills its own slots
        c = lambda t, slot: _cast(t, scales, amax, unseen, MLP_DTYPES, slot, kernel)  # noqa: E731
        x8, x8t = c(x, X)
        (wg8, wg8t), (wu8, wu8t), (wd8, wd8t) = c(w_gate, W_GATE), c(w_up, W_UP), c(w_down, W_DOWN)
        inv = _reciprocals(scales)
        g = _mm(x8, wg8.t(), inv[X], inv[W_GATE], True)
        u = _mm(x8, wu8.t(), inv[X], inv[W_UP], True)
        h8 = _step(lambda s, a: swiglu_fwd(g, u, s, a, kernel), scales, amax, unseen, MLP_DTYPES, (H,))
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
        dy8, dy8t = _cast(dy.contiguous(), scales, amax, unseen, MLP_DTYPES, DY, kernel)
        inv = _reciprocals(scales)
        dh = _mm(dy8, wd8t.t(), inv[DY], inv[W_DOWN], False)
        ht, dg, dgt, du, dut = _step(lambda s, a: swiglu_bwd(dh, g, u, s, a, kernel), scales, amax, unseen,
                                     MLP_DTYPES, (D_GATE, D_UP))
        inv[D_GATE], inv[D_UP] = scales[D_GATE].reciprocal(), scales[D_UP].reciprocal()  # as h's above
        dx = _mm(dg, wg8t.t(), inv[D_GATE], inv[W_GATE], False) + _mm(du, wu8t.t(), inv[D_UP], inv[W_UP], False)
        return (dx, _mm(dgt, x8t.t(), inv[D_GATE], inv[X], False), _mm(dut, x8t.t(), inv[D_UP], inv[X], False),
                _mm(dy8t, ht.t(), inv[DY], inv[H], False), None, None, None, None)


class DelayedFp8Linears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scales, amax, unseen: tuple, kernel: bool, x, *weights):
        if any(unseen):
            scales = scales.clone()
        x8, x8t = _cast(x, scales, amax, unseen, LINEAR_DTYPES, X, kernel)
        w8, w8t = _joint(weights, 0, scales, amax, unseen, LW, kernel)
        inv = _reciprocals(scales)
        ctx.save_for_backward(x8t, w8t)
        ctx.scales, ctx.amax, ctx.unseen, ctx.kernel = scales, amax, unseen, kernel
        y = _mm(x8, w8.t(), inv[X], inv[LW], True)
        return tuple(y[:, a:b] for a, b in _spans(weights, 0))

    @staticmethod
    def backward(ctx, *dys):
        x8t, w8t = ctx.saved_tensors
        scales, amax, unseen, kernel = ctx.scales, ctx.amax, ctx.unseen, ctx.kernel
        dy8, dy8t = _joint([dy.contiguous() for dy in dys], 1, scales, amax, unseen, LDY, kernel)
        inv = _reciprocals(scales)
        dx = _mm(dy8, w8t.t(), inv[LDY], inv[LW], False)
        dw = _mm(dy8t, x8t.t(), inv[LDY], inv[X], False)
        return (None, None, None, None, dx, *(dw[a:b] for a, b in _spans(dys, 1)))


def _spans(parts, dim: int) -> list:
    """Each part's [start, end) along the joint dimension."""
    ends = list(itertools.accumulate(p.shape[dim] for p in parts))
    return list(zip([0, *ends[:-1]], ends))


def _joint(parts, dim: int, scales, amax, unseen, slot: int, kernel):
    """The 2-d parts cast with slot `slot` into one operand, their concatenation along `dim`, and its transpose, both
    contiguous: each part's cast goes straight into its slice of each (the casts take the slices' row strides), so no
    bf16 concatenation is made."""
    whole = list(parts[0].shape)
    whole[dim] = sum(p.shape[dim] for p in parts)
    dtype = LINEAR_DTYPES[slot]
    out = torch.empty(whole, dtype=dtype, device=parts[0].device)
    out_t = torch.empty(whole[::-1], dtype=dtype, device=parts[0].device)

    def op(s, a):
        for (lo, hi), p in zip(_spans(parts, dim), parts):
            into = (out[lo:hi], out_t[:, lo:hi]) if dim == 0 else (out[:, lo:hi], out_t[lo:hi])
            cast(p, s, a, slot, dtype, kernel, *into)
        return out, out_t
    return _step(op, scales, amax, unseen, LINEAR_DTYPES, (slot,))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _amax(module: torch.nn.Module, state: DelayedScales, row: int) -> torch.Tensor:
    """A training forward raises the step's amax; an eval forward a scratch one, so evaluation never moves a scale."""
    return state.amax[row] if module.training else state.scratch


def _unseen(state: DelayedScales, row: int) -> tuple:
    return tuple(state.unseen[row].tolist())


def bind_delayed_mlp(mlp: torch.nn.Module, state: DelayedScales, row: int, launch=None) -> None:
    """mlp.forward becomes the MLP Function on the MLP's own weights, with row `row` of the state. `launch`: how the
    kernels run (kernels/fp8_casts.py Launch; scripts/bench/bench_fp8_mlp.py compares the ways); None: as the
    first-use check chose."""
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def forward(x):
        flat = _flat(x)
        kernel = launch if launch is not None else flat.is_cuda and kernels_ok(flat.device)
        y = DelayedFp8Mlp.apply(flat, *weights, state.scales[row], _amax(mlp, state, row), _unseen(state, row),
                                kernel)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    # memory/recompute.py's selective policy leaves this MLP as it is: it keeps no product of the size of h
    forward.keeps_no_product = True
    mlp.forward = forward


def delayed_linears(owner: torch.nn.Module, linears: list, state: DelayedScales, row: int):
    """node(x) -> each linear's output, by the linears Function on their weights with row `row` of the state; each
    linear's own forward refuses to run apart from it (it would run bf16). `owner`'s training flag picks the amax."""
    weights = [m.weight for m in linears]
    for m in linears:
        m.forward = _apart(m)

    def node(x):
        flat = _flat(x)
        ys = DelayedFp8Linears.apply(state.scales[row], _amax(owner, state, row), _unseen(state, row),
                                     flat.is_cuda and kernels_ok(flat.device), flat, *weights)
        return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)
    return node


def _apart(linear: torch.nn.Module):
    def forward(x):
        raise UnsupportedError(f"fp8.recipe=delayed: a {tuple(linear.weight.shape)} projection was called apart from "
                               "its group (autocast, or its siblings on another input), which would run it in bf16: "
                               "set fp8.recipe=tensorwise")
    return forward
