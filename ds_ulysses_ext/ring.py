"""Ring and hybrid (Ulysses x ring) attention: exact attention over a sequence split in zigzag order.

Legend: B batch, s local sequence (Sp / cp), Sp global padded sequence, R ring size, u = cp / R Ulysses group
size, L = s * u = 2c the ring share of one ring rank (its two zigzag chunks of c tokens, zigzag.py),
Hq / Hkv query / KV heads, h = Hq / u and hkv query / KV heads after the Ulysses exchange, D head dim,
bq query rows of one kernel block.

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

The per-block kernel is exact torch (fp32 logits, one [B h bq Lk] block of bq = QUERY_BLOCK rows at a time), on
CPU and GPU; flash kernels are not used inside the ring yet. Packed documents, sliding windows and sinks are
refused under a ring (integrate.py, configs/validate.py).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist

from .attention import _pack_kv
from .comm import group_size, head_to_seq, seq_to_head
from .errors import UnsupportedError
from .layout import kv_replication

log = logging.getLogger(__name__)

QUERY_BLOCK = 2048  # query rows per kernel block: bounds the fp32 logits to QUERY_BLOCK x key share


# --- the per-block kernel: [B h Lq D] x [B hkv Lk D] -> out [B h Lq D] fp32, lse [B h Lq] fp32 ------------


def _expand(kv_BhLD: torch.Tensor, h: int) -> torch.Tensor:
    # GQA: query head i reads KV head i // (h / hkv), as repeat_kv does
    hkv = kv_BhLD.shape[1]
    return kv_BhLD if hkv == h else kv_BhLD.repeat_interleave(h // hkv, dim=1)


def _fold(grad_BhLD: torch.Tensor, hkv: int) -> torch.Tensor:
    # the adjoint of _expand: sum the query heads that share a KV head
    B, h, L, D = grad_BhLD.shape
    return grad_BhLD if h == hkv else grad_BhLD.reshape(B, hkv, h // hkv, L, D).sum(2)


def _logits(q, k, scale, causal, qs):
    # [B h bq D] x [B h Lk D] -> [B h bq Lk] fp32; causal: query row qs + i sees keys 0 .. qs + i (same block start)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        bq, Lk = logits.shape[-2:]
        rows = torch.arange(qs, qs + bq, device=q.device)[:, None]
        logits = logits.masked_fill(torch.arange(Lk, device=q.device)[None, :] > rows, float("-inf"))
    return logits


def block_forward(q, k, v, scale: float, causal: bool):
    """Attention of q against one K|V block, with its log-sum-exp (causal: q and k cover the same positions)."""
    h = q.shape[1]
    k, v = _expand(k, h), _expand(v, h)
    outs, lses = [], []
    for qs in range(0, q.shape[2], QUERY_BLOCK):
        qb = q[:, :, qs:qs + QUERY_BLOCK]
        logits = _logits(qb, k, scale, causal, qs)
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.matmul(torch.exp(logits - lse[..., None]), v.float()))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """dq, dk, dv (fp32) of one block, from the MERGED log-sum-exp and delta = rowsum(dout * out) of the whole row."""
    h, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, h).float(), _expand(v, h).float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for qs in range(0, q.shape[2], QUERY_BLOCK):
        qb, dob = q[:, :, qs:qs + QUERY_BLOCK].float(), dout[:, :, qs:qs + QUERY_BLOCK].float()
        p = torch.exp(_logits(qb, ke, scale, causal, qs) - lse[:, :, qs:qs + QUERY_BLOCK, None])
        dv += torch.matmul(p.transpose(-1, -2), dob)
        ds = p * (torch.matmul(dob, ve.transpose(-1, -2)) - delta[:, :, qs:qs + QUERY_BLOCK, None])
        dq[:, :, qs:qs + QUERY_BLOCK] = torch.matmul(ds, ke) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qb) * scale
    return dq, _fold(dk, hkv), _fold(dv, hkv)


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
    """(query rows, key rows, causal) of ring step t, whose K|V share belongs to ring rank src (zigzag.py)."""
    c = L // 2
    if t == 0:
        return slice(0, L), slice(0, L), causal
    if not causal:
        return slice(0, L), slice(0, L), False
    if src < r:   # chunks src < r < 2R-1-r: its first chunk is seen whole by both of ours, its second by neither
        return slice(0, L), slice(0, c), False
    # src > r: neither of its chunks is seen by our first chunk; both are seen whole by our second
    return slice(c, L), slice(0, L), False


def _ring_forward(q, k, v, scale, causal, ring: _Ring):
    B, h, L, D = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((B, h, L), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1).contiguous()  # [B hkv L 2D]: one message per hop
    for t in range(ring.size):
        pending = ring.start(kv) if t + 1 < ring.size else None
        rows, keys, blk_causal = _step_slices(t, (ring.rank - t) % ring.size, ring.rank, L, causal)
        o_b, l_b = block_forward(q[:, :, rows], kv[:, :, keys, :D], kv[:, :, keys, D:], scale, blk_causal)
        # fp32 online softmax: rescale both partial results to the merged log-sum-exp
        merged = torch.logaddexp(lse[:, :, rows], l_b)
        out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                           + o_b * torch.exp(l_b - merged)[..., None])
        lse[:, :, rows] = merged
        if pending is not None:
            kv = ring.wait(pending)
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, scale, causal, ring: _Ring):
    B, h, L, D = q.shape
    delta = (dout.float() * out.float()).sum(-1)  # [B h L]: softmax backward's row term, of the merged output
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.cat([k, v], dim=-1).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the accumulator of the share we hold
    pending_dkv = None
    for t in range(ring.size):
        pending_kv = ring.start(kv) if t + 1 < ring.size else None
        rows, keys, blk_causal = _step_slices(t, (ring.rank - t) % ring.size, ring.rank, L, causal)
        dq_b, dk_b, dv_b = block_backward(q[:, :, rows], kv[:, :, keys, :D], kv[:, :, keys, D:], dout[:, :, rows],
                                          lse[:, :, rows], delta[:, :, rows], scale, blk_causal)
        dq[:, :, rows] += dq_b
        if pending_dkv is not None:  # the accumulator of this step's share, from the previous rank
            dkv = _Ring.wait(pending_dkv)
        dkv[:, :, keys, :D] += dk_b
        dkv[:, :, keys, D:] += dv_b
        if ring.size > 1:
            pending_dkv = ring.start(dkv)  # overlaps the next step's kernel; the last hop brings ours home
        if pending_kv is not None:
            kv = _Ring.wait(pending_kv)
    if pending_dkv is not None:
        dkv = _Ring.wait(pending_dkv)
    return dq, dkv[..., :D], dkv[..., D:]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BhLD, k_BhLD, v_BhLD, scale, causal, group):
        ring = _Ring(group)
        out, lse = _ring_forward(q_BhLD, k_BhLD, v_BhLD, scale, causal, ring)
        out = out.to(q_BhLD.dtype)
        ctx.save_for_backward(q_BhLD, k_BhLD, v_BhLD, out, lse)
        ctx.scale, ctx.causal, ctx.ring = scale, causal, ring
        return out

    @staticmethod
    def backward(ctx, dout_BhLD):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout_BhLD, ctx.scale, ctx.causal, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@functools.lru_cache(maxsize=None)
def _log_kernel(backend: str) -> None:
    log.info("ring attention: exact torch block kernel (attention backend %s is not used inside the ring)", backend)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring_group, ulysses_group=None,
                   causal: bool = True, softmax_scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """This rank's share of exact attention over the whole sequence, laid out in zigzag order (zigzag.py).

    Args:
        q: [B, s, Hq, D], this CP rank's tokens (zigzag.rank_positions); k, v: [B, s, Hkv, D].
        ring_group: the ring group (ranks with this rank's Ulysses index); ulysses_group: its Ulysses group
            (None or size 1: pure ring).
        causal: causal over global positions; softmax_scale: defaults to 1/sqrt(D).
        backend: 'auto' | 'sdpa' (the torch block kernel); flash kernels are refused inside the ring.
    Returns:
        [B, s, Hq, D].
    """
    if backend not in ("auto", "sdpa"):
        raise UnsupportedError(f"attention backend {backend!r} is not available inside ring attention (it runs an "
                               "exact torch block kernel); set model.attn_backend=auto or parallelism.ring=1")
    _log_kernel(backend)
    u = group_size(ulysses_group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if u > 1:
        rep = kv_replication(q.shape[2], k.shape[2], u)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q = seq_to_head(q, ulysses_group)                                  # [B L h D]
        kv = seq_to_head(_pack_kv(k, v, u), ulysses_group)                 # [B L 2*hkv D]
        hkv = kv.shape[2] // 2
        k, v = kv[:, :, :hkv], kv[:, :, hkv:]
    if q.shape[1] % 2:
        raise ValueError(f"the ring share has {q.shape[1]} tokens, not two zigzag chunks; lay the batch out "
                         "with shard_batch() (zigzag.py)")
    o_BhLD = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, causal, ring_group)
    return head_to_seq(o_BhLD.transpose(1, 2), ulysses_group)            # [B s Hq D]
