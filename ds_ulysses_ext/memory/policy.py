"""MemoryPolicy: the base of every activation-memory policy, and the one way policies patch a model.

A policy is a strategy object: `apply(model)` patches the model and
returns the policy, which keeps every handle it made; `remove()` undoes exactly that, restoring the
model attribute by attribute. Policies patch only instance attributes (a module's `forward`), never a
class, so two models in one process (tests, a reference copy) never see each other's policies.

Policies stack: a later one may wrap what an earlier one installed (TiledMLP over SelectiveRecompute's
MLP forward). Each patch remembers what it replaced, so removal must run in reverse order of
application; `remove_all` does that, and a remove out of order raises instead of silently
dropping the later policy's wrapper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

_MISSING = object()


@dataclass
class _AttrPatch:
    """One instance attribute replaced on one module, and what was there before."""
    module: torch.nn.Module
    attr: str
    new: Any
    previous: Any  # the instance attribute before the patch, or _MISSING (then the class one showed)

    def undo(self) -> None:
        current = self.module.__dict__.get(self.attr, _MISSING)
        if current is not self.new:
            raise RuntimeError(f"{type(self.module).__name__}.{self.attr} was re-patched after this policy; "
                               "remove memory policies in reverse order of application (remove_all does)")
        if self.previous is _MISSING:
            delattr(self.module, self.attr)
        else:
            setattr(self.module, self.attr, self.previous)


class MemoryPolicy:
    """Base class and the null policy: `apply` patches nothing (memory=none)."""

    name = "none"

    def __init__(self) -> None:
        self._patches: list[_AttrPatch] = []
        self._hooks: list[RemovableHandle] = []
        self._applied = False

    def apply(self, model: torch.nn.Module) -> "MemoryPolicy":
        if self._applied:
            raise RuntimeError(f"memory policy {self.name!r} is already applied; build a new one per model")
        self._applied = True
        try:
            self._apply(model)
        except BaseException:
            self.remove()  # a refused or failed apply leaves the model as it found it
            raise
        return self

    def _apply(self, model: torch.nn.Module) -> None:
        """Subclasses patch here through `_wrap_forward` / `_hook`, so `remove` can undo it."""

    def remove(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        while self._patches:  # popped only once undone, so a refused undo can be retried in the right order
            self._patches[-1].undo()
            self._patches.pop()
        self._applied = False

    def _wrap_forward(self, module: torch.nn.Module, make: Callable[[Callable], Callable]) -> None:
        """Replace `module.forward` (instance attribute) by `make(current_forward)`."""
        previous = module.__dict__.get("forward", _MISSING)
        new = make(module.forward)  # the bound class method, or an earlier policy's wrapper
        module.forward = new
        self._patches.append(_AttrPatch(module, "forward", new, previous))

    def _set_attr(self, module: torch.nn.Module, attr: str, value: Any) -> None:
        """Set an instance attribute that `remove` restores (e.g. attention's core_attention_wrapper)."""
        previous = module.__dict__.get(attr, _MISSING)
        setattr(module, attr, value)
        self._patches.append(_AttrPatch(module, attr, value, previous))

    def _hook(self, handle: RemovableHandle) -> None:
        self._hooks.append(handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of an HF causal LM, also through a CPCausalLM wrapper (`.hf`)."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    if hasattr(model, "hf"):
        return model.hf.get_decoder()
    raise TypeError(f"{type(model).__name__} is not an HF causal LM (no get_decoder()); memory policies "
                    "operate on Llama/Qwen3-family models whose decoder holds `.layers`")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = decoder_of(model)
    if not hasattr(decoder, "layers"):
        raise TypeError(f"{type(decoder).__name__} has no `.layers`; memory policies need the decoder layer list")
    return list(decoder.layers)


def remove_all(policies: list[MemoryPolicy]) -> None:
    """Remove policies in reverse order of application, restoring the model exactly."""
    for policy in reversed(policies):
        policy.remove()
