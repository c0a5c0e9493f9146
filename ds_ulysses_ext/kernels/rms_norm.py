"""RMSNorm with Liger-Kernel's forward kernel and a backward kernel of our own (CUDA; the Liger provider's norm).

Legend: T rows (tokens), H the normalised width.

    forward (Liger's rms_norm_forward):  x [T, H], w [H]  ->  y [T, H]; keeps x and rstd [T] (fp32)
    backward (here):                     dy [T, H], x, w, rstd  ->  dx [T, H], dw [H]

    m  = dy * w                                      (fp32)
    dx = rstd * (m - x * rstd^2 * <m, x> / H)        (fp32 inside, one rounding at the store)
    dw = sum over rows of dy * x_hat, where x_hat = x * rstd, rounded to x's dtype first in the Llama order
         (it is what that order's forward multiplies), in fp32 in GPT-OSS's; per-program partial sums, then one sum

Liger's backward's formulas, fp32 inside (HF's eager Llama order rounds m to the dtype; in fp32 all agree). Why our
own: at T >> the GPU's SM count Liger's backward runs one program per SM, each walking its rows one after another
(latency, not bandwidth, bounds it), after zero-filling dx: on an H200 its 33 norms of the Llama-3.2-1B shape took
4.7 ms of GPU at 16k tokens, 143 us each where the bytes they move take ~55 us (docs/benchmarks.md BA). Here every
program takes a tile of rows, so the loads of many rows are in flight at once.
"""
from __future__ import annotations

import functools

import torch

TILE = 8192      # elements of one tile of rows (4 rows at H 2048): 32 fp32 registers a thread per tensor at 8 warps
PROGRAMS = 1024  # at most: the weight gradient's partial sums are [PROGRAMS, H] fp32 (8 MiB at H 2048) at any T


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_bwd(dy_ptr, x_ptr, x_row_stride, w_ptr, rstd_ptr, dx_ptr, dw_ptr, T, H, tiles, LLAMA: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        # this program's rows: `tiles` tiles of ROWS rows, one contiguous stretch
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for tile in range(tiles):
            rows = (pid.to(tl.int64) * tiles + tile) * ROWS + tl.arange(0, ROWS)
            rmask = rows < T
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None] * H + cols[None, :]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
            dy32 = dy.to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            m = dy32 * w[None, :]
            dot = tl.sum(m * x, axis=1)
            dx = rstd[:, None] * m - (rstd * rstd * rstd * dot / H)[:, None] * x
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            x_hat = x * rstd[:, None]
            if LLAMA:  # the product of two 16-bit values is exact in fp32: rounded once, as a 16-bit multiply rounds
                prod = dy32 * x_hat.to(dy.dtype).to(tl.float32)
                dw += tl.sum(prod.to(dy.dtype).to(tl.float32), axis=0)
            else:
                dw += tl.sum(dy32 * x_hat, axis=0)
        tl.store(dw_ptr + pid.to(tl.int64) * H + cols, dw, mask=cmask)

    return triton, rms_bwd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, llama_order: bool):
    """dx [T, H] in x's dtype (contiguous), dw [H] in w's dtype, from dy, x [T, H], w [H] and Liger's rstd [T].

    x may have any row stride: Liger's forward keeps the caller's rows as they lie (HF's MLA hands kv_a_layernorm a
    slice of torch.split along the width, whose rows are further apart than H). Read as if contiguous, that slice
    gave wrong dx and dw with a right forward, silently; the kernel now takes the row stride."""
    triton, kernel = _kernel()
    T, H = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    dy, w, rstd = dy.contiguous(), w.contiguous(), rstd.contiguous()
    dx = torch.empty((T, H), dtype=x.dtype, device=x.device)
    block_h = triton.next_power_of_2(H)
    rows = max(1, min(64, TILE // block_h))
    tiles = triton.cdiv(triton.cdiv(T, rows), PROGRAMS)
    programs = triton.cdiv(T, rows * tiles)
    partial = torch.empty(programs, H, dtype=torch.float32, device=x.device)
    kernel[(programs,)](dy, x, x.stride(0), w, rstd, dx, partial, T, H, tiles, LLAMA=llama_order, ROWS=rows, BLOCK_H=block_h,
                        num_warps=8)
    return dx, partial.sum(0).to(w.dtype)


def _rows_viewable(x: torch.Tensor) -> bool:
    if x.stride(-1) != 1:
        return False
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:  # a slice along a middle dim of a batch: its rows have no single stride
        return False
    return True


class RMSNorm(torch.autograd.Function):
    """y = RMSNorm(x) * w as Liger's LigerRMSNormFunction computes it (offset 0, not in place), our backward."""

    @staticmethod
    def forward(ctx, x, w, eps: float, weight_in_fp32: bool):
        from liger_kernel.ops.rms_norm import rms_norm_forward
        mode = "gemma" if weight_in_fp32 else "llama"
        if not _rows_viewable(x):  # Liger steps the width by 1 and views x as rows: other layouts are copied
            x = x.contiguous()
        y, x_2d, rstd, *_ = rms_norm_forward(x, w, eps, 0.0, mode, None)
        ctx.save_for_backward(x_2d, w, rstd)
        ctx.llama_order, ctx.shape = not weight_in_fp32, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_2d, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(x_2d.shape), x_2d, w, rstd, ctx.llama_order)
        return dx.view(ctx.shape), dw, None, None
