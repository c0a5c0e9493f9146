"""The only place the library patches transformers: CP attention registration and model guards.

(DeepSpeed's patches are the engine's: engine/ds/patches.py.)

`enable_context_parallel(model, topology)`:
- validates the model family and head counts for this cp (models.py);
- registers one attention function, "ds_ulysses", with transformers' AttentionInterface and switches
  the model to it. The function reads the CP group from a state object attached to each attention
  module, so the topology is passed explicitly and never stored in a module global;
- freezes a vision-language family's vision tower (models.py `vision`: its language model trains on text);
- refuses `generate()` and multimodal inputs under CP, and on every forward checks that every row of the
  input really is this rank's sequence chunk (its position_ids are those of chunk cp_rank: global positions,
  or with packed documents the in-document positions the global boundaries give) with one small all_gather
  of per-row coordinates, and that the exchanged length equals the global length; logs once that CP is active;
- refuses attention masks and kwargs the CP attention would ignore (a mask that is not plain causal, a
  left-padded 2D mask, HF's flash varlen kwargs, anything unknown);
- with topology.ring_size > 1 runs ring / hybrid attention (ring.py) on the zigzag layout (zigzag.py), whose
  positions the row check expects (packed rows too); documents, windows and sinks go to it as to Ulysses.
- binds the Ulysses forward of a family's linear-attention layers (Qwen3.5 / Qwen3-Next gated DeltaNet, Ling-3.0
  KDA) on each of those modules (linear_attention/bind.py; no HF class is patched), and refuses a ring for them.

HF attention layout: query [B, Hq, s, D], key/value [B, Hkv, s, D] (RoPE already applied on the local
chunk with global positions); the function returns ([B, s, Hq, D], None).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention.masks import CU_SEQLENS_KEY, positions_in_documents
from .attention.ring import ring_attention
from .attention.ulysses import ulysses_attention
from .attention.zigzag import rank_positions
from .errors import UnsupportedError
from .length_check import verify_length
from .linear_attention import bind_linear_attention, linear_mixers, refuse_ring
from .models import SUPPORTED, check_model_config, text_config_of
from .rope import ROPE_LENGTH_KEY, check_rope, share_global_length
from .topology import Topology

log = logging.getLogger(__name__)

ATTN_NAME = "ds_ulysses"
MULTIMODAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                   "input_features", "audio_values", "image_sizes",
                   # what Qwen3-VL's model hands its language model for images (deepstack): refused there too
                   "visual_pos_masks", "deepstack_visual_embeds")


@dataclass
class CPState:
    """What the registered attention function needs, attached to each attention module."""
    topology: Topology
    backend: str = "auto"
    # set by the input check of each forward, checked and cleared by its first attention call: recomputes in
    # backward re-run layers of earlier forwards, which no longer match the newest forward's length
    expected_global_len: int = 0
    max_seqlen: Optional[int] = None  # the longest packed document of this forward (varlen kernels need it)
    rope_length: Optional[torch.Tensor] = None  # this forward's batch length before the cp pads (rope.py)
    logged: bool = field(default=False)


# kwargs HF's attention modules hand every attention function that the CP path may ignore: RoPE is applied
# before the call (position_ids), CP runs no KV cache (use_cache; generate() is refused), and the router
# switch belongs to the MoE layer (output_router_logits). Anything else would be dropped, so it is refused.
_IGNORABLE_KWARGS = frozenset({"position_ids", "use_cache", "output_router_logits"})


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  s_aux=None, **kwargs):
    state: CPState = getattr(module, "_cp_state", None)
    if state is None:
        raise UnsupportedError("the ds_ulysses attention was selected on a model that "
                               "enable_context_parallel() did not prepare; call it on this model")
    if dropout:
        raise UnsupportedError("attention dropout is not supported under context parallelism; set attention_dropout=0")
    cu_seqlens = kwargs.pop(CU_SEQLENS_KEY, None)
    kwargs.pop(ROPE_LENGTH_KEY, None)  # the rotary's (rope.py), read by the decoder's input check
    unknown = sorted(set(kwargs) - _IGNORABLE_KWARGS)
    if unknown:
        raise UnsupportedError(
            f"the context-parallel attention was handed {unknown}, which it would ignore. Packed documents are "
            "given as position_ids restarting at 0 for each document: pass the dict shard_batch() returns to the "
            "model as is (it adds the global document boundaries), or run with parallelism.cp=1")
    if attention_mask is not None and not _is_plain_causal(attention_mask, query.shape[2]):
        raise UnsupportedError(
            f"the context-parallel attention got an attention mask ({tuple(attention_mask.shape)}) that is not "
            "plain causal; it runs causal attention over the whole sequence and would ignore it. Give no mask "
            "(right padding needs none; packed documents go as position_ids restarting at 0 through "
            "shard_batch()), or run with parallelism.cp=1")
    q_BsHD, k_BsHD, v_BsHD = (t.transpose(1, 2) for t in (query, key, value))
    # right padding only (shard_batch enforces it), so a causal kernel needs no mask: real tokens never
    # attend to the trailing pads, and HF builds no mask for a custom attention name.
    topo = state.topology

    def core():
        if topo.ring_size > 1:
            return ring_attention(q_BsHD, k_BsHD, v_BsHD, ring_group=topo.ring_group, ulysses_group=topo.ulysses_group,
                                  causal=True, softmax_scale=scaling, backend=state.backend, cu_seqlens=cu_seqlens,
                                  window=sliding_window, sinks=s_aux)
        return ulysses_attention(q_BsHD, k_BsHD, v_BsHD, group=topo.cp_group, causal=True,
                                 softmax_scale=scaling, backend=state.backend, cu_seqlens=cu_seqlens,
                                 max_seqlen=state.max_seqlen, window=sliding_window, sinks=s_aux)
    # a memory policy may own how the core runs (memory/except_attention.py keeps it out of recompute)
    wrapper = module.__dict__.get("core_attention_wrapper")
    out = core() if wrapper is None else wrapper(core)
    verify_length(state, q_BsHD.shape[1])
    return out, None


def _is_plain_causal(mask: torch.Tensor, s: int) -> bool:
    """A [.., s, s] mask that keeps exactly k <= q (bool True / additive 0) and removes the rest."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, s):
        return False
    keep = mask if mask.dtype == torch.bool else mask == 0
    tril = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype != torch.bool and not bool((mask.masked_select(~keep) <= torch.finfo(mask.dtype).min / 2).all()):
        return False  # an additive bias that only dampens would change the softmax
    return bool((keep == tril).all())


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, _cp_attention)


# what each rank tells the others about its input, every forward (one all_gather of these int64s)
_COORDS = ("local_len", "rows", "bad_row", "bad_row_start", "num_bounds", "bound_total", "max_doc",
           "mask_has_pad", "mask_has_real", "mask_has_hole")


def _local_coords(position_ids: torch.Tensor, local_len: int, rows: int, cu_seqlens, mask2d, state) -> torch.Tensor:
    """This rank's input, checked row by row against the chunk it must hold; all on the input's device."""
    cp, r = state.topology.cp_size, state.topology.cp_rank
    pos = position_ids.expand(rows, local_len)
    dev = pos.device
    if cu_seqlens is None:
        # global positions of this rank's share: contiguous chunk r, or its zigzag positions with a ring (a share
        # that is no zigzag share at all is reported as a bad row, on every rank, instead of raising on this one)
        ring = state.topology.ring_size
        expected = (rank_positions(local_len * cp, cp, ring, r, dev) if ring == 1 or local_len % 2 == 0
                    else torch.full_like(pos, -1))
        bounds = torch.tensor([-1, -1, 0], device=dev)
    else:
        cu = cu_seqlens.to(dev).long()
        total = rows * local_len * cp
        sane = cu.numel() >= 2 and int(cu.numel()) <= total + 1
        if not sane:  # a malformed cu_seqlens cannot be expanded below; report it through the bound count
            expected = torch.full_like(pos, -1)
        else:
            full = positions_in_documents(cu.clamp(0, total), rows, local_len * cp)
            ring = state.topology.ring_size
            if ring == 1:
                expected = full[:, r * local_len:(r + 1) * local_len]
            elif local_len % 2 == 0:  # this rank's zigzag positions, as shard_batch laid them out
                expected = full[:, rank_positions(local_len * cp, cp, ring, r, dev)]
            else:
                expected = torch.full_like(pos, -1)
        bounds = torch.stack([cu.new_tensor(cu.numel()), cu[-1], (cu[1:] - cu[:-1]).max()])
    bad = (pos != expected).any(dim=1)
    bad_row = torch.where(bad.any(), bad.int().argmax(), torch.tensor(-1, device=dev))
    bad_start = pos[bad_row.clamp_min(0), 0]
    if mask2d is None:
        flags = torch.zeros(3, dtype=torch.long, device=dev)
    else:
        real = mask2d != 0
        hole = (real[:, 1:] & ~real[:, :-1]).any()  # a real token after a pad inside this chunk
        flags = torch.stack([(~real).any(), real.any(), hole]).long()
    return torch.cat([torch.tensor([local_len, rows], device=dev), bad_row.view(1).long(), bad_start.view(1).long(),
                      bounds.long(), flags.to(dev)])


def _check_every_row(state: CPState, position_ids, local_len, rows, cu_seqlens, mask2d) -> None:
    """Every rank checks every rank's rows, so all raise together instead of hanging in an all-to-all."""
    cp = state.topology.cp_size
    coords = _gather_coords(_local_coords(position_ids, local_len, rows, cu_seqlens, mask2d, state), state.topology)
    c = [dict(zip(_COORDS, rank_coords)) for rank_coords in coords]
    for key, what in (("local_len", "tokens"), ("rows", "rows"), ("num_bounds", "document boundaries"),
                      ("bound_total", "tokens in its document boundaries")):
        if len({ci[key] for ci in c}) > 1:
            raise UnsupportedError(f"the CP ranks got different numbers of {what} ({[ci[key] for ci in c]}): the "
                                   "input is not one batch split by shard_batch(). Use shard_batch()")
    if cu_seqlens is not None and c[0]["bound_total"] != rows * local_len * cp:
        raise UnsupportedError(f"{CU_SEQLENS_KEY} covers {c[0]['bound_total']} tokens, the batch holds "
                               f"{rows * local_len * cp} ({rows} rows of {local_len * cp}): it is not this batch's. "
                               "Use shard_batch()")
    for r, ci in enumerate(c):
        if ci["bad_row"] >= 0:
            where = (f"document positions from {CU_SEQLENS_KEY}" if cu_seqlens is not None
                     else f"positions {r * local_len}..{(r + 1) * local_len - 1}" if state.topology.ring_size == 1
                     else f"zigzag positions (ring={state.topology.ring_size})")
            raise UnsupportedError(
                f"CP rank {r} row {ci['bad_row']} has position_ids starting at {ci['bad_row_start']}, not the "
                f"{where} of chunk {r} ({local_len} tokens each): the input is not this rank's sequence "
                "chunk. Use shard_batch()")
    has_pad = [ci["mask_has_pad"] for ci in c]
    if state.topology.ring_size > 1 and any(has_pad):
        # zigzag rank order is not sequence order, so whether the pads trail cannot be read off per-rank flags
        raise UnsupportedError("a 2D attention_mask with pads is not accepted under ring attention "
                               f"(parallelism.ring={state.topology.ring_size}); pass the dict shard_batch() returns "
                               "as is (its labels already mask the right pads, which causal attention never reads)")
    if any(ci["mask_has_hole"] for ci in c) or any(c[r]["mask_has_real"] and any(has_pad[:r]) for r in range(cp)):
        raise UnsupportedError("the attention_mask has a pad before a real token (left padding or holes); the "
                               "context-parallel attention is causal and ignores the mask, which is exact for right "
                               "padding only. Right-pad (data.padding_side=right) or pack through shard_batch()")
    state.expected_global_len = local_len * cp
    state.max_seqlen = c[0]["max_doc"] if cu_seqlens is not None else None


def _first_forward_check(state: CPState):
    def hook(module, args, kwargs):
        for key in MULTIMODAL_KEYS:
            if kwargs.get(key) is not None:
                raise UnsupportedError(f"multimodal input {key!r} is not supported under context parallelism (a "
                                       "vision-language checkpoint trains its language model on text here): drop the "
                                       "images / videos from the batch (text only), or train with images at "
                                       "parallelism.cp=1 in your own loop, without enable_context_parallel")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        inputs = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise UnsupportedError("under context parallelism the model needs global position_ids; "
                                   "feed the batch produced by shard_batch()")
        if position_ids.dim() > 2:
            # Qwen3-VL's [3 or 4, B, s] multimodal positions: for text every stream is the token's position
            raise UnsupportedError(f"position_ids of shape {tuple(position_ids.shape)}: under context parallelism "
                                   "the model takes [B, s] position_ids (text positions; a VL model's multimodal "
                                   "streams are equal on text). Feed the batch produced by shard_batch()")
        mask2d = kwargs.get("attention_mask")
        mask2d = mask2d if isinstance(mask2d, torch.Tensor) and mask2d.dim() == 2 else None
        _check_every_row(state, position_ids, inputs.shape[1], inputs.shape[0], kwargs.get(CU_SEQLENS_KEY), mask2d)
        state.rope_length = kwargs.get(ROPE_LENGTH_KEY)
        return None
    return hook


def _gather_coords(coords: torch.Tensor, topology: Topology) -> list[list[int]]:
    if topology.cp_size == 1:
        return [coords.tolist()]
    # gloo takes CPU tensors, NCCL the device the model is on; one small gather and one host copy per forward
    nccl = torch.distributed.get_backend(topology.cp_group) == "nccl"
    coords = coords.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    gathered = [torch.empty_like(coords) for _ in range(topology.cp_size)]
    torch.distributed.all_gather(gathered, coords, group=topology.cp_group)
    return torch.stack(gathered).tolist()


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
    linear = linear_mixers(model)  # linear-attention layers: bound by linear_attention/, not attention modules
    missing = [i for i, layer in enumerate(layers)
               if i not in linear and not isinstance(getattr(layer, "self_attn", None), torch.nn.Module)]
    if missing:
        raise UnsupportedError(f"decoder layers {missing} of {type(model).__name__} have no `self_attn` attention "
                               "module, so context parallelism cannot split them; run with parallelism.cp=1")
    return [layer.self_attn for i, layer in enumerate(layers) if i not in linear]


def _freeze_vision_tower(model) -> None:
    """A VL family trains its language model on text (images are refused): the parameters outside the decoder and the
    head (the vision tower and its merger) never run, so they are frozen, and no optimizer decays them or keeps their
    state; they are exported as loaded."""
    used = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    frozen = [p for p in model.parameters() if id(p) not in used]
    for p in frozen:
        p.requires_grad_(False)
    log.info("%s: %d parameters outside the language model (the vision tower) frozen: text-only training never runs "
             "them", type(model).__name__, sum(p.numel() for p in frozen))


def enable_context_parallel(model, topology: Topology, backend: str = "auto"):
    """Install exact Ulysses (or with topology.ring_size > 1 ring / hybrid) attention into a supported HF causal LM."""
    if topology.ring_size > 1:
        # linear-attention layers need whole sequences per head: no ring (linear_attention/checks.py)
        family = SUPPORTED.get(getattr(model.config, "model_type", None))
        if family is not None and family.linear:
            refuse_ring(text_config_of(model.config), topology.ring_size, family.mla)
        # the heads split over the Ulysses group only; the ring keeps every head of its share
        check_model_config(model.config, topology.ulysses_size)
        check_rope(text_config_of(model.config), topology.cp_size)
    else:
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
    bind_linear_attention(model, state)  # linear-attention layers (models.py `linear`): the Ulysses forward, per instance
    if SUPPORTED[model.config.model_type].vision:
        _freeze_vision_tower(model)
    share_global_length(model, topology, state)  # dynamic / longrope RoPE read the length: give them the batch's
    # on the decoder, so the check runs whether the caller goes through the LM head or not (lm.py)
    model.get_decoder().register_forward_pre_hook(_first_forward_check(state), with_kwargs=True)
    if topology.cp_size > 1:
        model.generate = _refuse_generate
    return model
