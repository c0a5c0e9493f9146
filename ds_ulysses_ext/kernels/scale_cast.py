"""out = (x * scale) in out's dtype, formed in fp32 and rounded once: the loss head's last pass over its fp32 weight
gradient on CUDA (ds_ulysses_ext/loss.py).

Shapes: x [N] any float dtype (contiguous), scale a 0-dim fp32 device tensor (read on the device: no host sync),
out [N] of x's shape -> out.

Why our own: torch.mul(x_fp32, scale, out=bf16) takes TensorIterator's casting path, which does not vectorise: 1.1 ms
for the 1B shape's [128256, 2048] weight gradient on an H200 (docs/benchmarks.md BA), three times the time its
bytes take. This kernel reads fp32 and writes 16 bits at bandwidth.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from .first_use import agrees

BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_cast(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(scale_ptr).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)
    return scale_cast, triton.cdiv


def scaled_into(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[...] = x * scale (fp32 product, one rounding to out's dtype); the Triton kernel on CUDA, torch elsewhere."""
    if x.shape != out.shape or scale.numel() != 1:
        raise ValueError(f"scaled_into: x {tuple(x.shape)}, out {tuple(out.shape)}, scale of {scale.numel()} elements")
    if not (x.is_cuda and x.is_contiguous() and out.is_contiguous() and kernel_ok(x.device, x.dtype, out.dtype)):
        return torch.mul(x, scale, out=out)
    return _launch(x, scale, out)


def _launch(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    kernel, cdiv = _kernel()
    n = x.numel()
    kernel[(cdiv(n, BLOCK),)](x, scale.to(torch.float32).reshape(()), out, n, BLOCK=BLOCK, num_warps=8)
    return out


@functools.lru_cache(maxsize=None)
def kernel_ok(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Checked once per (device, dtypes) against torch.mul on a tensor with a partial last block; exact: both form the
    product in fp32 and round it once. A failure logs a warning and torch's multiply stays (kernels/first_use.py)."""
    if importlib.util.find_spec("triton") is None:
        return False

    def pairs():
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(3 * BLOCK + 17, device=device, generator=gen).to(dtype)
        scale = torch.tensor(1 / 3, device=device)
        ref = torch.mul(x, scale, out=torch.empty(x.shape, dtype=out_dtype, device=device))
        return (("x * scale", _launch(x, scale, torch.empty_like(ref)), ref, 0.0),)
    return agrees("loss head: the Triton scaled cast", device, dtype, pairs)
