"""The only place the library patches transformers: CP attention registration and model guards.

(DeepSpeed's patches are the engine's: engine/ds_patches.py.)

`enable_context_parallel(model, topology)`:
- validates the model family and head counts for this cp (models.py);
- registers one attention function, "ds_ulysses", with transformers' AttentionInterface and switches
  the model to it. The function reads the CP group from a state object attached to each attention
  module, so the topology is passed explicitly and never stored in a module global;
- refuses `generate()` and multimodal inputs under CP, and on the first forward checks that the
  input really is a sequence chunk (global position_ids start at cp_rank * local_len) and that the
  exchanged length equals the global length, then logs once that CP is active.

HF attention layout: query [B, Hq, s, D], key/value [B, Hkv, s, D] (RoPE already applied on the local
chunk with global positions); the function returns ([B, s, Hq, D], None).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .attention import ulysses_attention
from .errors import UnsupportedError
from .models import check_model_config
from .rope import share_global_length
from .topology import Topology

log = logging.getLogger(__name__)

ATTN_NAME = "ds_ulysses"
MULTIMODAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                   "input_features", "audio_values", "image_sizes")


@dataclass
class CPState:
    """What the registered attention function needs, attached to each attention module."""
    topology: Topology
    backend: str = "auto"
    expected_global_len: int = 0  # set by the first-forward check
    verified: bool = field(default=False)


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state: CPState = getattr(module, "_cp_state", None)
    if state is None:
        raise UnsupportedError("the ds_ulysses attention was selected on a model that "
                               "enable_context_parallel() did not prepare; call it on this model")
    if dropout:
        raise UnsupportedError("attention dropout is not supported under context parallelism; set attention_dropout=0")
    q_BsHD, k_BsHD, v_BsHD = (t.transpose(1, 2) for t in (query, key, value))
    # right padding only (shard_batch enforces it), so a causal kernel needs no mask: real tokens never
    # attend to the trailing pads, and HF builds no mask for a custom attention name.
    def core():
        return ulysses_attention(q_BsHD, k_BsHD, v_BsHD, group=state.topology.cp_group, causal=True,
                                 softmax_scale=scaling, backend=state.backend)
    # a memory policy may own how the core runs (memory/except_attention.py keeps it out of recompute)
    wrapper = module.__dict__.get("core_attention_wrapper")
    out = core() if wrapper is None else wrapper(core)
    if not state.verified:
        _verify_once(state, q_BsHD.shape[1])
    return out, None


def _verify_once(state: CPState, local_len: int) -> None:
    exchanged = local_len * state.topology.cp_size
    if state.expected_global_len and exchanged != state.expected_global_len:
        raise RuntimeError(f"context parallelism is not active: attention saw {exchanged} tokens after "
                           f"the exchange, the batch holds {state.expected_global_len}")
    state.verified = True
    if state.topology.rank == 0:
        log.info("context parallel active: cp=%d, local length %d, global length %d after the exchange",
                 state.topology.cp_size, local_len, exchanged)


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, _cp_attention)


def _first_forward_check(state: CPState):
    def hook(module, args, kwargs):
        for key in MULTIMODAL_KEYS:
            if kwargs.get(key) is not None:
                raise UnsupportedError(f"multimodal input {key!r} is not supported under context parallelism; "
                                       "train the text model only or run with parallelism.cp=1")
        if state.verified:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        inputs = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        position_ids = kwargs.get("position_ids")
        cp = state.topology.cp_size
        if position_ids is None:
            raise UnsupportedError("under context parallelism the model needs global position_ids; "
                                   "feed the batch produced by shard_batch()")
        local_len = inputs.shape[1]
        starts, lengths = _gather_chunk_coords(int(position_ids[0, 0]), local_len, state.topology)
        # every rank checks every rank's chunk, so all raise together instead of hanging in an all-to-all
        for r in range(cp):
            if lengths[r] != local_len or starts[r] != r * local_len:
                raise UnsupportedError(
                    f"CP rank {r} got {lengths[r]} tokens with position_ids starting at {starts[r]}, expected "
                    f"{local_len} starting at {r * local_len}: the input is not this rank's sequence chunk. "
                    "Use shard_batch()")
        state.expected_global_len = local_len * cp
        return None
    return hook


def _gather_chunk_coords(start: int, length: int, topology: Topology) -> tuple[list[int], list[int]]:
    coords = torch.tensor([start, length], dtype=torch.long)
    if topology.cp_size == 1:
        return [start], [length]
    gathered = [torch.empty_like(coords) for _ in range(topology.cp_size)]
    # runs once per model; CPU tensors work on gloo, and NCCL needs the device the model is on
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is not None and torch.distributed.get_backend(topology.cp_group) == "nccl":
        coords, gathered = coords.to(device), [g.to(device) for g in gathered]
    torch.distributed.all_gather(gathered, coords, group=topology.cp_group)
    return [int(g[0]) for g in gathered], [int(g[1]) for g in gathered]


def _refuse_generate(*args, **kwargs):
    raise UnsupportedError("generate() is not supported under context parallelism: decoding is "
                           "sequential and the KV cache is not sharded. Generate with a cp=1 copy of the model")


def attention_modules(model) -> list[torch.nn.Module]:
    """Each decoder layer's `self_attn`: the module every registry family's layer hands to the attention interface.

    A layer without one (a recurrent or otherwise unknown mixer) is refused: it would run unsplit on its chunk.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise UnsupportedError(f"{type(model).__name__}'s decoder has no `layers`; context parallelism needs "
                               "the decoder layer list to find the attention modules")
    missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "self_attn", None), torch.nn.Module)]
    if missing:
        raise UnsupportedError(f"decoder layers {missing} of {type(model).__name__} have no `self_attn` attention "
                               "module, so context parallelism cannot split them; run with parallelism.cp=1")
    return [layer.self_attn for layer in layers]


def enable_context_parallel(model, topology: Topology, backend: str = "auto"):
    """Install exact Ulysses attention into a supported HF causal LM. Returns the model."""
    check_model_config(model.config, topology.cp_size)
    _register_attention()
    model.set_attn_implementation(ATTN_NAME)
    state = CPState(topology=topology, backend=backend)
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedError(f"found no attention modules in {type(model).__name__}")
    for m in modules:
        m._cp_state = state
    model._cp_state = state
    share_global_length(model, topology)  # dynamic / longrope RoPE read the length: give them the global one
    # on the decoder, so the check runs whether the caller goes through the LM head or not (lm.py)
    model.get_decoder().register_forward_pre_hook(_first_forward_check(state), with_kwargs=True)
    if topology.cp_size > 1:
        model.generate = _refuse_generate
    return model
