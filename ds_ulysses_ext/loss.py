"""The CP loss: local token-loss sums, a global normaliser, chunked logits, and a CP-group sum.

Legend: B batch, s local sequence, H hidden, V vocab, T = B * s local tokens, C chunk tokens.

docs/design.md §1.1: the objective is (sum of token cross-entropies over the global batch) / (non-masked tokens
in the global batch). Each rank contributes its local sum divided by that global count; the shares of
all ranks add up to the objective. How the engine then combines per-rank gradients is the engine's
business (engine/ds/grad_reduction.py multiplies the share by the factor the reduction path needs).

Logits are never all-gathered and never exist for the whole local sequence: lm_head + fp32
cross-entropy run on chunks of C tokens, so at most one [C, V] fp32 block is alive (on CUDA, one 16-bit
block: kernels/cross_entropy.py computes the rows in place). Two ways:
- fused (`linear_cross_entropy_sum`, the default): each chunk's gradients are computed in forward,
  where its logits already exist: the hidden-state gradient [C, H] is stored and the lm_head weight
  gradient is summed in fp32. Backward only multiplies both by the incoming gradient. No lm_head forward
  is recomputed (2·T·V·H FLOPs saved, about 3% of a 16k step of a 1B model). Unlike DeepSpeed's
  TiledFusedLogitsLoss, which backpropagates into the weight inside forward, no gradient is delivered
  before backward, so a scaled loss scales every gradient (docs/migrating.md). The cost is keeping
  [T, H] + fp32 [V, H] from forward to backward.
- checkpointed (`chunked_lm_loss_sum`): each chunk under activation checkpointing, the lm_head forward
  recomputed in backward; for heads that are not a bias-free nn.Linear.
Every rank runs the same number of chunks (local lengths are equal across ranks), which ZeRO-3's
collective parameter gathers require. Under ZeRO-3 the fused path reads lm_head's weight outside
lm_head's forward, so `CPCausalLM` registers it as an external parameter of its head-loss module
(DeepSpeed then gathers it for that module's forward and backward).
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .batch import IGNORE_INDEX
from .comm import all_reduce_sum
from .kernels.cross_entropy import cross_entropy_rows_, rows_ok
from .kernels.scale_cast import scaled_into
from .loss_rows import chunk_nll_sum_and_logit_grad
from .topology import Topology

log = logging.getLogger(__name__)

MAX_CHUNK = 4096
CHUNK_BLOCK_BYTES = 2**30  # the chunk's fp32 [C, V] block; its bf16 logits and gradient add half of it each


def chunk_tokens(requested: int, vocab: int) -> int:
    """trainer.loss_chunk_size, or (0) the largest power of two up to 4096 tokens whose fp32 [C, V] block stays
    within 1 GiB: 2048 at Llama-3's 128k vocabulary, 1024 at Qwen3's 152k, 4096 at 32k. The block, not the
    GEMM, sets the head's peak: at 4096 x 128k it was the step's largest transient (issue 22's breakdown)."""
    if requested:
        return requested
    c = MAX_CHUNK
    while c > 256 and c * vocab * 4 > CHUNK_BLOCK_BYTES:
        c //= 2
    return c


def _tokens(hidden_BsH: torch.Tensor, labels_Bs: torch.Tensor, chunk_size: int):
    """[B, s, H], [B, s] -> [T, H], [T], after checking the chunk size."""
    if chunk_size <= 0:
        raise ValueError(f"loss chunk size must be positive, got {chunk_size} (trainer.loss_chunk_size)")
    return hidden_BsH.reshape(-1, hidden_BsH.shape[-1]), labels_Bs.reshape(-1)


def _chunk_ce_sum(lm_head: torch.nn.Module, hidden_CH: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    logits_CV = lm_head(hidden_CH).float()  # fp32 logits for an exact softmax, one chunk at a time
    return F.cross_entropy(logits_CV, labels_C, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_lm_loss_sum(lm_head: torch.nn.Module, hidden_BsH: torch.Tensor, labels_Bs: torch.Tensor,
                        chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies over this rank's tokens, and how many tokens counted.

    labels are already shifted (shard_batch), -100 = no loss. Returns (fp32 scalar sum, int64 count).
    """
    hidden_TH, labels_T = _tokens(hidden_BsH, labels_Bs, chunk_size)
    total = hidden_TH.new_zeros((), dtype=torch.float32)
    # split, not hidden_TH[start:start + C]: each slice's backward would write a zero [T, H] tensor around its chunk
    # (T / C whole-tensor writes, quadratic in T); split's backward joins the chunks' gradients once
    for h, y in zip(hidden_TH.split(chunk_size), labels_T.split(chunk_size)):
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_ce_sum, lm_head, h, y, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(lm_head, h, y)
    return total, (labels_T != IGNORE_INDEX).sum()


def _kernel_rows(logits_CV, y_C, need_grad):
    """The chunk's rows in kernels/cross_entropy.py's Triton kernel, or None where it does not run (loss_rows.py then
    runs the torch rows)."""
    if not _triton_rows(logits_CV.device, logits_CV.dtype):
        return None
    return cross_entropy_rows_(logits_CV, y_C, IGNORE_INDEX, need_grad).sum(), logits_CV if need_grad else None


def _chunk_nll_sum_and_logit_grad(h_CH, weight_VH, y_C, need_grad, fused_rows=True):
    """One chunk: (fp32 sum of token NLLs, d(sum)/d logits in the weight dtype, or None); loss_rows.py says how.
    fused_rows: on CUDA the Triton rows (checked at first use), else the torch rows everywhere."""
    return chunk_nll_sum_and_logit_grad(h_CH, weight_VH, y_C, need_grad, _kernel_rows if fused_rows else None)


@functools.lru_cache(maxsize=None)
def _triton_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the chunk's rows run in kernels/cross_entropy.py's Triton kernel: CUDA with Triton, checked once
    per (device, dtype) against the torch rows above (a failure logs a warning and keeps them). Cached: it is asked
    once per chunk."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    return rows_ok(device, dtype)


def _add_weight_grad(grad_VH: torch.Tensor, g_CV: torch.Tensor, h_CH: torch.Tensor) -> None:
    """grad_VH (fp32) += g^T h. On CUDA in 16 bits cuBLAS adds the product into the fp32 buffer in its epilogue
    (addmm's out_dtype): no [V, H] temporary (0.5 GiB at 128k x 2048), no cast-and-add pass per chunk, and each
    chunk's product unrounded, as HF's one GEMM over all tokens keeps it. Elsewhere the product is rounded to the
    weight dtype, as autograd's lm_head backward rounds it, and added in fp32."""
    if g_CV.dtype in (torch.bfloat16, torch.float16) and _fp32_epilogue_works(g_CV.device, g_CV.dtype):
        torch.addmm(grad_VH, g_CV.t(), h_CH, out_dtype=torch.float32, out=grad_VH)
    else:
        grad_VH += (g_CV.t() @ h_CH).float()


@functools.lru_cache(maxsize=None)
def _fp32_epilogue_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a 16-bit product into an fp32 buffer in place, correctly (checked once on a small
    case against fp32 arithmetic on values exact in both dtypes); else the portable path, said in the log."""
    if device.type != "cuda":
        return False
    try:
        a = torch.arange(-8, 8, device=device, dtype=dtype).reshape(4, 4)
        b = torch.arange(0, 32, device=device, dtype=dtype).reshape(4, 8) / 8
        acc = torch.full((4, 8), 0.25, device=device)
        torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
        ok = torch.equal(acc, 0.25 + a.float().t() @ b.float())
    except (RuntimeError, TypeError) as err:
        ok, why = False, f"{type(err).__name__}: {err}"
    else:
        why = "wrong values"
    if not ok:
        log.info("fused loss: the fp32 weight-gradient epilogue is unavailable here (%s); each chunk's product is "
                 "rounded to %s and added in a separate pass", why, dtype)
    return ok


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_t CE(hidden_t @ weight^T, label_t), gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, chunk_size, fused_rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = hidden_TH.new_zeros((), dtype=torch.float32)
        grad_TH = torch.empty_like(hidden_TH) if need_h else None
        grad_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        for start in range(0, hidden_TH.shape[0], chunk_size):
            h_CH, y_C = hidden_TH[start:start + chunk_size], labels_T[start:start + chunk_size]
            nll_sum, g_CV = _chunk_nll_sum_and_logit_grad(h_CH, weight_VH, y_C, need_h or need_w, fused_rows)
            total = total + nll_sum
            if g_CV is None:
                continue
            if need_h:
                grad_TH[start:start + chunk_size] = g_CV @ weight_VH
            if need_w:
                _add_weight_grad(grad_VH, g_CV, h_CH)
            del g_CV  # before the next chunk's logits exist, so two chunks' blocks never coexist
        ctx.weight_dtype = weight_VH.dtype
        ctx.save_for_backward(grad_TH, grad_VH)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_TH, grad_VH = ctx.saved_tensors
        # grad_total is a 0-dim fp32 tensor: the product keeps grad_TH's dtype and is formed in fp32, one rounding
        # (a 16-bit copy of grad_total, e.g. 1/N, would scale every hidden gradient by its rounding error)
        grad_h = None if grad_TH is None else grad_TH * grad_total
        grad_w = None
        if grad_VH is not None:
            # formed in fp32 and written in the weight dtype: no fp32 [V, H] temporary beside the saved buffer (1.16 GiB
            # at Qwen3's vocabulary; the MoE step without recompute peaked exactly that much higher with this head
            # than with Liger's, docs/benchmarks.md AQ). Not in place: a graph kept for a second backward still
            # holds grad_VH
            grad_w = torch.empty(grad_VH.shape, dtype=ctx.weight_dtype, device=grad_VH.device)
            scaled_into(grad_VH, grad_total, grad_w)  # on CUDA a Triton kernel: torch's casting multiply is 3x slower
        return grad_h, grad_w, None, None, None


def fusable(lm_head: torch.nn.Module) -> bool:
    """The fused loss needs the head to be a bias-free linear map (Llama/Qwen/Mistral lm_heads are)."""
    return isinstance(lm_head, torch.nn.Linear) and lm_head.bias is None


def linear_cross_entropy_sum(weight_VH: torch.Tensor, hidden_BsH: torch.Tensor, labels_Bs: torch.Tensor,
                             chunk_size: int = 4096, kernel=None,
                             fused_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """As chunked_lm_loss_sum for a bias-free linear head given by its weight, without recompute.

    kernel: a fused head, (hidden [T, H], weight [V, H], labels [T]) -> fp32 sum, that computes its gradients in
    forward as this one does (ds_ulysses_ext.kernels: Liger's under model.loss_head=liger); None runs ours.
    fused_rows: ours runs each chunk's softmax rows in the Triton kernel on CUDA (False: the torch rows, which
    scripts/bench/bench_loss.py measures against it).
    """
    hidden_TH, labels_T = _tokens(hidden_BsH, labels_Bs, chunk_size)
    if not torch.is_grad_enabled():
        # evaluation: ctx.needs_input_grad follows requires_grad, not the grad mode, so the forward would
        # still build both gradients; detached inputs make it compute the loss alone
        hidden_TH, weight_VH = hidden_TH.detach(), weight_VH.detach()
    if kernel is not None:
        total = kernel(hidden_TH, weight_VH, labels_T)
    else:
        total = _LinearCrossEntropySum.apply(hidden_TH, weight_VH, labels_T, chunk_size, fused_rows)
    return total, (labels_T != IGNORE_INDEX).sum()


def cp_sum(x: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Sum a per-rank partial (e.g. a sequence's log-prob sum) over the CP group, with autograd.

    For sequence-level objectives (GRPO/DPO): every CP rank gets the full-sequence value. The backward
    all-reduces gradients, so each rank must backprop a share of the objective such that the shares
    over the CP group sum to it (e.g. objective / cp when every rank computes the same objective).
    """
    return all_reduce_sum(x, topology.cp_group)
