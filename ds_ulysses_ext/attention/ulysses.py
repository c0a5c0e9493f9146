"""Ulysses attention: exact attention over a sequence split into contiguous chunks across a CP group.

Legend: B batch, s local sequence, S = s * cp global sequence, Hq query heads, Hkv key/value heads,
hq = Hq / cp, hkv = max(Hkv, cp) / cp KV heads per rank after the exchange, D head dim (Dv: v's, when it differs).

    q [B s Hq D] --a2a--> [B S hq D] \
    k|v [B s 2*Hkv' D] --a2a--> [B S 2*hkv D] --local attention--> o [B S hq D] --a2a--> [B s Hq D]

Three all-to-alls per forward (Q, fused K|V, output) and three in backward (their adjoints).
K and V travel in one call: they are interleaved per destination rank so that a single
all_to_all_single delivers to rank j exactly its KV heads of both tensors.
GQA: no repeat_kv when Hkv % cp == 0; when cp % Hkv == 0 each KV head is replicated cp/Hkv times so
each rank receives the one KV head its query heads read (layout.kv_replication).
MLA (DeepSeek-V3, GLM-4-MoE-Lite): q/k have D = nope + rope dims, v has Dv != D. K and V still travel in one
all-to-all, each destination's heads flattened into one row of hkv * (D + Dv) values ([B s cp hkv*(D+Dv)]),
then split back; the output comes home with Dv. The rope part of k is rotated before (by HF's module, on the
chunk's global positions), so what moves is each head's finished k.
With cp == 1 this is a direct call of the local backend: the single-rank path is the reference.

Packed documents, sliding windows and sinks need nothing of the exchange: after it every rank holds the
whole sequence, so the global document boundaries (cu_seqlens) and the window apply as they are, and rank j,
holding query heads [j*hq, (j+1)*hq), uses those heads' sinks ([Hq] -> [hq]). Each rank's sinks gradient is
non-zero on its own heads only; the CP sum of parameter gradients assembles the whole.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm import group_size
from .backends import local_attention
from .exchange import head_to_seq, seq_to_head
from .layout import kv_replication


def heads_exchange(q, k, v, group):
    """[B s Hq D], [B s Hkv D] x2 -> this rank's heads over the whole sequence: [B S hq D], [B S hkv D] x2.

    K and V travel in one all-to-all; with more ranks than KV heads they are replicated first."""
    cp = group_size(group)
    rep = kv_replication(q.shape[2], k.shape[2], cp)
    if rep > 1:
        # [B s Hkv D] -> [B s cp D]: KV head i is read by query-head ranks i*rep .. i*rep+rep-1
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q_BShD = seq_to_head(q, group)                                 # [B S hq D]
    if k.shape[-1] != v.shape[-1]:
        return (q_BShD,) + _exchange_kv_dims(k, v, group, cp)
    kv_BShD = seq_to_head(_pack_kv(k, v, cp), group)               # [B S 2*hkv D]
    hkv = kv_BShD.shape[2] // 2
    return q_BShD, kv_BShD[:, :, :hkv], kv_BShD[:, :, hkv:]


def _pack_kv(k_BsHD: torch.Tensor, v_BsHD: torch.Tensor, cp: int) -> torch.Tensor:
    # [B s Hkv' D] x2 -> [B s cp*(2*hkv) D]: destination rank j's block holds its K heads then its V heads
    B, s, H, D = k_BsHD.shape
    k = k_BsHD.reshape(B, s, cp, H // cp, D)
    v = v_BsHD.reshape(B, s, cp, H // cp, D)
    return torch.cat([k, v], dim=3).reshape(B, s, 2 * H, D)


def _exchange_kv_dims(k_BsHD: torch.Tensor, v_BsHD: torch.Tensor, group, cp: int):
    # [B s Hkv' D], [B s Hkv' Dv] -> [B S hkv D], [B S hkv Dv]: one "head" per destination rank holding its K heads
    # then its V heads flattened, so one all-to-all moves both whatever their dims
    B, s, H, D = k_BsHD.shape
    Dv, h = v_BsHD.shape[-1], H // cp
    kv = torch.cat([k_BsHD.reshape(B, s, cp, h * D), v_BsHD.reshape(B, s, cp, h * Dv)], dim=3)  # [B s cp h*(D+Dv)]
    kv_BS1X = seq_to_head(kv, group)                                                            # [B S 1 h*(D+Dv)]
    S = kv_BS1X.shape[1]
    return kv_BS1X[:, :, 0, :h * D].reshape(B, S, h, D), kv_BS1X[:, :, 0, h * D:].reshape(B, S, h, Dv)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, causal: bool = True,
                      softmax_scale: Optional[float] = None, backend: str = "auto",
                      cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                      window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's chunk of exact attention over the whole sequence.

    Args:
        q: [B, s, Hq, D], this rank's contiguous chunk `rank_in_group` of the sequence.
        k, v: [B, s, Hkv, D]; v may have its own head dim Dv (MLA), which the output then has.
        group: the CP process group (None or size 1: plain local attention).
        causal: causal mask over global positions (chunks are in rank order).
        softmax_scale: defaults to 1/sqrt(D).
        backend: 'auto' | 'sdpa' | 'flash_attn' | 'fa4' (see backends.py).
        cu_seqlens: [N+1] int32 document boundaries over the GLOBAL B * S tokens (masks.py), or None.
        max_seqlen: the longest document (varlen kernels need it), with cu_seqlens.
        window: sliding window (key k visible to query q when q - k < window), or None.
        sinks: [Hq] learned sink logits of all query heads, or None.
    Returns:
        [B, s, Hq, Dv].
    """
    cp = group_size(group)
    features = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window)
    if cp == 1:
        return local_attention(backend, q, k, v, causal=causal, softmax_scale=softmax_scale, sinks=sinks, **features)
    if sinks is not None:
        hq = q.shape[2] // cp
        j = dist.get_rank(group)
        sinks = sinks[j * hq:(j + 1) * hq]
    q_BShD, k_BShD, v_BShD = heads_exchange(q, k, v, group)
    o_BShD = local_attention(backend, q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale,
                             sinks=sinks, **features)
    return head_to_seq(o_BShD, group)                              # [B s Hq D]
