"""Which keys a query may see: packed-document boundaries, sliding windows, learned sinks; the exact torch path.

Legend: B batch, S global sequence (padded, after the Ulysses exchange), h query heads on this rank,
hkv KV heads on this rank, D head dim, N documents in the batch, bq queries in one block, L keys in its span.

Documents travel as one flat `cu_seqlens` [N+1] (int32) over the B * S tokens of the batch, the layout the
varlen kernels take: every row boundary is also a document boundary. It is computed once from the global
position_ids (shard_batch) and is the same on every CP rank, because after the all-to-all each rank holds the
whole sequence for its heads.

Key k is visible to query q when (all that apply): k <= q (causal), doc(k) == doc(q) (packing), and
q - k < window (HF's sliding window: `kv_idx > q_idx - sliding_window`). Sinks add one logit column per query
head to the softmax (learned, value-free): p = softmax([q.k * scale ..., sink]) without the sink's share.
They run through SDPA too, as one extra zero-value key whose logit the query carries (_sink_operands).

The torch path walks query blocks so that the boolean mask exists for one block
at a time, and each block's key span starts at its earliest visible key (the window's reach, its first
document's start), so a window or short documents make it cheaper, not just masked.

Packed documents without a window or sinks take a faster road: a document of at least one query block gets
its own unmasked SDPA call (is_causal), which on Hopper is cuDNN's fused kernel; shorter causal documents are
padded at their end to a multiple of DOC_BUCKET and batched, one unmasked is_causal call per padded length (the
pads come after every real token, so causal attention never lets a real row see them). A masked SDPA call costs
several times an unmasked one per visible pair (docs/benchmarks.md, packing); without causality the short
documents keep the masked block walk.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

CU_SEQLENS_KEY = "cp_cu_seqlens"  # the batch key (shard_batch) and attention kwarg (integrate.py) that carry them
QUERY_BLOCK = 2048  # queries per block of the torch path: bounds its mask to QUERY_BLOCK x key span
DOC_BUCKET = 128  # packed causal documents shorter than a block are padded to a multiple of this and batched


def document_starts(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a new document begins (HF's packing rule: a step that is not +1, and column 0)."""
    starts = torch.ones_like(position_ids_BS, dtype=torch.bool)
    starts[:, 1:] = position_ids_BS[:, 1:] - position_ids_BS[:, :-1] != 1
    return starts


def is_packed(position_ids_BS: torch.Tensor) -> bool:
    return bool(document_starts(position_ids_BS)[:, 1:].any())


def cu_seqlens_of(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] global position_ids -> [N+1] int32 flat document boundaries over the B * S tokens."""
    flat = document_starts(position_ids_BS).reshape(-1).nonzero().flatten()
    total = torch.tensor([position_ids_BS.numel()], device=flat.device)
    return torch.cat([flat, total]).to(torch.int32)


def document_ids(cu_seqlens: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """[N+1] boundaries -> [B, S] int64 document index of every token (unique across rows)."""
    tokens = torch.arange(B * S, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)).reshape(B, S)


def positions_in_documents(cu_seqlens: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """[B, S] position of every token inside its document: what restarting position_ids must hold."""
    tokens = torch.arange(B * S, device=cu_seqlens.device)
    doc = document_ids(cu_seqlens, B, S).reshape(-1)
    return (tokens - cu_seqlens.long()[doc]).reshape(B, S)


def _block_mask(q_idx, k_idx, doc_BS, window, causal):
    # [bq], [L] global indices -> [B|1, 1, bq, L] bool, True = visible
    rel = q_idx[:, None] - k_idx[None, :]
    mask = rel >= 0 if causal else torch.ones_like(rel, dtype=torch.bool)
    if window is not None:
        mask = mask & (rel < window)
    mask = mask[None, None]
    if doc_BS is not None:
        mask = mask & (doc_BS[:, q_idx][:, None, :, None] == doc_BS[:, k_idx][:, None, None, :])
    return mask


def _sink_operands(q, k, v, sinks_h, scale):
    """[B h S D] q, [B hkv S D] k, v -> the operands of sink attention as plain SDPA with one extra key.

    The sink of head h is a key whose value is zero and whose logit is s_h. A key is shared by a KV group but
    the sink differs per query head, so the sink's logit rides in the QUERY: q' = [q, s_h / scale, 0...],
    k'_j = [k_j, 0, 0...] for the real keys, k'_sink = [0, 1, 0...] with v'_sink = 0; then scale * q'.k'_j =
    scale * q.k_j and scale * q'.k'_sink = s_h, and softmax over [real keys..., sink] times [v..., 0] is exactly
    p = softmax([q.k * scale ..., s_h]) without the sink's share, applied to v. The head dim is padded with zeros
    to a multiple of 8 (q', k', v' alike; zeros change no dot product) so that the fused GPU kernels take it;
    callers slice the output back to D. The sink's gradient flows through q''s extra coordinate (autograd sums
    it over batch and queries).

    Precision: s_h / scale is computed in at least fp32 and rounded ONCE to the input dtype, so in bf16 the sink
    logit carries the same input rounding as q.k does (bf16: ~3 significant digits; exact when s_h is already a
    bf16 value and scale a power of two, as at D 64); the kernel then forms scale * q'.k'_sink with its fp32
    accumulation. The former explicit path kept the sink logit in fp32. fp32 inputs keep it in fp32.
    """
    B, h, S, D = q.shape
    Dp = -(-(D + 1) // 8) * 8
    acc = torch.promote_types(sinks_h.dtype, torch.float32)
    # a sink of -inf (no sink: the ring tests' reference passes it) or one whose s_h / scale overflows the dtype
    # is clamped to the dtype's finite range: -inf * 0 would make every real logit NaN, while the most negative
    # finite coordinate still gives the sink probability 0 (scale <= 1) and, like -inf, no gradient
    finite = torch.finfo(q.dtype)
    coord = (sinks_h.to(acc) / scale).to(q.dtype).clamp(finite.min, finite.max)
    coord = coord.reshape(1, h, 1, 1).expand(B, h, S, 1)
    qp = torch.cat([q, coord, q.new_zeros(B, h, S, Dp - D - 1)], dim=-1)  # [B h S Dp]
    kp, vp = F.pad(k, (0, Dp - D)), F.pad(v, (0, Dp - D))  # [B hkv S Dp]
    sink_key = k.new_zeros(Dp)
    sink_key[D] = 1
    return qp, kp, vp, sink_key


def _with_sinks(qb, kb, vb, mask, sink_key, scale, gqa):
    # one block of sink attention through SDPA: padded operands (_sink_operands) plus the sink key, zero value
    # and an always-visible mask column; returns [B h bq Dp] (the caller slices D back)
    B, hkv, L, Dp = kb.shape
    kb = torch.cat([kb, sink_key.expand(B, hkv, 1, Dp)], dim=2)
    vb = F.pad(vb, (0, 0, 0, 1))
    mask = F.pad(mask, (0, 1), value=True)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)


def masked_attention(q_BShD: torch.Tensor, k_BShD: torch.Tensor, v_BShD: torch.Tensor, *, causal: bool = True,
                     softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                     window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                     block: int = QUERY_BLOCK) -> torch.Tensor:
    """Exact attention with documents, a window and/or sinks, in torch ([B, S, h, D] in and out).

    sinks: [h], one logit per query head of THIS tensor (a CP rank passes its heads' slice).
    """
    B, S, h, D = q_BShD.shape
    if window is not None and not causal:
        raise ValueError("a sliding window is defined for causal attention only")
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens is not None and window is None and sinks is None:
        return _per_document(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, block)
    return _blocked(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, window, sinks, block)


def _per_document(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, block):
    """Documents of >= `block` tokens: one unmasked SDPA call each. Shorter ones, causal: padded at their END to a
    multiple of DOC_BUCKET tokens and batched, one unmasked is_causal call per padded length; a causal query never
    sees the keys after it, so the pads change no real row (their own rows are dropped, so they get no gradient).
    Shorter ones, not causal: the masked block walk over each run of them. Documents never cross rows, so the flat
    [B*S] token axis holds them all; the pieces' rows are put back in token order."""
    B, S, h, D = q_BShD.shape
    hkv = k_BShD.shape[2]
    q, k, v = (t.reshape(B * S, t.shape[2], D) for t in (q_BShD, k_BShD, v_BShD))  # [B*S h D], views
    bounds = cu_seqlens.tolist()  # one host copy per call
    rows, outs = [], []  # token indices (host) and their outputs, piece by piece
    # causal: padded length -> its documents; not causal: the pending run's first and last document (indices)
    short, run = {}, None

    def flush():
        if run is not None:
            first, last = run
            a, b = bounds[first], bounds[last + 1]
            local = torch.tensor([x - a for x in bounds[first:last + 2]], dtype=torch.int32, device=q.device)
            rows.append(torch.arange(a, b))
            outs.append(_blocked(q[None, a:b], k[None, a:b], v[None, a:b], causal, scale, local, None, None,
                                 block)[0])

    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b - a >= block:
            flush()
            run = None
            qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1 h L D]
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale, enable_gqa=h != hkv)
            rows.append(torch.arange(a, b))
            outs.append(out[0].transpose(0, 1))
        elif causal:
            short.setdefault(min(-(-(b - a) // DOC_BUCKET) * DOC_BUCKET, block), []).append((a, b))
        else:
            run = (n, n) if run is None else (run[0], n)
    flush()
    if short:
        pad = B * S  # the index of one zero row appended to q, k, v
        qz, kz, vz = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (q, k, v))
        for P, docs in sorted(short.items()):
            first = torch.tensor([a for a, _ in docs])[:, None]
            length = torch.tensor([b - a for a, b in docs])[:, None]
            real = torch.arange(P)[None] < length  # [n P]
            idx = torch.where(real, first + torch.arange(P)[None], pad)  # [n P]
            dev_idx = idx.to(q.device)
            qb, kb, vb = (t[dev_idx].transpose(1, 2) for t in (qz, kz, vz))  # [n h P D]
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=h != hkv)
            rows.append(idx[real])
            outs.append(out.transpose(1, 2)[real.to(q.device)])  # [n_real h D]
    order = torch.argsort(torch.cat(rows)).to(q.device)  # a permutation of the B*S tokens
    return torch.cat(outs, dim=0)[order].reshape(B, S, h, D)


def _blocked(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, window, sinks, block):
    B, S, h, D = q_BShD.shape
    hkv = k_BShD.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q_BShD, k_BShD, v_BShD))  # [B h S D]
    if sinks is not None:
        q, k, v, sink_key = _sink_operands(q, k, v, sinks, scale)  # head dim padded to Dp, GQA kept
    doc_BS = document_ids(cu_seqlens, B, S) if cu_seqlens is not None else None
    first_key = None
    if doc_BS is not None:
        # earliest key any row's query at index i may see: its document's first token. Nondecreasing in i,
        # so a block's earliest is its first query's; one host copy per call, not one per block
        first_key = (torch.arange(S, device=q.device) - positions_in_documents(cu_seqlens, B, S)).amin(0).tolist()
    outs = []
    for qs in range(0, S, block):
        qe = min(S, qs + block)
        ks, ke = 0, (qe if causal else S)
        if window is not None:
            ks = max(ks, qs - window + 1)
        if first_key is not None:
            ks = max(ks, first_key[qs])
        q_idx = torch.arange(qs, qe, device=q.device)
        k_idx = torch.arange(ks, ke, device=q.device)
        mask = _block_mask(q_idx, k_idx, doc_BS, window, causal)
        qb, kb, vb = q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke]
        if sinks is not None:
            outs.append(_with_sinks(qb, kb, vb, mask, sink_key, scale, h != hkv)[..., :D])
        else:
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                                       enable_gqa=h != hkv))
    return torch.cat(outs, dim=2).transpose(1, 2)
