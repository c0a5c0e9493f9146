"""Packed documents for the recurrent layers: each document as a row of its own, so its conv and state start at zero.

Legend: B batch rows, S sequence (whole, after the Ulysses exchange), X features of a token (any trailing shape),
N documents, L a bucket's padded row length (a multiple of `multiple`), m documents in one bucket.

A linear-attention layer carries a short conv window and a recurrent state from token to token. In a packed row
those must start again at every document (the unsplit reference is each document run alone: HF's torch path does
not reset them, so its own packed row mixes documents). Laying every document out as its own row gives exactly
that, for any conv and any recurrence, with no kernel of its own: documents are padded at their END to a multiple
of `multiple` tokens (the delta rule's chunk), those of equal padded length batched as rows of one call, and the
outputs gathered back into token order. Pads come after every real token of their row, so a causal conv and a
causal recurrence never let them reach a real one.

The boundaries are the same global `cp_cu_seqlens` [N+1] every attention layer gets (attention/masks.py), over the
flat B * S tokens; the plan (one host copy of them) is built once per batch and served to every layer and to the
recompute (masks.py's cache). Gathers are index_select, whose backward is an index_add.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..attention.masks import _cached  # the per-batch plan cache the attention's document plans use


class DocumentRows(NamedTuple):
    lengths: list  # each bucket's padded row length L, in the order its rows sit in idx
    sizes: list  # each bucket's m * L slots
    idx: torch.Tensor  # [sum of sizes] int64 into the flat tokens: every bucket's rows, pads reading their doc's tokens
    pad: torch.Tensor  # [sum of sizes] bool: the pad slots
    order: torch.Tensor  # [B*S] int64: where each token's output sits in the concatenated bucket outputs


def _plan(cu_seqlens: torch.Tensor, total: int, multiple: int, device) -> DocumentRows:
    bounds = cu_seqlens.tolist()  # the batch's one host copy of its boundaries
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to the batch's {total} tokens, got {bounds[:1]}..{bounds[-1:]}")
    by_length: dict = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:  # an empty document has no row
            by_length.setdefault(-(-(b - a) // multiple) * multiple, []).append((a, b))
    lengths, idxs, pads, tokens = [], [], [], []
    for L, docs in sorted(by_length.items()):
        first = torch.tensor([a for a, _ in docs])[:, None]
        length = torch.tensor([b - a for a, b in docs])[:, None]
        slot = torch.arange(L)[None]
        # a pad reads some real token of its own document (its value is then zeroed): spread over the document, so
        # the backward's index_add does not pile every pad onto one row
        idx = (first + slot % length).reshape(-1)
        pad = (slot >= length).reshape(-1)
        lengths.append(L)
        idxs.append(idx)
        pads.append(pad)
        tokens.append(idx.masked_fill(pad, -1))
    tokens = torch.cat(tokens)
    real = tokens >= 0
    order = torch.empty(total, dtype=torch.long)
    order[tokens[real]] = torch.arange(len(tokens))[real]  # the documents partition the tokens: each set once
    return DocumentRows(lengths, [len(i) for i in idxs], torch.cat(idxs).to(device), torch.cat(pads).to(device),
                        order.to(device))


def per_document(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 multiple: int) -> torch.Tensor:
    """fn(*rows) on every document alone, as rows [m, L, ...]; returns fn's output for the tokens, [B, S, ...].

    tensors: [B, S, ...] each (the same B and S). fn maps rows [m, L, ...] to [m, L, ...] causally. Without
    cu_seqlens the batch's rows go to fn as they are (one document per row)."""
    if cu_seqlens is None:
        return fn(*tensors)
    B, S = tensors[0].shape[:2]
    plan = _cached(cu_seqlens, ("linear_rows", B * S, multiple, tensors[0].device),
                   lambda: _plan(cu_seqlens, B * S, multiple, tensors[0].device))
    # one gather for every bucket, then split: a gather per bucket would give each its own index_add into a zero
    # tensor of all B*S tokens in backward (as many whole-tensor writes as buckets, up to S / multiple of them);
    # split's backward joins the buckets' gradients once. Pads are zeroed, not gathered from a zero row: the forward
    # sees zeros and the tokens they read get exact zero gradients (masked_fill zeroes an inf too)
    per_bucket = []
    for t in tensors:
        r = t.reshape(B * S, *t.shape[2:]).index_select(0, plan.idx)
        per_bucket.append(r.masked_fill(plan.pad.view(-1, *([1] * (r.dim() - 1))), 0).split(plan.sizes))
    outs = []
    for L, rows in zip(plan.lengths, zip(*per_bucket)):
        out = fn(*(r.unflatten(0, (-1, L)) for r in rows))
        outs.append(out.reshape(-1, *out.shape[2:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, plan.order).reshape(B, S, *out.shape[1:])
