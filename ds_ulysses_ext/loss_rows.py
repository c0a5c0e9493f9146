"""One chunk of the loss head in torch: the sum of its token NLLs and d(sum)/d logits, the rows every device can run.

Legend: C chunk tokens, H hidden, V vocab.

Its own module, below both users: loss.py runs it for each chunk (or the Triton rows in its place), and
kernels/cross_entropy.py checks that kernel against it at first use. Neither imports the other's module for it.
"""
from __future__ import annotations

import torch

from .batch import IGNORE_INDEX


def chunk_nll_sum_and_logit_grad(h_CH, weight_VH, y_C, need_grad, kernel_rows=None):
    """One chunk: (fp32 sum of token NLLs, d(sum)/d logits in the weight dtype, or None).

    lm_head runs in the weight dtype, then an fp32 log-softmax: the same rounding as HF's cross_entropy
    on .float() logits. kernel_rows: (logits [C, V], labels [C], need_grad) -> the same pair, or None where the
    kernel does not run; loss.py passes kernels/cross_entropy.py's Triton rows on CUDA, which write the gradient
    over the 16-bit logits: no fp32 block at all. The logits are formed here and only handed to it, so that when the
    torch rows run instead this frame holds their only reference and frees them before the fp32 gradient's cast.
    Otherwise each pass over a [C, V] fp32 block reads and writes 4*C*V bytes, the largest
    memory traffic of the step's head (docs/benchmarks.md, section H), so the chunk makes as few passes
    as it can: one fused log-softmax kernel (not logsumexp's
    amax/sub/exp/sum/log) that reads the 16-bit logits and writes fp32 (`dtype=`: no separate upcast pass or
    fp32 copy; on CPU torch upcasts first, as before) and, for the gradient, one in-place exp and one cast. Being
    a function, its fp32 block is freed on return, before the caller's matmuls allocate.
    """
    logits_CV = h_CH @ weight_VH.t()
    if kernel_rows is not None:
        done = kernel_rows(logits_CV, y_C, need_grad)
        if done is not None:
            return done
    logp_CV = torch.log_softmax(logits_CV, dim=-1, dtype=torch.float32)
    del logits_CV
    valid_C = y_C != IGNORE_INDEX
    y_safe_C = torch.where(valid_C, y_C, 0)
    nll_sum = torch.where(valid_C, logp_CV.gather(1, y_safe_C[:, None]).squeeze(1).neg_(), 0.0).sum()
    if not need_grad:
        return nll_sum, None
    # d(sum CE)/d logits = softmax - onehot on counted rows, 0 on masked rows; in place
    g_CV = logp_CV.exp_()
    g_CV[torch.arange(g_CV.shape[0], device=g_CV.device), y_safe_C] -= 1.0
    g_CV = g_CV.to(weight_VH.dtype)  # as autograd casts it for the lm_head backward
    # masking after the cast is exact (x * 1 and x * 0 round the same) and moves half the bytes; a mask
    # of the same dtype keeps the kernel vectorised
    return nll_sum, g_CV.mul_(valid_C.to(g_CV.dtype)[:, None])
