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
from typing import Callable, Optional

import torch

from ..errors import UnsupportedError
from .families import MIXERS
from .fla_kernels import DeltaRuleKernel
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


def bind_linear_attention(model, state, kernel: str = "auto") -> int:
    """Run every linear-attention layer of `model` under the CP state's topology; returns how many were bound.
    `kernel`: model.linear_attn_kernel (fla_kernels.py), auto unless set_linear_attn_kernel says otherwise."""
    mixers = linear_mixers(model)
    shared = DeltaRuleKernel(kernel)
    for module in mixers.values():
        module._cp_state = state
        module.__dict__["_cp_linear"] = LinearBinding(MIXERS[type(module).__name__], state, kernel=shared)
        module.forward = types.MethodType(linear_attention_forward, module)
    return len(mixers)


def set_linear_attn_kernel(model, kernel: str, fla_kernel: Optional[Callable] = None) -> int:
    """model.linear_attn_kernel (auto | fla | torch) for every bound linear layer of `model`, after
    enable_context_parallel; returns how many layers it set. A model without linear layers takes auto only.
    `fla_kernel` (tests): kind -> a callable to run instead of fla's kernel, checked at first use as fla's is."""
    bindings = [m.__dict__["_cp_linear"] for m in linear_mixers(model).values() if "_cp_linear" in m.__dict__]
    if not bindings and kernel != "auto":
        raise UnsupportedError(f"model.linear_attn_kernel={kernel}: {type(model).__name__} has no linear-attention "
                               "layers bound by enable_context_parallel, so it would be ignored; leave it at auto")
    shared = DeltaRuleKernel(kernel, fla_kernel)
    for binding in bindings:
        binding.kernel = shared
    return len(bindings)
