"""shard_batch: turn a full-sequence batch into this CP rank's share of the tokens, exactly.

Legend: B batch, S sequence (padded to Sp: a multiple of cp, of 2 * cp with a ring), s = Sp / cp local sequence.

Order matters for exactness (docs/design.md §1.1):
1. shift the labels on the FULL sequence (target of position i is token i+1), so the first token of
   each chunk is predicted by the previous chunk's last position with no collective;
2. pad to a multiple of cp (2 * cp with a ring): pad tokens get label -100 and continue the position count;
3. split input_ids, the shifted labels and global position_ids into this rank's share: contiguous chunk cp_rank
   for Ulysses, its zigzag positions when topology.ring_size > 1 (zigzag.py). position_ids are always the
   tokens' GLOBAL positions, so RoPE rotates every token as the unsplit model does.
The returned `labels` are already shifted: compute the loss without shifting again (loss.py does).
Right padding only; left padding, multimodal inputs and unknown tensors are refused.

Packed rows (HF's convention, as DataCollatorWithFlattening makes them): position_ids restart at 0 for each
document, and any step that is not +1 starts a new one (the rule HF's own masks use). Then:
- a document's last token gets no target (it would predict the next document's first), before the split;
- `cp_cu_seqlens` [N+1] int32, the documents' boundaries over the whole padded batch (masks.py), is added
  to the shard. It is the same on every CP rank: after the all-to-all each rank attends over the whole
  sequence, so it needs the global boundaries, not its chunk's. Pads continue the last document.
Every key returned except `labels` goes to the model's forward as is. With a ring the boundaries are the same
global ones (the ring's kernel masks by global position), and each rank's position_ids are its zigzag positions
inside their documents.
"""
from __future__ import annotations

import torch

from .attention.layout import chunk_bounds
from .attention.masks import CU_SEQLENS_KEY, cu_seqlens_of, document_starts
from .attention.zigzag import padded_seq_len, rank_positions
from .errors import UnsupportedError
from .integrate import MULTIMODAL_KEYS
from .rope import ROPE_LENGTH_KEY
from .topology import Topology

IGNORE_INDEX = -100
KNOWN_KEYS = {"input_ids", "labels", "attention_mask", "position_ids"}


def shift_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """[B S] unshifted -> [B S] targets: out[:, i] = labels[:, i+1], last position -100."""
    pad = torch.full_like(labels_BS[:, :1], IGNORE_INDEX)
    return torch.cat([labels_BS[:, 1:], pad], dim=1)


def _check_inputs(batch: dict) -> None:
    for key in batch:
        if key in MULTIMODAL_KEYS or key.startswith(("pixel_", "image_", "video_", "audio_")):
            raise UnsupportedError(f"multimodal input {key!r} is not supported under context parallelism; "
                                   "train on text only or run with parallelism.cp=1")
    unknown = set(batch) - KNOWN_KEYS
    if unknown:
        raise UnsupportedError(f"shard_batch does not know how to split {sorted(unknown)}; "
                               f"it handles {sorted(KNOWN_KEYS)}")
    pos = batch.get("position_ids")
    if pos is not None and pos.shape[-1] != batch["input_ids"].shape[1]:
        raise UnsupportedError(f"position_ids has {pos.shape[-1]} positions for {batch['input_ids'].shape[1]} "
                               "tokens; give one position per token")
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise UnsupportedError("left padding detected (a pad before a real token) in attention_mask; context "
                               "parallelism needs right padding (tokenizer.padding_side='right', data.padding_side=right)")


def _local(t_BSp: torch.Tensor, topology: Topology) -> torch.Tensor:
    # this rank's share of a padded [B, Sp] tensor: the contiguous chunk cp_rank (Ulysses' layout), or with a
    # ring its zigzag positions
    if topology.ring_size > 1:
        idx = rank_positions(t_BSp.shape[1], topology.cp_size, topology.ring_size, topology.cp_rank, t_BSp.device)
        return t_BSp[:, idx].contiguous()
    start, end = chunk_bounds(t_BSp.shape[1], topology.cp_size, topology.cp_rank)
    return t_BSp[:, start:end].contiguous()


def shard_batch(batch: dict, topology: Topology, pad_token_id: int = 0) -> dict:
    """Pad, pre-shift labels and return this rank's chunk of input_ids, labels and position_ids.

    Args:
        batch: input_ids [B, S]; labels [B, S] unshifted (HF convention, -100 = no loss), optional
            attention_mask [B, S] (right padding only), optional position_ids [B, S] (restarting at 0 for
            each document of a packed row).
        topology: gives cp_size, cp_rank and ring_size (the layout).
    Returns:
        {"input_ids": [B, s], "labels": [B, s] (shifted), "position_ids": [B, s]}, plus
        "cp_cu_seqlens": [N+1] int32 (global document boundaries) when a row holds several documents, and at cp > 1
        "cp_rope_length": [1] int64, the batch's length before the cp pads (the one a dynamic/longrope RoPE reads).
    """
    _check_inputs(batch)
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    labels = batch.get("labels", input_ids)
    targets = shift_labels(labels)
    if batch.get("attention_mask") is not None:
        # a pad position's target is the next (pad) token: never a loss
        targets = targets.masked_fill(shift_labels(batch["attention_mask"]) == 0, IGNORE_INDEX)
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        position_ids = position_ids.expand(B, S)
        starts = document_starts(position_ids)
        # the last token of a document predicts nothing: the next token opens another document
        targets = targets.masked_fill(torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], 1), IGNORE_INDEX)
    # the length a length-dependent RoPE reads in the unsplit model, before the cp pads below (rope.py)
    rope_length = (position_ids.max() + 1 if position_ids is not None else torch.tensor(S)).reshape(1).long()
    Sp = padded_seq_len(S, topology.cp_size, topology.ring_size)
    if Sp != S:
        extra = Sp - S
        input_ids = torch.cat([input_ids, input_ids.new_full((B, extra), pad_token_id)], dim=1)
        targets = torch.cat([targets, targets.new_full((B, extra), IGNORE_INDEX)], dim=1)
        if position_ids is not None:
            tail = position_ids[:, -1:] + torch.arange(1, extra + 1, device=position_ids.device)
            position_ids = torch.cat([position_ids, tail], dim=1)
    if position_ids is None:
        position_ids = torch.arange(Sp, device=input_ids.device).unsqueeze(0).expand(B, Sp)
    shard = {"input_ids": _local(input_ids, topology), "labels": _local(targets, topology),
             "position_ids": _local(position_ids, topology)}
    if bool(document_starts(position_ids)[:, 1:].any()):
        shard[CU_SEQLENS_KEY] = cu_seqlens_of(position_ids)
    if topology.cp_size > 1:
        shard[ROPE_LENGTH_KEY] = rope_length.to(input_ids.device)
    return shard
