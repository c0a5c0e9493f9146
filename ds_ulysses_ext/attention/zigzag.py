"""Zigzag: which global token positions each CP rank holds when a ring runs (causal load balancing). No groups.

Legend: S global sequence (padded to Sp, a multiple of 2 * cp), R ring size, u = cp / R Ulysses group size,
c = Sp / (2R) tokens per zigzag chunk, s = Sp / cp tokens per CP rank.

Under a causal mask a ring rank holding one contiguous chunk would do work proportional to its index (the last
chunk sees everything, the first only itself). Cutting the sequence into 2R chunks and giving ring rank r the
chunks r and 2R-1-r gives every ring rank the same work:

    R = 2:  chunks 0 1 2 3  ->  ring rank 0 holds [0, 3], ring rank 1 holds [1, 2]

Inside a ring rank's share (its two chunks, in that order: increasing global positions), the u ranks of its
Ulysses group hold contiguous pieces in Ulysses-rank order, so the Ulysses all-to-all reassembles exactly the
share [chunk r, chunk 2R-1-r] (comm.seq_to_head concatenates in rank order). CP rank c = r * u + j therefore
holds slice c of the permuted order below: one index tensor describes every layout, and with R = 1 it is the
identity (Ulysses' contiguous chunks).
"""
from __future__ import annotations

import torch

from .layout import padded_length, valid_cp_values


def layout_multiple(cp: int, ring: int) -> int:
    """The length every row is padded to a multiple of: cp for Ulysses, 2 * cp with a ring (2R chunks of u pieces)."""
    return cp if ring == 1 else 2 * cp


def padded_seq_len(seq_len: int, cp: int, ring: int) -> int:
    return padded_length(seq_len, layout_multiple(cp, ring))


def zigzag_order(seq_len: int, cp: int, ring: int, device=None) -> torch.Tensor:
    """[Sp] global positions in layout order: CP rank c holds entries [c * s, (c + 1) * s). Sp must be padded."""
    if seq_len % layout_multiple(cp, ring):
        raise ValueError(f"sequence length {seq_len} is not a multiple of {layout_multiple(cp, ring)} "
                         f"(cp={cp}, ring={ring}); pad it first")
    pos = torch.arange(seq_len, device=device)
    if ring == 1:
        return pos
    chunks = pos.reshape(2 * ring, seq_len // (2 * ring))
    return torch.cat([torch.cat([chunks[r], chunks[2 * ring - 1 - r]]) for r in range(ring)])


def rank_positions(seq_len: int, cp: int, ring: int, cp_rank: int, device=None) -> torch.Tensor:
    """[s] the global positions CP rank cp_rank holds, in its local order."""
    s = seq_len // cp
    return zigzag_order(seq_len, cp, ring, device)[cp_rank * s:(cp_rank + 1) * s]


def valid_ring_sizes(num_q_heads: int, num_kv_heads: int, cp: int) -> list[int]:
    """Ring sizes that divide cp and leave a Ulysses group u = cp / ring that splits the heads (layout.py's rule)."""
    splits = valid_cp_values(num_q_heads, num_kv_heads)
    return [ring for ring in range(1, cp + 1) if cp % ring == 0 and cp // ring in splits]


def auto_ring_size(num_q_heads: int, num_kv_heads: int, cp: int) -> tuple[int, str]:
    """(ring, why): 1 when the heads split over cp (pure Ulysses), else the smallest ring that makes them split.

    The smallest ring keeps the largest Ulysses group: all-to-all inside consecutive (node-local) ranks, and the
    fewest ring hops. Always found: ring = cp (u = 1) splits any head count.
    """
    ring = valid_ring_sizes(num_q_heads, num_kv_heads, cp)[0]
    if ring == 1:
        return 1, f"the {num_q_heads} query / {num_kv_heads} KV heads split over cp={cp}: Ulysses all-to-all only"
    u = cp // ring
    return ring, (f"the {num_q_heads} query / {num_kv_heads} KV heads do not split over cp={cp}; Ulysses groups of "
                  f"{u} (the largest that splits them) x a ring of {ring}" + (" (pure ring)" if u == 1 else " (hybrid)"))
