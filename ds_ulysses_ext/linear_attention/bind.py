"""Find a hybrid model's linear-attention layers and bind the Ulysses forward (layer.py) on each instance.

Binding is per instance (`module.forward` set on the object, as rope.py does for rotaries): HF's classes are never
patched, so another model in the process, or a copy of this one without CP, runs HF's forward as before. The
module keeps its parameters and names; only its forward changes.

A layer is linear when config.layer_types says "linear_attention" (every hybrid family here has the list). Its
module is `linear_attn` (Qwen3.5 / 3.6, Qwen3-Next) or `self_attn` (Ling-3.0's `bailing_hybrid`, whose linear and
full attention modules share the name); a module of a class families.py does not know is refused, never left to
run unsplit on its chunk.
"""
from __future__ import annotations

import types

import torch

from ..errors import UnsupportedError
from .families import MIXERS
from .layer import LinearBinding, linear_attention_forward

LINEAR = "linear_attention"


def linear_mixers(model) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its linear-attention module}; empty for a model without linear layers."""
    config = model.config
    types_ = list(getattr(config, "layer_types", None) or [])
    if LINEAR not in types_:
        return {}
    layers = model.get_decoder().layers
    found = {}
    for i, layer in enumerate(layers):
        if i >= len(types_) or types_[i] != LINEAR:
            continue
        module = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        name = type(module).__name__
        if name not in MIXERS:
            raise UnsupportedError(
                f"decoder layer {i} of {type(model).__name__} is a linear-attention layer of class {name}, which the "
                f"context-parallel linear attention does not know (it knows {sorted(MIXERS)}); run with "
                "parallelism.cp=1")
        found[i] = module
    return found


def bind_linear_attention(model, state) -> int:
    """Run every linear-attention layer of `model` under the CP state's topology; returns how many were bound."""
    mixers = linear_mixers(model)
    for module in mixers.values():
        module._cp_state = state
        module.__dict__["_cp_linear"] = LinearBinding(MIXERS[type(module).__name__], state)
        module.forward = types.MethodType(linear_attention_forward, module)
    return len(mixers)
