"""Ring and hybrid (Ulysses x ring) attention: exact attention over a sequence split in zigzag order.

Legend: B batch, s local sequence (Sp / cp), Sp global padded sequence, R ring size, u = cp / R Ulysses group
size, L = s * u = 2c the ring share of one ring rank (its two zigzag chunks of c tokens, zigzag.py),
Hq / Hkv query / KV heads, h = Hq / u and hkv query / KV heads after the Ulysses exchange, D head dim of q and k,
Dv of v (MLA: Dv != D; K|V travel as [.. D + Dv], split at D = q's head dim, and out has Dv), bq query rows of one
kernel block.

    q [B s Hq D] --a2a(u)--> [B L h D] \
    k|v [B s 2*Hkv' D] --a2a(u)--> [B L 2*hkv D] --ring over R ranks--> o [B L h D] --a2a(u)--> [B s Hq D]

The Ulysses part is attention.py's (heads split by u, KV replicated when u > Hkv); with u = 1 it is skipped.
The ring: at step t ring rank r holds the K|V share of ring rank (r - t) mod R, computes its queries against it,
and merges the partial result into an fp32 online softmax (out, log-sum-exp). The next share's send/receive
(one batch_isend_irecv of the packed K|V) is started before the current block's kernel and waited after it.
With the zigzag layout each causal step t > 0 is exactly half a share's work on every rank: a share from an
earlier ring rank is seen whole by both local chunks through its first chunk only (q [L] x kv [c]), a share from
a later rank is seen whole by the second local chunk only (q [c] x kv [L]); step 0 is the causal local block.

Backward is hand-written, not autograd through the forward's communication: it saves only this rank's q, k, v,
out (input dtype) and the merged log-sum-exp ([B h L] fp32), i.e. O(local sequence) like a single flash kernel
(autograd through the ring would keep all R received K|V shares plus every block's probabilities). It passes
K|V around the ring again, recomputes each block's probabilities from the saved global log-sum-exp, and sends
the fp32 dK|dV accumulator of each share along with it; after R hops the accumulator is back at its owner.
The dK|dV send of step t overlaps the kernel of step t + 1. Per hop: K|V in the input dtype plus dK|dV in fp32.

The per-block kernels (ring_blocks.py, ring_varlen.py): a fused kernel (cuDNN's, else torch's flash; varlen
calls for many packed documents and for windows) where a block's visibility allows on CUDA in bf16/fp16, checked
once at first use, else the exact torch kernel. Visibility comes from GLOBAL positions: causal, packed documents
(the global cu_seqlens shard_batch returns, as for Ulysses) and HF's sliding window, so packing and windows are
exact under the ring too. A step whose block a window hides entirely (no query row within
the window of any of its keys) is skipped, in forward and backward: an empty block adds nothing to the merge, to dq
or to the dK|dV accumulator, which still travels on. A block that only document boundaries hide is still computed,
masked. A row may see no key of some block: its partial lse is -inf and it merges as an empty share.
GPT-OSS's sinks rescale the merged output by sigmoid(lse - sink) after the ring, in autograd: the ring's
backward takes the gradient that reaches the log-sum-exp as well (the fused kernels through an output lowered by
it, _lowered, since they derive the softmax row term from the output).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..comm import group_size
from ..errors import UnsupportedError
from . import ring_blocks as blocks
from . import ring_varlen  # noqa: F401  registers the varlen block calls with ring_blocks
from .exchange import head_to_seq
from .masks import document_ids
from .ring_blocks import BlockMask
from .ulysses import heads_exchange

log = logging.getLogger(__name__)

# --- the ring -------------------------------------------------------------------------------------------


class _Ring:
    """This rank's neighbours in the ring group; `start(t)` sends t to the next rank and receives from the previous."""

    def __init__(self, group):
        self.group = group
        self.size = group_size(group)
        self.rank = dist.get_rank(group) if self.size > 1 else 0
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: torch.Tensor):
        recv = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group)])
        return recv, reqs

    @staticmethod
    def wait(pending):
        recv, reqs = pending
        for req in reqs:
            req.wait()
        return recv


def _step_slices(t: int, src: int, r: int, L: int, causal: bool):
    """(query rows, key rows) of ring step t, whose K|V share belongs to ring rank src (zigzag.py).

    Causal attention skips the half of the block that no query sees; the mask from global positions still applies
    to what is left (it is all-visible there unless documents or a window cut it)."""
    c = L // 2
    if t == 0 or not causal:
        return slice(0, L), slice(0, L)
    if src < r:   # chunks src < r < 2R-1-r: its first chunk is seen whole by both of ours, its second by neither
        return slice(0, L), slice(0, c)
    # src > r: neither of its chunks is seen by our first chunk; both are seen whole by our second
    return slice(c, L), slice(0, L)


def _sees_any(mask: BlockMask) -> bool:
    """Whether some query row of a ring step's block sees some key of it; False only when the window hides it all.

    Without a window every block the ring computes is seen (_step_slices drops the causal halves no query sees), so
    that answer costs nothing. With one, both position lists are increasing (zigzag chunks in order): each query's
    nearest key at or before it decides (one host sync per step). Documents are not looked at, so a block they
    alone hide is computed, masked; skipping stays exact either way."""
    if mask.window is None:
        return True
    q, k = mask.q_pos, mask.k_pos
    nearest = torch.searchsorted(k, q, right=True) - 1  # the last key at or before each query, -1 if none
    return bool(((nearest >= 0) & (q - k[nearest.clamp_min(0)] < mask.window)).any())


def _block_mask(mask: BlockMask, ring: "_Ring", src: int, rows: slice, keys: slice) -> BlockMask:
    # the share of ring rank src holds the positions of its zigzag chunks, in order
    return BlockMask(mask.causal, mask.q_pos[rows], share_positions(mask.k_pos, ring.size, src)[keys],
                     mask.doc, mask.window)


def share_positions(all_pos: torch.Tensor, ring: int, src: int) -> torch.Tensor:
    """[L] global positions of ring rank src's share (its chunks src and 2*ring-1-src), from arange(Sp)."""
    chunks = all_pos.reshape(2 * ring, -1)
    return torch.cat([chunks[src], chunks[2 * ring - 1 - src]])


def _step(t: int, mask: BlockMask, ring: "_Ring", L: int, steps: Optional[dict]):
    """(src, query rows, key rows, the step's BlockMask, whether its block is seen) of ring step t. `steps`, when
    given, keeps them from the forward for the backward: the same step masks then carry their kernel plans
    (BlockMask.planned), whose host copies are made once per layer, not twice."""
    if steps is not None and t in steps:
        return steps[t]
    src = (ring.rank - t) % ring.size
    rows, keys = _step_slices(t, src, ring.rank, L, mask.causal)
    step_mask = _block_mask(mask, ring, src, rows, keys)
    step = (src, rows, keys, step_mask, _sees_any(step_mask))
    if steps is not None:
        steps[t] = step
    return step


def _ring_forward(q, k, v, scale, mask: BlockMask, ring: _Ring, steps: Optional[dict] = None):
    B, h, L, D = q.shape
    out = torch.zeros(B, h, L, v.shape[-1], dtype=torch.float32, device=q.device)  # v's head dim (MLA: Dv != D)
    lse = torch.full((B, h, L), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1).contiguous()  # [B hkv L 2D]: one message per hop
    for t in range(ring.size):
        pending = ring.start(kv) if t + 1 < ring.size else None
        _, rows, keys, step_mask, seen = _step(t, mask, ring, L, steps)
        if seen:  # a block the window hides would merge as an empty share: skip it
            o_b, l_b = blocks.block_forward(q[:, :, rows], kv[:, :, keys, :D], kv[:, :, keys, D:], scale, step_mask)
            blocks.merge(out, lse, rows, o_b, l_b)
        if pending is not None:
            kv = ring.wait(pending)
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, dlse, scale, mask: BlockMask, ring: _Ring,
                   steps: Optional[dict] = None):
    B, h, L, D = q.shape
    # [B h L]: softmax backward's row term of the merged output. A gradient reaching the log-sum-exp itself (the
    # sinks use it) adds dlse * p to each logit's gradient, which is the same as lowering that term by dlse
    delta = (dout.float() * out.float()).sum(-1)
    fused_out = out  # what the fused kernels get: they derive that row term themselves, as rowsum(dout * out)
    if dlse is not None:
        delta = delta - dlse.float()
        fused_out = _lowered(out, dout, dlse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the accumulator of the share we hold
    pending_dkv = None
    for t in range(ring.size):
        pending_kv = ring.start(kv) if t + 1 < ring.size else None
        _, rows, keys, step_mask, seen = _step(t, mask, ring, L, steps)
        if seen:  # a block the window hides has zero gradients: skip it, pass dK|dV on as is
            dq_b, dk_b, dv_b = blocks.block_backward(q[:, :, rows], kv[:, :, keys, :D], kv[:, :, keys, D:],
                                              dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, step_mask,
                                              out=fused_out[:, :, rows])
            dq[:, :, rows] += dq_b
        if pending_dkv is not None:  # the accumulator of this step's share, from the previous rank
            dkv = _Ring.wait(pending_dkv)
        if seen:
            dkv[:, :, keys, :D] += dk_b
            dkv[:, :, keys, D:] += dv_b
        if ring.size > 1:
            pending_dkv = ring.start(dkv)  # overlaps the next step's kernel; the last hop brings ours home
        if pending_kv is not None:
            kv = _Ring.wait(pending_kv)
    if pending_dkv is not None:
        dkv = _Ring.wait(pending_dkv)
    return dq, dkv[..., :D], dkv[..., D:]


def _lowered(out, dout, dlse):
    """[B h L D] an output whose rowsum(dout * it) is rowsum(dout * out) - dlse: moved along dout by dlse / |dout|^2.

    A fused kernel's backward takes the output, not the row term, so this is how the sinks' gradient on the
    log-sum-exp reaches it; the kernel uses the output for nothing else. The move is bounded: with the sinks,
    dout = g * w and dlse = (g . out) w (1 - w) for the upstream g, so it is (g . out)(1 - w) g / |g|^2, at most
    |out| long. Rows whose |dout|^2 underflows (w ~ 0: the sink takes everything) keep their output: their dlse is
    as small."""
    d = dout.float()
    norm2 = (d * d).sum(-1)
    step = torch.where(norm2 > torch.finfo(torch.float32).tiny, dlse.float() / norm2, torch.zeros_like(norm2))
    return (out.float() - step[..., None] * d).to(out.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BhLD, k_BhLD, v_BhLD, scale, mask, group):
        ring, steps = _Ring(group), {}
        out, lse = _ring_forward(q_BhLD, k_BhLD, v_BhLD, scale, mask, ring, steps)
        out = out.to(q_BhLD.dtype)
        ctx.save_for_backward(q_BhLD, k_BhLD, v_BhLD, out, lse)
        ctx.scale, ctx.mask, ctx.ring, ctx.steps = scale, mask, ring, steps
        ctx.set_materialize_grads(False)  # an unused lse (no sinks) then gets None, not zeros: no output to lower
        return out, lse

    @staticmethod
    def backward(ctx, dout_BhLD, dlse_BhL):
        q, k, v, out, lse = ctx.saved_tensors
        if dout_BhLD is None:
            dout_BhLD = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout_BhLD, dlse_BhL, ctx.scale, ctx.mask, ctx.ring, ctx.steps)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@functools.lru_cache(maxsize=None)
def _log_kernel(backend: str) -> None:
    log.info("ring attention: fused kernels (cuDNN's, else torch's flash, varlen calls for documents and windows) "
             "for the blocks they can take on CUDA in bf16/fp16 (checked at first use), else the exact torch block "
             "kernel; attention backend %s is not used inside the ring", backend)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring_group, ulysses_group=None,
                   causal: bool = True, softmax_scale: Optional[float] = None, backend: str = "auto",
                   cu_seqlens: Optional[torch.Tensor] = None, window: Optional[int] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's share of exact attention over the whole sequence, laid out in zigzag order (zigzag.py).

    Args:
        q: [B, s, Hq, D], this CP rank's tokens (zigzag.rank_positions); k, v: [B, s, Hkv, D].
        ring_group: the ring group (ranks with this rank's Ulysses index); ulysses_group: its Ulysses group
            (None or size 1: pure ring).
        causal: causal over global positions; softmax_scale: defaults to 1/sqrt(D).
        backend: 'auto' | 'sdpa' (the torch block kernel); flash kernels are refused inside the ring.
        cu_seqlens: [N+1] int32 document boundaries over the GLOBAL B * Sp tokens (masks.py), or None.
        window: sliding window (key k visible to query q when q - k < window), or None.
        sinks: [Hq] learned sink logits of all query heads (GPT-OSS), or None; this rank uses its Ulysses heads'.
    Returns:
        [B, s, Hq, D].
    """
    if backend not in ("auto", "sdpa"):
        raise UnsupportedError(f"attention backend {backend!r} is not available inside ring attention (it runs torch's "
                               "flash kernel or the exact torch block kernel per block); set model.attn_backend=auto "
                               "or parallelism.ring=1")
    _log_kernel(backend)
    u = group_size(ulysses_group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if v.shape[-1] > k.shape[-1]:  # a v wider than q/k: pad q and k with zeros (no logit changes), so K|V split at D
        D = v.shape[-1]
        q, k = (torch.nn.functional.pad(t, (0, D - t.shape[-1])) for t in (q, k))
    if u > 1:
        q, k, v = heads_exchange(q, k, v, ulysses_group)                   # [B L h D], [B L hkv D] x2
    if q.shape[1] % 2:
        raise ValueError(f"the ring share has {q.shape[1]} tokens, not two zigzag chunks; lay the batch out "
                         "with shard_batch() (zigzag.py)")
    if window is not None and not causal:
        raise ValueError("a sliding window is defined for causal attention only")
    R = group_size(ring_group)
    B, L = q.shape[:2]
    all_pos = torch.arange(L * R, device=q.device)
    doc = document_ids(cu_seqlens.to(q.device), B, L * R) if cu_seqlens is not None else None
    r = dist.get_rank(ring_group) if R > 1 else 0
    mask = BlockMask(causal, share_positions(all_pos, R, r), all_pos, doc, window)
    o_BhLD, lse_BhL = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, mask,
                                           ring_group)
    if sinks is not None:
        # a sink is one more logit per head with no value: softmax([s, sink]) rescales the sink-free output by
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); autograd carries it into lse and the sinks
        h = o_BhLD.shape[1]
        j = dist.get_rank(ulysses_group) if u > 1 else 0
        keep = torch.sigmoid(lse_BhL - sinks[j * h:(j + 1) * h].float()[None, :, None])
        o_BhLD = (o_BhLD.float() * keep[..., None]).to(q.dtype)
    return head_to_seq(o_BhLD.transpose(1, 2), ulysses_group)            # [B s Hq D]
