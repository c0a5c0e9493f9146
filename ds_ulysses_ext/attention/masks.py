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

Everything that depends only on the boundaries (which documents are long, the buckets' gather indices, the order
that puts the pieces' rows back) is a plan built once per batch, not once per layer: every attention layer of a
step, and its recompute, receives the same cu_seqlens object, and _cached keys the plan on that object. The
per-layer work is then device-only (no host copy of the boundaries, which would wait for the GPU at every
layer), and its gathers are index_select, whose backward is an index_add rather than the sort that advanced
indexing's backward (index_put with accumulate) runs.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

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


_PLANS: list = []  # [(weak reference to a cu_seqlens, stamp, its values then, plan)], newest first (_cached)
_PLANS_KEPT = 4  # both kinds of plan (per document, blocked) for this batch and the one before; older ones go
_COMPARE_ON_HOST = ("cpu",)  # devices whose boundaries a hit compares by value and rebuilds on (no device sync)


def _cached(cu_seqlens: torch.Tensor, key: tuple, build):
    """build(), or what it returned before for this very cu_seqlens object and key.

    A hit needs the same live object: the reference is weak, so a freed tensor whose id() a new one reuses
    cannot match (and a plan goes with its batch), and the stamp holds the version counter, which every
    in-place write through torch bumps, so boundaries rewritten in place are not served a stale plan. Shape,
    device and storage are in the stamp too, for set_ and friends. Inference tensors keep no version counter:
    they are never cached.

    Writes that torch does not see (through .data, a numpy view, DLPack, a foreign kernel) leave all of that as
    it was, so a hit also compares the values with a copy taken when the plan was built: on the CPU at once (a
    mismatch builds a new plan); on a GPU as a device-side assertion, which costs no host sync and stops the run
    loudly rather than serve another batch's plan.
    """
    if cu_seqlens.is_inference():
        return build()
    stamp = (cu_seqlens._version, tuple(cu_seqlens.shape), cu_seqlens.device, cu_seqlens.data_ptr(), key)
    for ref, seen, values, plan in _PLANS:
        if ref() is cu_seqlens and seen == stamp:
            same = (values == cu_seqlens).all()
            if cu_seqlens.device.type in _COMPARE_ON_HOST:
                if bool(same):
                    return plan
                break  # rewritten behind torch's back: a new plan replaces this one
            torch._assert_async(same, "masks.py: cu_seqlens was rewritten without torch seeing it (through .data, "
                                      "numpy or a foreign kernel) after its document plan was built; give each "
                                      "batch a new tensor or write it with torch ops")
            return plan
    plan = build()
    alive = [entry for entry in _PLANS
             if entry[0]() is not None and not (entry[0]() is cu_seqlens and entry[1] == stamp)]
    _PLANS[:] = [(weakref.ref(cu_seqlens), stamp, cu_seqlens.detach().clone(), plan)] + alive[:_PLANS_KEPT - 1]
    return plan


class _DocumentPlan(NamedTuple):
    # pieces, in document order: ("long", a, b), one SDPA call over tokens a:b; ("run", a, b, local cu_seqlens,
    # its _block_layout), the masked walk over a run of short documents (not causal)
    pieces: list
    # (P, idx [n*P] int64, pad [n*P 1 1] bool): n short documents padded to P; idx is the token that fills each
    # slot, a pad's slot cycling through its own document's tokens; pad marks the slots that are zeroed
    buckets: list
    # [B*S] int64: the row of the concatenated piece and bucket outputs that holds each token; None when they
    # are already in token order (no buckets)
    order: Optional[torch.Tensor]


def _document_plan(cu_seqlens, B, S, causal, block, device) -> _DocumentPlan:
    """What _per_document needs from the boundaries; its device tensors are on `device`. Built once per batch."""
    bounds = cu_seqlens.tolist()  # the batch's one host copy of the boundaries
    if not bounds or bounds[0] != 0 or bounds[-1] != B * S or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to the batch's {B * S} tokens, got {bounds[:1]}..{bounds[-1:]}")
    pieces = []
    # causal: padded length -> its documents; not causal: the pending run's first and last document (indices)
    short, run = {}, None

    def flush():
        if run is not None and bounds[run[1] + 1] > bounds[run[0]]:  # a run of empty documents has no rows
            first, last = run
            a, b = bounds[first], bounds[last + 1]
            local = torch.tensor([x - a for x in bounds[first:last + 2]], dtype=torch.int32, device=device)
            pieces.append(("run", a, b, local, _block_layout(local, 1, b - a, block)))

    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b - a >= block:
            flush()
            run = None
            pieces.append(("long", a, b))
        elif causal:
            if b > a:  # an empty document has no rows to pad
                short.setdefault(min(-(-(b - a) // DOC_BUCKET) * DOC_BUCKET, block), []).append((a, b))
        else:
            run = (n, n) if run is None else (run[0], n)
    flush()
    tokens = [torch.arange(p[1], p[2]) for p in pieces]  # the token of every output row, -1 for a pad
    buckets = []
    for P, docs in sorted(short.items()):
        first = torch.tensor([a for a, _ in docs])[:, None]
        length = torch.tensor([b - a for a, b in docs])[:, None]
        slot = torch.arange(P)[None]
        # a pad reads a real token of its own document (any row in range would do: the slot is zeroed), spread
        # over the document so that the backward's index_add does not pile every pad onto one row
        idx = (first + slot % length).reshape(-1)  # [n*P]
        pad = (slot >= length).reshape(-1)
        buckets.append((P, idx.to(device), pad[:, None, None].to(device)))
        tokens.append(idx.masked_fill(pad, -1))
    tokens = torch.cat(tokens)
    if torch.equal(tokens, torch.arange(B * S)):
        return _DocumentPlan(pieces, buckets, None)
    real = tokens >= 0
    order = torch.empty(B * S, dtype=torch.long)
    order[tokens[real]] = torch.arange(len(tokens))[real]  # the boundaries partition the tokens: each is set once
    return _DocumentPlan(pieces, buckets, order.to(device))


def _per_document(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, block):
    """Documents of >= `block` tokens: one unmasked SDPA call each. Shorter ones, causal: padded at their END to a
    multiple of DOC_BUCKET tokens and batched, one unmasked is_causal call per padded length; a causal query never
    sees the keys after it, so the pads change no real row (their own rows are dropped, so they get no gradient).
    Shorter ones, not causal: the masked block walk over each run of them. Documents never cross rows, so the flat
    [B*S] token axis holds them all; the pieces' rows are put back in token order."""
    B, S, h, D = q_BShD.shape
    gqa = h != k_BShD.shape[2]
    plan = _cached(cu_seqlens, ("documents", B, S, causal, block, DOC_BUCKET, q_BShD.device),
                   lambda: _document_plan(cu_seqlens, B, S, causal, block, q_BShD.device))
    flat = []

    def flats():
        # [B*S h D] q, k, v, made on first use: when B and S do not merge (at cp 1 the tensors are HF's
        # heads-major ones, transposed) the reshape is a copy, which documents that lie in one row do not need
        if not flat:
            flat.extend(t.reshape(B * S, t.shape[2], D) for t in (q_BShD, k_BShD, v_BShD))
        return flat

    outs = []  # [rows h D] each, in the plan's order
    for piece in plan.pieces:
        a, b = piece[1], piece[2]
        if piece[0] == "long":
            r, s = divmod(a, S)
            if s + b - a <= S:
                qd, kd, vd = (t[r, s:s + b - a].transpose(0, 1)[None] for t in (q_BShD, k_BShD, v_BShD))
            else:  # boundaries that do not start every row (not cu_seqlens_of's): the flat axis still holds it
                qd, kd, vd = (t[a:b].transpose(0, 1)[None] for t in flats())  # [1 h L D]
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale, enable_gqa=gqa)
            outs.append(out[0].transpose(0, 1))
        else:
            q, k, v = flats()
            outs.append(_blocked(q[None, a:b], k[None, a:b], v[None, a:b], causal, scale, piece[3], None, None,
                                 block, layout=piece[4])[0])
    for P, idx, pad in plan.buckets:
        # index_select's backward is an index_add (no sort); zeroing the pad slots in place of gathering from
        # copies of q, k, v with a zero row appended gives the kernel the same zeros (exact forward) and hands
        # the rows the pads read exact zeros (exact gradients); masked_fill, unlike a multiply, zeroes inf too
        qb, kb, vb = (t.index_select(0, idx).masked_fill_(pad, 0).unflatten(0, (-1, P)).transpose(1, 2)
                      for t in flats())  # [n h P D]
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(-1, h, D))  # [n*P h D], pads included: the order skips them
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    if plan.order is not None:
        out = out.index_select(0, plan.order)  # a gather whose backward (index_add) writes each row once
    return out.reshape(B, S, h, D)


def _block_layout(cu_seqlens, B, S, block):
    """[B, S] document ids and, per query block, the earliest key any of its queries may see (a host list)."""
    # the earliest key a query at index i may see is its document's first token; nondecreasing in i, so a
    # block's earliest is its first query's
    first_key = torch.arange(S, device=cu_seqlens.device) - positions_in_documents(cu_seqlens, B, S)
    return document_ids(cu_seqlens, B, S), first_key.amin(0)[::block].tolist()


def _blocked(q_BShD, k_BShD, v_BShD, causal, scale, cu_seqlens, window, sinks, block, layout=None):
    # layout: _block_layout(cu_seqlens, ...) when the caller holds it already (a plan's run of documents)
    B, S, h, D = q_BShD.shape
    hkv = k_BShD.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q_BShD, k_BShD, v_BShD))  # [B h S D]
    if sinks is not None:
        q, k, v, sink_key = _sink_operands(q, k, v, sinks, scale)  # head dim padded to Dp, GQA kept
    doc_BS = first_key = None
    if cu_seqlens is not None:
        if layout is None:  # once per batch, not per layer: its host copy waits for the device
            # built on q's device: the block masks index the document ids with q's indices
            layout = _cached(cu_seqlens, ("blocked", B, S, block, q.device),
                             lambda: _block_layout(cu_seqlens.to(q.device), B, S, block))
        doc_BS, first_key = layout
    outs = []
    for qs in range(0, S, block):
        qe = min(S, qs + block)
        ks, ke = 0, (qe if causal else S)
        if window is not None:
            ks = max(ks, qs - window + 1)
        if first_key is not None:
            ks = max(ks, first_key[qs // block])
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
