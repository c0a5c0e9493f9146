"""Attention under context parallelism: the Ulysses head exchange, the ring and its block kernels, the local
kernels and their first-use checks, masks for documents, windows and sinks, and the zigzag layout.

Who calls whom (each module imports only those below it):
    ulysses.py       ulysses_attention: seq -> head exchange, local kernel, head -> seq
    ring.py          ring_attention: Ulysses groups times a ring of K|V blocks, merged by log-sum-exp
    ring_varlen.py   the ring's varlen block calls (packed documents, windows); registers itself with ring_blocks
    ring_blocks.py   one block: the fused kernels, the exact torch kernel, the merge
    backends.py      the local kernel for a whole (head-sharded) sequence: SDPA, flash-attn, FA4, masks
    flash_varlen.py  torch's varlen flash kernel for documents, windows and sinks in one call
    masks.py         document / window / sink masks and the exact torch path
    kernel_check.py  first-use checks of a fused kernel against the exact path
    exchange.py      the autograd all-to-alls
    zigzag.py, layout.py   which rank holds which tokens; which cp / ring sizes split the heads
"""
from .ulysses import heads_exchange, ulysses_attention

__all__ = ["ulysses_attention", "heads_exchange"]
