"""Tiled MLP: each decoder layer's MLP runs over tiles of tokens, each tile under its own checkpoint.

Legend: B batch, s local sequence, H hidden, I intermediate, T = B * s local tokens, t tokens in a tile.

    x [B s H] -> [T H] -> tiles [t_k H] --mlp under checkpoint--> [t_k H] -> cat [T H] -> [B s H]

Forward keeps only each tile's input (a view of x, no copy); backward rebuilds one tile's
[t, I] gate/up/act tensors at a time, so the [T, I] intermediates never exist whole (as in the TiledMLP of
Arctic Long Sequence Training, ALST). The MLP is per token, so tiling is
exact up to float summation order in the weight gradients.

ZeRO-3. (1) Gradients: every tile's recompute and backward run inside the one backward pass of the
graph (non-reentrant checkpoint), so all tiles' weight gradients flow into the same AccumulateGrad node
of each weight, which fires once, after the last tile: ZeRO-3's gradient hook sees one gradient per
weight per backward (tests/test_memory.py counts it). DeepSpeed's own TiledMLP runs a nested backward
per tile and needs its `ds_grad_is_ready` flag for this; we do not. (2) Collectives: each tile calls
the projections, and each call may gather their partitioned weights, a collective over all ranks, so
every rank must run the same number of tiles or the gathers deadlock. The count comes from the local
token count, which CP makes equal on the ranks of a CP group (shard_batch pads to a multiple of cp), but
not necessarily across DP ranks fed batches of different lengths. So once per decoder forward (a
forward pre-hook) the largest tile count is agreed with one all-reduce(MAX) over all ranks, and each
rank splits its tokens into exactly that many near-equal tiles (each at most tile_tokens long, or up to 15 tokens
over where the boundaries are moved onto multiples of 16: tile_sizes). The cost
is one scalar all-reduce per forward; asserting equality instead would cost the same collective.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .policy import MemoryPolicy, decoder_layers, decoder_of

log = logging.getLogger(__name__)


def num_tiles(num_tokens: int, tile_tokens: int) -> int:
    return max(1, math.ceil(num_tokens / tile_tokens))


# tile boundaries fall on multiples of this many tokens where the count allows: an FP8 linear's weight-gradient GEMM
# reduces over its tile's tokens, and torch._scaled_mm takes that length in multiples of 16 only (configs/precision.py
# refuses rows that break it). A bf16 tile loses nothing by it: the MLP is per token
TILE_ALIGN = 16


def tile_sizes(num_tokens: int, tiles: int) -> list:
    """`tiles` near-equal sizes summing to num_tokens, each a multiple of TILE_ALIGN where num_tokens allows it (the
    count stays `tiles` either way: the ranks agreed on it)."""
    unit = TILE_ALIGN if num_tokens % TILE_ALIGN == 0 and num_tokens // TILE_ALIGN >= tiles else 1
    units = num_tokens // unit
    return [unit * (units // tiles + (k < units % tiles)) for k in range(tiles)]


def tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x_BsH: torch.Tensor, tiles: int) -> torch.Tensor:
    """fn over `tiles` near-equal token tiles of x (tile_sizes), each under a checkpoint when grad is on."""
    shape = x_BsH.shape
    x_TH = x_BsH.reshape(-1, shape[-1])  # expects [B s H] (or any [..., H]) -> [T H]
    outs = []
    for tile_tH in torch.split(x_TH, tile_sizes(x_TH.shape[0], tiles), dim=0):
        if torch.is_grad_enabled():
            outs.append(checkpoint(fn, tile_tH, use_reentrant=False))
        else:
            outs.append(fn(tile_tH))
    out_TH = torch.cat(outs, dim=0)
    return out_TH.reshape(*shape[:-1], out_TH.shape[-1])  # returns [B s H]


class TiledMLP(MemoryPolicy):
    """Run every decoder layer's MLP over tiles of at most tile_tokens tokens."""

    name = "tiled_mlp"

    def __init__(self, tile_tokens: int = 8192) -> None:
        super().__init__()
        if tile_tokens < 1:
            raise ValueError(f"mlp_tile_tokens must be >= 1, got {tile_tokens} (memory.mlp_tile_tokens)")
        self.tile_tokens = tile_tokens
        self.agreed_tiles = 0  # this forward's tile count, agreed over all ranks by the decoder pre-hook

    def _apply(self, model: torch.nn.Module) -> None:
        decoder = decoder_of(model)
        self._hook(decoder.register_forward_pre_hook(self._agree_on_tiles, with_kwargs=True))
        from ..moe.layer import MoEBlock
        skipped = 0
        for layer in decoder_layers(model):
            if isinstance(layer.mlp, MoEBlock):
                # an MoE block routes and balances per sequence ([B, s] statistics): token tiles would split that,
                # and moe.recompute=experts already bounds what its experts keep
                skipped += 1
                continue
            self._wrap_forward(layer.mlp, self._tiled)
        if skipped:
            log.info("tiled MLP: %d MoE layers are not tiled (moe.recompute=experts bounds their memory)", skipped)

    def _tiled(self, forward: Callable) -> Callable:
        def wrapper(x):
            local = num_tiles(x.numel() // x.shape[-1], self.tile_tokens)
            # outside a decoder forward (a direct MLP call) there is no agreed count: use the local one
            return tiled_apply(forward, x, max(local, self.agreed_tiles))
        return wrapper

    def _agree_on_tiles(self, module, args, kwargs):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs["inputs_embeds"]
        num_tokens = inputs.shape[0] * inputs.shape[1]  # [B s] ids or [B s H] embeddings
        tiles = num_tiles(num_tokens, self.tile_tokens)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # a tensor on the input's device: CUDA under NCCL, CPU under gloo
            count = torch.tensor([tiles], dtype=torch.int64, device=inputs.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            tiles = int(count.item())
        self.agreed_tiles = tiles
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tile_tokens={self.tile_tokens})"
