"""The MoE combine as one gather-and-sum per token: out[t] = sum_j w[t, j] * y[pos[t, j]], and its backward.

Legend: T tokens, k slots per token (top-k), N = T * k expert slots (rows of y, grouped by expert), D width.

    forward:   y [N, D], pos [T, k] (the row of token t's j-th slot), w [T, k] or None  ->  out [T, D]
    backward:  grad_out [T, D]  ->  grad_y [N, D] = w[t, j] * grad_out[t] at row pos[t, j],
                                     grad_w [T, k] = <grad_out[t], y[pos[t, j]]>

Every sum is in fp32 and rounded once to y's dtype, with w taken in y's dtype: the values of the torch path
(moe/dispatch.py: y[pos] then one batched [1, k] x [k, D] GEMM per token), which CPU runs and which is the
reference. w = None is the plain sum of a token's k slot rows, the backward of dispatch's expansion to slots.

Why our own: the torch path writes the permuted [T, k, D] copy of y (512 MiB per layer at 16k tokens of the
Qwen3-30B-A3B shape), reads it back in a batched GEMM of 16,384 tiny [1, 8] x [8, 2048] products, and does the same
twice more in backward: 2.2 ms of the block's 11.7 ms on an H200 (docs/benchmarks.md). Here each token's program
reads its k rows once. pos is a permutation, so every row of grad_y is written exactly once: no atomics.
"""
from __future__ import annotations

import functools

import torch

from .first_use import agrees

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative, norm-wise; 16 bits: ~1 ulp


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def slot_sum_fwd(y_ptr, pos_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(K):
            row = tl.load(pos_ptr + t * K + j).to(tl.int64)
            y = tl.load(y_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += y
        tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def slot_sum_bwd(g_ptr, y_ptr, pos_ptr, w_ptr, gy_ptr, gw_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        g = tl.load(g_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        for j in range(K):
            row = tl.load(pos_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            y = tl.load(y_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(gw_ptr + t * K + j, tl.sum(g * y, 0).to(gw_ptr.dtype.element_ty))
            tl.store(gy_ptr + row * D + offs, (w * g).to(gy_ptr.dtype.element_ty), mask=mask)

    return slot_sum_fwd, slot_sum_bwd


def _launch_shape(D: int) -> tuple[int, int]:
    block = 1 << max(D - 1, 1).bit_length()
    return block, max(1, min(16, block // 256))  # 8 fp32 per thread at most


def slot_sum(y_ND: torch.Tensor, pos_Tk: torch.Tensor, w_Tk: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's forward (no autograd): out [T, D] in y's dtype."""
    T, k = pos_Tk.shape
    D = y_ND.shape[1]
    out = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    if T:
        block, warps = _launch_shape(D)
        w = w_Tk.contiguous() if w_Tk is not None else pos_Tk
        _kernels()[0][(T,)](y_ND.contiguous(), pos_Tk.contiguous(), w, out, D, K=k, HAS_W=w_Tk is not None,
                            BLOCK=block, num_warps=warps)
    return out


def slot_sum_backward(grad_TD: torch.Tensor, y_ND: torch.Tensor, pos_Tk: torch.Tensor, w_Tk: torch.Tensor):
    """-> (grad_y [N, D], grad_w [T, k]), both in y's dtype."""
    T, k = pos_Tk.shape
    N, D = y_ND.shape
    grad_y = torch.empty(N, D, dtype=y_ND.dtype, device=y_ND.device)
    grad_w = torch.empty(T, k, dtype=y_ND.dtype, device=y_ND.device)
    if T:
        block, warps = _launch_shape(D)
        _kernels()[1][(T,)](grad_TD.contiguous(), y_ND.contiguous(), pos_Tk.contiguous(), w_Tk.contiguous(), grad_y,
                            grad_w, D, K=k, BLOCK=block, num_warps=warps)
    return grad_y, grad_w


def reference_slot_sum(y_ND: torch.Tensor, pos_Tk: torch.Tensor, w_Tk: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path (what CPU runs): the [T, k, D] gather, then a batched GEMM (or a sum without weights)."""
    T, k = pos_Tk.shape
    y_TkD = y_ND[pos_Tk.reshape(-1)].view(T, k, -1)
    if w_Tk is None:
        return y_TkD.sum(1)
    return torch.bmm(w_Tk.to(y_ND.dtype).unsqueeze(1), y_TkD).squeeze(1)


@functools.lru_cache(maxsize=None)
def slot_sum_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Checked once per (device, dtype): forward with and without weights and the backward against the torch path's
    values (its backward written out: no autograd) on a width that is no power of two. A failure or a disagreement logs a warning and the caller keeps
    the torch path (slower, never wrong)."""
    if device.type != "cuda":
        return False
    def pairs():
        # no autograd here: the first call may come inside a checkpointed layer's forward, whose recomputation
        # must save exactly the tensors the forward saved
        with torch.no_grad():
            gen = torch.Generator(device=device).manual_seed(0)
            T, k, D = 37, 3, 200
            y = torch.randn(T * k, D, device=device, generator=gen).to(dtype)
            pos = torch.randperm(T * k, device=device, generator=gen).view(T, k)
            w = torch.rand(T, k, device=device, generator=gen).to(dtype)
            g = torch.randn(T, D, device=device, generator=gen).to(dtype)
            ref_gy = torch.empty_like(y)  # the torch path's backward: each slot row gets w * its token's gradient
            ref_gy[pos.reshape(-1)] = (w[..., None] * g[:, None, :]).reshape(-1, D)
            ref_gw = torch.bmm(g.unsqueeze(1), y[pos.reshape(-1)].view(T, k, D).transpose(1, 2)).squeeze(1)
            got_gy, got_gw = slot_sum_backward(g, y, pos, w)
            tol = TOLERANCE[dtype]
            return (("forward", slot_sum(y, pos, w), reference_slot_sum(y, pos, w), tol),
                    ("sum", slot_sum(y, pos), reference_slot_sum(y, pos), tol),
                    ("grad_y", got_gy, ref_gy, tol), ("grad_w", got_gw, ref_gw, tol))
    return agrees("MoE combine: the Triton slot-sum kernels", device, dtype, pairs)
