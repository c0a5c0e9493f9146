"""RoPE under context parallelism: which HF rope types CP runs exactly, and the global length two of them need.

Legend: B batch, s local sequence, D head dim.

transformers 5.22 (modeling_rope_utils) defines seven rope types. Five compute their inverse frequencies once,
from the config: a chunk rotated at its global position_ids is rotated exactly as the unsplit model rotates
those positions. `dynamic` (NTK) and `longrope` recompute them in forward from `max(position_ids) + 1` of the
tensor they are handed (dynamic grows its base past max_position_embeddings; longrope switches from its short
to its long factors past original_max_position_embeddings). Under CP that tensor is one rank's chunk, so each
rank would rotate with frequencies of its own, none equal to the unsplit model's. `share_global_length` hands
the rotary module the batch's length from before the split, so every rank updates its frequencies as the unsplit
model does on the same batch. That length is `max(position_ids) + 1` of the batch as the caller gave it, before
the pads shard_batch adds to reach a multiple of cp (2 cp with a ring): shard_batch passes it to the model as
ROPE_LENGTH_KEY, and the pads' own positions past it are capped for the rotary (they come after every real token,
so no real token attends to them and their rotation changes nothing). Without the key the global length would
count the pads, so the rotary refuses to run.

Any other rope type (a user's entry in ROPE_INIT_FUNCTIONS, HF's `axial` label) is refused under cp > 1:
whether it depends on the length is not known here.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from .errors import UnsupportedError

STATIC_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")
CP_ROPE_TYPES = STATIC_TYPES + LENGTH_DEPENDENT_TYPES
# shard_batch's key (and the decoder kwarg) carrying the batch's unpadded length, int64 [1]; integrate.py hands
# it to the rotary modules share_global_length wraps, and the attention drops it
ROPE_LENGTH_KEY = "cp_rope_length"


def rope_parameters_of(config) -> Optional[Mapping[str, Any]]:
    """The RoPE dict of an HF config: `rope_parameters` (transformers 5), or `rope_scaling` (older configs)."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


def rope_types(rope_parameters: Optional[Mapping[str, Any]]) -> list[str]:
    """The rope types a RoPE dict selects: one, or one per layer type when the dict is nested by layer type."""
    if not rope_parameters:
        return ["default"]
    nested = [v for v in rope_parameters.values() if isinstance(v, Mapping)]
    dicts = nested or [rope_parameters]
    # `type` is the pre-transformers-5 spelling of `rope_type`; HF reads it the same way
    return [d.get("rope_type", d.get("type", "default")) for d in dicts]


def unchecked_rope_types(rope_parameters: Optional[Mapping[str, Any]]) -> list[str]:
    return [t for t in rope_types(rope_parameters) if t not in CP_ROPE_TYPES]


def depends_on_length(rope_parameters: Optional[Mapping[str, Any]]) -> bool:
    return any(t in LENGTH_DEPENDENT_TYPES for t in rope_types(rope_parameters))


def check_rope(config, cp: int) -> None:
    """Refuse a rope type whose behaviour under a sequence split is not known."""
    unknown = unchecked_rope_types(rope_parameters_of(config))
    if cp > 1 and unknown:
        raise UnsupportedError(
            f"rope_type {unknown[0]!r} is not one of the RoPE types checked under context parallelism "
            f"{list(CP_ROPE_TYPES)}; a type that reads the sequence length would see only this rank's chunk. "
            "Set rope_parameters (or rope_scaling) to one of those types, or run with parallelism.cp=1")


def share_global_length(model: torch.nn.Module, topology, state) -> int:
    """Make every rotary module of a length-dependent RoPE see the batch's unpadded length, read each forward from
    `state.rope_length` (integrate.py sets it from ROPE_LENGTH_KEY). Returns how many it patched."""
    if not topology.cp_enabled or not depends_on_length(rope_parameters_of(model.config)):
        return 0
    rotaries = [m for m in model.modules() if hasattr(m, "rope_type")]
    types = rope_types(rope_parameters_of(model.config))
    if not rotaries:
        raise UnsupportedError(f"{type(model).__name__} uses a length-dependent RoPE ({types}) but no rotary module "
                               "(one with `rope_type`) was found to give the global length; run with parallelism.cp=1")
    for m in rotaries:
        m.forward = _at_batch_length(m.forward, state, types)
    return len(rotaries)


def _at_batch_length(forward: Callable, state, types: list) -> Callable:
    def wrapper(x, position_ids, *args, **kwargs):
        if position_ids.dim() != 2:
            raise UnsupportedError(f"position_ids of shape {tuple(position_ids.shape)}: the global-length RoPE "
                                   "under context parallelism takes [B, s] position_ids")
        length = state.rope_length
        if length is None:
            raise UnsupportedError(
                f"a length-dependent RoPE ({types}) under context parallelism needs the batch's length before the cp "
                f"padding: pass every key shard_batch() returns to the model ({ROPE_LENGTH_KEY!r} among them), or run "
                "with parallelism.cp=1")
        last = (length.reshape(1) - 1).to(position_ids)
        # HF reads the length as max(position_ids) + 1. The cp pads' positions run past the batch: capped at its last
        # position, and one extra column there, that max is the batch's length on every rank; cos/sin are per
        # position, so the real columns come out as they would alone
        probe_B1 = last.expand(position_ids.shape[0], 1)
        cos_BsD, sin_BsD = forward(x, torch.cat([torch.minimum(position_ids, last), probe_B1], dim=1), *args, **kwargs)
        return cos_BsD[:, :-1], sin_BsD[:, :-1]
    return wrapper
