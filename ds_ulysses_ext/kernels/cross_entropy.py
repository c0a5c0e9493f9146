"""Cross-entropy over the rows of one logits block, with its gradient written over the logits: the loss head's
per-chunk kernel on CUDA (ds_ulysses_ext/loss.py runs the chunking and the three GEMMs around it).

Shapes: logits [C, V] (fp32, bf16 or fp16; last dim contiguous), labels [C] int64 -> loss [C] fp32, and with
grad=True the logits block overwritten by d(sum loss)/d logits = softmax - onehot (0 on ignored rows) in its own
dtype, i.e. the value HF's `cross_entropy(logits.float())` backward hands the 16-bit lm_head (fp32, then rounded).

Why our own: loss.py's torch path makes five fp32 passes over each [C, V] block (log-softmax out, gather, exp,
cast, mask); this kernel reads the 16-bit block twice and writes it once. Liger-Kernel's fused linear
cross-entropy has a kernel of this kind but chooses its own chunk of tokens, as small as 256 at Qwen3's 152k
vocabulary, so its weight gradient is summed in 64 GEMMs of depth 256 into an fp32 [V, H], each one bound by
that buffer's traffic (59 ms of a 240 ms MoE step, docs/benchmarks.md AN), and it reads the token count to the
host in forward. Here loss.py keeps its chunks (1024-2048 tokens) and its fp32 epilogue GEMM.

Labels outside [0, V) other than the ignore index give a NaN loss (trainer.on_nonfinite then stops or skips the
step) rather than a read out of bounds; the data pipeline refuses such ids before they get here (engine/data).
"""
from __future__ import annotations

import functools

import torch

from ..batch import IGNORE_INDEX
from ..loss_rows import chunk_nll_sum_and_logit_grad
from .first_use import agrees

BLOCK = 16384  # vocabulary columns per iteration (fp32 registers: 16 per thread at 32 warps)
NUM_WARPS = 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative, norm-wise; 16 bits: ~1 ulp


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(x_ptr, stride, y_ptr, loss_ptr, V, ignore_index, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        in_range = (y >= 0) & (y < V)
        offs = tl.arange(0, BLOCK)
        # pass 1: a running max and sum of exponentials (one rescale per block, so a masked tail never sees
        # -inf - -inf)
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        x_y = tl.load(x_row + tl.where(in_range, y, 0)).to(tl.float32)  # read before pass 2 overwrites it
        loss = tl.where(in_range, lse - x_y, float("nan"))
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        if WRITE_GRAD:
            keep = tl.where(valid, 1.0, 0.0)
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(cols == y, 1.0, 0.0)
                tl.store(x_row + cols, (g * keep).to(x_ptr.dtype.element_ty), mask=mask)

    return ce_rows


def cross_entropy_rows_(logits_CV: torch.Tensor, labels_C: torch.Tensor, ignore_index: int,
                        grad: bool) -> torch.Tensor:
    """Per-row token cross-entropy (fp32 [C], 0 on ignored rows); with grad, logits_CV now holds its gradient."""
    if logits_CV.stride(-1) != 1:
        raise ValueError("cross_entropy_rows_ needs the vocabulary dimension contiguous")
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C:
        _kernel()[(C,)](logits_CV, logits_CV.stride(0), labels_C.contiguous(), loss_C, V, ignore_index,
                        WRITE_GRAD=grad, BLOCK=min(BLOCK, 1 << (V - 1).bit_length()), num_warps=NUM_WARPS)
    return loss_C


@functools.lru_cache(maxsize=None)
def rows_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Checked once per (device, dtype): the kernel against loss_rows.py's torch rows (the path CPU runs) on one chunk
    whose vocabulary is no multiple of BLOCK (two blocks and a tail), with ignored rows: the chunk's loss sum and
    the logits' gradient. A failure or a disagreement logs a warning and the caller keeps the torch rows (slower,
    never wrong)."""

    def pairs():
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(33, 64, device=device, generator=gen).to(dtype)
        weight = (0.5 * torch.randn(BLOCK * 2 + 1001, 64, device=device, generator=gen)).to(dtype)  # logits ~ N(0, 16)
        labels = torch.randint(0, weight.shape[0], (33,), device=device, generator=gen)
        labels[::5] = IGNORE_INDEX
        ref_sum, ref_grad = chunk_nll_sum_and_logit_grad(hidden, weight, labels, True)
        got = hidden @ weight.t()
        loss_sum = cross_entropy_rows_(got, labels, IGNORE_INDEX, True).sum()
        return ("loss", loss_sum, ref_sum, 1e-5), ("gradient", got, ref_grad, TOLERANCE[dtype])
    return agrees("loss head: the Triton cross-entropy rows", device, dtype, pairs)
