"""FP8 with delayed scales (fp8.recipe=delayed): a gated MLP, or linears reading one input (q/k/v; o_proj alone), as
one autograd Function whose casts are kernels/fp8_casts.py's and whose GEMMs are torch._scaled_mm, called as
torchao's tensorwise recipe calls them (fast accumulation in the forward only).

Legend: x [T, H] bf16 (the caller's [..., H] flattened); q(.) a cast with the slot's scale; a suffix 8 is float8,
`t` the transposed copy (kernels/fp8_casts.py). Linears that read one input are cast as one: their weights with one
scale into one operand ([W_0; W_1; ..] rows), their outputs' gradients with one scale into another ([dy_0 dy_1 ..]
columns), as a fused QKV or fc1 weight is cast (Megatron-Core's, Transformer Engine's).

MLP: W_gate, W_up [I, H], W_down [H, I]; W_gu = [W_gate; W_up] [2I, H]; g, u [T, I] the gate and up outputs (bf16);
y, dy [T, H].
    forward:   x8 = q(x); W_gu8 = q(W_gu); g = x8 W_gate8^T; u = x8 W_up8^T; h8 = q(silu(g) u); y = h8 W_down8^T
    backward:  dy8 = q(dy); dh = dy8 W_down8; d8 = q([dg du]) with [dg du] = SwiGLU'(dh, g, u) [T, 2I];
               h8t = q(h)^T; dx = d8 W_gu8; [dW_gate; dW_up] = d8t x8; dW_down = dy8t h8
    saved: x8t, g, u and the weights' float8 transposes; h is formed again from g and u in the backward's cast
    kernel, so nothing of the size of h is kept (less than the selective recompute keeps of a bf16 MLP).

Linears: W_i [O_i, H], y_i, dy_i [T, O_i], i < n <= 3; W = [W_0; ..] [O, H], dY = [dy_0 ..] [T, O], O = sum_i O_i.
    forward:   x8 = q(x); W8 = q(W); y_i = x8 W_i8^T (a GEMM each: y_i is a tensor of its own)
    backward:  dY8 = q(dY); dx = dY8 W8; [dW_0; ..] = dY8t x8
    saved: x8t and W8t.

Why joint. torch._scaled_mm cannot accumulate into its output, so with a scale per linear the input gradient was a
GEMM per linear and bf16 adds after them: one a layer for gate/up and two for q/k/v, 48 adds that took 6.3 ms of the
1B shape's FP8 step at 32k (H100, docs/benchmarks.md), where bf16's shared-input linears add in cuBLAS's epilogue
(kernels/projections.py). One scale for all makes dx one GEMM over the joined K, and each weight gradient pair or
triple one GEMM too; it also gave k's and v's small GEMMs (N = 512 on the 1B shape) to a large one. The forward keeps
a GEMM per linear: one output buffer would keep all of q/k/v alive while attention saves one of them (2.5 GiB more at
32k on the 1B shape, measured). The cost: a weight (or gradient) whose amax is far below its siblings' casts with
their scale, so its values keep their precision only down to about 2^-15 of the shared amax, where e4m3's
subnormals begin (e5m2's: 2^-30), as a fused QKV weight's do.

Why our own rather than torchao's: with dynamic scaling each cast needs an amax pass over its operand first, and
inductor runs each as a kernel of its own; here the amax is taken in the cast's pass and used from the next step on,
which saved 0.74 ms of one MLP's 16 ms on the Llama-3.1-8B layer shape at 16k tokens (H100, docs/benchmarks.md).
"""
from __future__ import annotations

import itertools

import torch

from ..errors import UnsupportedError
from .fp8_casts import D_GU, DTYPES, DY, H, LDY, LW, W_DOWN, W_GU, X, cast, kernels_ok, swiglu_bwd, swiglu_fwd
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
        x8, x8t = _cast(x, scales, amax, unseen, MLP_DTYPES, X, kernel)
        wgu8, wgu8t = _joint((w_gate, w_up), 0, scales, amax, unseen, MLP_DTYPES, W_GU, kernel)
        wd8, wd8t = _cast(w_down, scales, amax, unseen, MLP_DTYPES, W_DOWN, kernel)
        inv = _reciprocals(scales)
        i = w_gate.shape[0]
        g = _mm(x8, wgu8[:i].t(), inv[X], inv[W_GU], True)
        u = _mm(x8, wgu8[i:].t(), inv[X], inv[W_GU], True)
        h8 = _step(lambda s, a: swiglu_fwd(g, u, s, a, kernel), scales, amax, unseen, MLP_DTYPES, (H,))
        inv[H] = scales[H].reciprocal()  # made by the probe where h had no history
        ctx.save_for_backward(x8t, g, u, wgu8t, wd8t)
        # kept out of autograd's saved tensors: the backward raises amax, and scales may be filled (their version
        # counters would object)
        ctx.scales, ctx.amax, ctx.unseen, ctx.kernel = scales, amax, unseen, kernel
        return _mm(h8, wd8.t(), inv[H], inv[W_DOWN], True)

    @staticmethod
    def backward(ctx, dy):
        x8t, g, u, wgu8t, wd8t = ctx.saved_tensors
        scales, amax, unseen, kernel = ctx.scales, ctx.amax, ctx.unseen, ctx.kernel
        dy8, dy8t = _cast(dy.contiguous(), scales, amax, unseen, MLP_DTYPES, DY, kernel)
        inv = _reciprocals(scales)
        dh = _mm(dy8, wd8t.t(), inv[DY], inv[W_DOWN], False)
        ht, d8, d8t = _step(lambda s, a: swiglu_bwd(dh, g, u, s, a, kernel), scales, amax, unseen, MLP_DTYPES,
                            (D_GU,))
        inv[D_GU] = scales[D_GU].reciprocal()  # as h's above
        dwgu = _mm(d8t, x8t.t(), inv[D_GU], inv[X], False)
        i = g.shape[1]
        return (_mm(d8, wgu8t.t(), inv[D_GU], inv[W_GU], False), dwgu[:i], dwgu[i:],
                _mm(dy8t, ht.t(), inv[DY], inv[H], False), None, None, None, None)


class DelayedFp8Linears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scales, amax, unseen: tuple, kernel: bool, x, *weights):
        if any(unseen):
            scales = scales.clone()
        x8, x8t = _cast(x, scales, amax, unseen, LINEAR_DTYPES, X, kernel)
        w8, w8t = _joint(weights, 0, scales, amax, unseen, LINEAR_DTYPES, LW, kernel)
        inv = _reciprocals(scales)
        ctx.save_for_backward(x8t, w8t)
        ctx.scales, ctx.amax, ctx.unseen, ctx.kernel = scales, amax, unseen, kernel
        return tuple(_mm(x8, w8[a:b].t(), inv[X], inv[LW], True) for a, b in _spans(weights, 0))

    @staticmethod
    def backward(ctx, *dys):
        x8t, w8t = ctx.saved_tensors
        scales, amax, unseen, kernel = ctx.scales, ctx.amax, ctx.unseen, ctx.kernel
        dy8, dy8t = _joint([dy.contiguous() for dy in dys], 1, scales, amax, unseen, LINEAR_DTYPES, LDY, kernel)
        inv = _reciprocals(scales)
        dx = _mm(dy8, w8t.t(), inv[LDY], inv[LW], False)
        dw = _mm(dy8t, x8t.t(), inv[LDY], inv[X], False)
        return (None, None, None, None, dx, *(dw[a:b] for a, b in _spans(dys, 1)))


def _spans(parts, dim: int) -> list:
    """Each part's [start, end) along the joint dimension."""
    ends = list(itertools.accumulate(p.shape[dim] for p in parts))
    return list(zip([0, *ends[:-1]], ends))


def _joint(parts, dim: int, scales, amax, unseen, dtypes: tuple, slot: int, kernel):
    """The 2-d parts cast with slot `slot` into one operand, their concatenation along `dim`, and its transpose, both
    contiguous: each part's cast goes straight into its slice of each (the casts take the slices' row strides), so no
    bf16 concatenation is made."""
    whole = list(parts[0].shape)
    whole[dim] = sum(p.shape[dim] for p in parts)
    out = torch.empty(whole, dtype=dtypes[slot], device=parts[0].device)
    out_t = torch.empty(whole[::-1], dtype=dtypes[slot], device=parts[0].device)

    def op(s, a):
        for (lo, hi), p in zip(_spans(parts, dim), parts):
            into = (out[lo:hi], out_t[:, lo:hi]) if dim == 0 else (out[:, lo:hi], out_t[lo:hi])
            cast(p, s, a, slot, dtypes[slot], kernel, *into)
        return out, out_t
    return _step(op, scales, amax, unseen, dtypes, (slot,))


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
