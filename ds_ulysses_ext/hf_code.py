"""HF modules recognised by their code: what the kernels and policies may rewrite without changing the model.

A class name says nothing about what a forward computes (a subclass, a patched class, a family's own variant), and a
hand list of names lags every new family: transformers 5.22.2 writes the same gated MLP in a dozen modeling files
(DeepseekV3MLP, Qwen3_5MLP, Glm4MoeMLP, ...), each a copy of LlamaMLP's. So a module is recognised by its class's
forward, to the bytecode: the same instructions on the same attribute names compute the same function, whatever the
class is called. A forward that differs in any way (a clamp, a bias on the product, a norm inside) is not recognised,
and its caller leaves it as it is.
"""
from __future__ import annotations

import torch

MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def same_code(f, g) -> bool:
    """f and g are the same Python function to the bytecode: instructions, constants, names and defaults."""
    a, b = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return a is not None and b is not None and (a.co_code, a.co_consts, a.co_names, a.co_varnames) == \
        (b.co_code, b.co_consts, b.co_names, b.co_varnames) and f.__defaults__ == g.__defaults__


def _plain_gated_forward(self, x):
    # the form HF's modeling files write (LlamaMLP.forward and its copies); tests/test_hf_code.py checks that
    # every supported family's dense MLP class matches it
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def is_plain_gated_mlp(module: torch.nn.Module) -> bool:
    """down(act(gate(x)) * up(x)) of three nn.Linear: its class's forward is HF's gated MLP to the bytecode. The
    activation is whatever act_fn is (callers that need SiLU check it); biases live inside the projections."""
    return (all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in MLP_NAMES)
            and hasattr(module, "act_fn") and same_code(getattr(type(module), "forward", None), _plain_gated_forward))
