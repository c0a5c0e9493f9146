"""torch's own flash kernel (FlashAttention-2, in every CUDA build of torch) for documents, windows and sinks.

Legend: B batch, S sequence, T = B * S tokens of the flat (THD) layout, h query heads, hkv KV heads, D head dim,
N documents.

    q [B S h D], k|v [B S hkv D], cu_seqlens [N+1] int32 over the T tokens -> out [B S h D]

Packed documents, HF's sliding window and GPT-OSS's sinks are what the `sdpa` backend otherwise runs through
masks.py's torch path: masked SDPA calls per query block, or one call per long document plus padded batches of
short ones. The varlen flash kernel does all of it in ONE call per layer: documents as cu_seqlens (the layout
masks.py already keeps; a row without documents is one document of S tokens), the window as its left reach
(window - 1: HF's `q - k < window`), GQA natively. Sinks are not a flash argument; they ride on its log-sum-exp:
one value-free logit s per head rescales the sink-free output by w = sigmoid(lse - s), and in the backward a
gradient on the lse is the same as replacing the kernel's row term rowsum(dout * out) by one lowered by it.
Handing the kernel dout * w and the RESCALED output does exactly that (rowsum(dout w * out w) is the lowered term,
worked out in _FlashVarlen.backward), so the kernel's own backward gives the exact dq, dk, dv; the sinks'
gradient is -sum over tokens of rowsum(dout * out) * w (1 - w).

Used on CUDA in bf16/fp16 for head dims the kernel takes, after a once-per-(device, dtype, head dim) check against
masks.py's exact path; a kernel that cannot run there is logged and masks.py runs instead, one that disagrees is
an error. Called through aten directly because the public SDPA call takes neither cu_seqlens nor a window.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .kernel_check import first_disagreement, fused_shape_ok, isolated

log = logging.getLogger(__name__)


def _reach(window: Optional[int], causal: bool):
    # the kernel's (left, right) reach: -1 is unbounded; HF's window sees q - k < window
    return (-1 if window is None else window - 1), (0 if causal else -1)


class _AtenFlash:
    """The kernel's two calls: [Tq h D] q, [Tk hkv D] k|v, cu_q / cu_k [N+1] int32 (segment n: queries
    cu_q[n]:cu_q[n+1] against keys cu_k[n]:cu_k[n+1]), max_q / max_k their longest; lse comes as [h Tq] (the varlen
    layout). left / right: how far before / after its aligned position a query sees (-1: unbounded); a segment
    with fewer queries than keys aligns its queries with its LAST keys (flash's bottom-right causal)."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right)
        return out, lse, (rng, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, state=None):
        # state: the forward's random-state tensors; dropout 0 never reads them, so a backward that did not run
        # this forward (the ring's, from the merged output) passes None and gets placeholders on the device
        if state is None:
            state = (torch.zeros(2, dtype=torch.int64, device=q.device),
                     torch.zeros((), dtype=torch.int64, device=q.device))
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, *state, scale=scale,
            window_size_left=left, window_size_right=right)


KERNEL = _AtenFlash  # tests put a CPU stand-in with the same contract here, to check the algebra in CI


def _keep(lse_hT, sinks_h, dtype):
    # [T h 1] w = sigmoid(lse - sink), the share of the softmax the sink leaves to the real keys; fp32 at least
    acc = torch.promote_types(dtype, torch.float32)
    return torch.sigmoid(lse_hT.to(acc).t() - sinks_h.to(acc)[None])[..., None]


class _FlashVarlen(torch.autograd.Function):
    """[T h D] q, [T hkv D] k|v, [h] sinks or None -> [T h D]."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len: int, scale: float, causal: bool, window: Optional[int]):
        kernel, reach = KERNEL, _reach(window, causal)
        out, lse, state = kernel.forward(q, k, v, cu, cu, max_len, max_len, scale, causal, *reach)
        final = out
        if sinks is not None:  # lse [h T] -> w [T h 1]
            w = _keep(lse, sinks, out.dtype)
            final = (out.to(w.dtype) * w).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, final, lse, cu, sinks)
        ctx.args = (kernel, max_len, scale, causal, reach, state)
        return final

    @staticmethod
    def backward(ctx, dfinal):
        q, k, v, out, final, lse, cu, sinks = ctx.saved_tensors
        kernel, max_len, scale, causal, reach, state = ctx.args
        dsinks, dout = None, dfinal
        if sinks is not None:
            # final = out * w, w = sigmoid(lse - s): with a = rowsum(dfinal * out), the logits' gradient is
            # p * (dp - a w + a w (1 - w)) = p * (dp - a w^2), dp from dout = dfinal * w; and rowsum(dout * final)
            # = a w^2, so the kernel's backward on (dout, final) is exact
            w = _keep(lse, sinks, out.dtype)  # [T h 1]
            a = (dfinal.to(w.dtype) * out.to(w.dtype)).sum(-1, keepdim=True)
            dsinks = -(a * w * (1 - w)).sum((0, 2)).to(sinks.dtype)
            dout = (dfinal.to(w.dtype) * w).to(dfinal.dtype)
        dq, dk, dv = kernel.backward(dout.contiguous(), q, k, v, final, lse, cu, cu, max_len, max_len, scale, causal,
                                     *reach, state)
        return dq, dk, dv, dsinks, None, None, None, None, None


def usable(q_BShD: torch.Tensor) -> bool:
    """Whether this kernel takes q's device, dtype and head dim (and passed its check there)."""
    if KERNEL is not _AtenFlash:  # a test's stand-in
        return True
    return fused_shape_ok(q_BShD) and _checked(q_BShD.device, q_BShD.dtype, q_BShD.shape[-1])


def varlen_attention(q_BShD, k_BShD, v_BShD, *, causal: bool, scale: float, cu_seqlens: Optional[torch.Tensor],
                     max_seqlen: Optional[int], window: Optional[int], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Documents (cu_seqlens over the B * S tokens, max_seqlen its longest), window and sinks in one kernel call."""
    B, S, h, D = q_BShD.shape
    if window is not None and not causal:  # as masks.py: HF's window is a causal notion
        raise ValueError("a sliding window is defined for causal attention only")
    if cu_seqlens is None:  # every row one document
        cu_seqlens = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=q_BShD.device)
        max_seqlen = S
    elif max_seqlen is None:  # a direct caller: one host sync for the longest document
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    flat = [t.reshape(B * S, t.shape[2], D).contiguous() for t in (q_BShD, k_BShD, v_BShD)]  # [T h|hkv D]
    out = _FlashVarlen.apply(*flat, sinks, cu_seqlens.to(device=q_BShD.device, dtype=torch.int32), int(max_seqlen),
                             scale, causal, window)
    return out.reshape(B, S, h, D)


@functools.lru_cache(maxsize=None)
def _checked(device, dtype, D: int) -> bool:
    """Once per (device, dtype, head dim): documents + window + sinks through this kernel against masks.py's exact
    path in fp32, forward and backward (sinks included). Cannot run: logged, False. Disagrees: an error."""
    with isolated():  # first use is inside a layer's forward, maybe checkpointed or under no_grad (kernel_check.py)
        return _check(device, dtype, D)


def _check(device, dtype, D: int) -> bool:
    from .masks import cu_seqlens_of, masked_attention
    g = torch.Generator(device=device).manual_seed(0)
    lengths, h, hkv = (150, 37, 200), 4, 2
    S = sum(lengths)
    q, dout = (torch.randn(1, S, h, D, device=device, generator=g) for _ in range(2))
    k, v = (torch.randn(1, S, hkv, D, device=device, generator=g) for _ in range(2))
    sinks = torch.randn(h, device=device, generator=g)
    cu = cu_seqlens_of(torch.cat([torch.arange(n, device=device) for n in lengths])[None])
    for causal, window, with_sinks in ((True, None, False), (True, 64, True), (False, None, True)):
        grads = []
        for run_dtype in (dtype, torch.float32):
            leaves = [t.detach().to(run_dtype).requires_grad_() for t in (q, k, v, sinks)]
            kw = dict(causal=causal, cu_seqlens=cu, window=window, sinks=leaves[3] if with_sinks else None)
            try:
                if run_dtype == dtype:
                    out = varlen_attention(*leaves[:3], scale=D ** -0.5, max_seqlen=max(lengths), **kw)
                else:
                    out = masked_attention(*leaves[:3], **kw)
                out.backward(dout.to(run_dtype))
            except (RuntimeError, TypeError) as err:
                log.warning("torch's varlen flash kernel cannot run on %s in %s (%s); documents, windows and sinks "
                            "run masks.py's torch path", device, dtype, str(err).splitlines()[0][:200])
                return False
            grads.append([out] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves])
        bad = first_disagreement(zip(("out", "dq", "dk", "dv", "dsinks"), *grads))
        if bad:
            raise RuntimeError(f"torch's varlen flash kernel disagrees with masks.py's exact path on {device} in "
                               f"{dtype} ({bad[0]}: error {bad[1]:.2e}; causal={causal}, window={window}, sinks="
                               f"{with_sinks}); set model.attn_backend to another kernel or report this")
    log.info("torch's varlen flash kernel checked against masks.py on %s in %s: documents, windows and sinks run it",
             device, dtype)
    return True
