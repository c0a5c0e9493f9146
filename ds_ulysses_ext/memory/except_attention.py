"""Recompute every decoder layer except its core attention: the long-context recompute policy.

Why: at long context the core attention is most of a step's FLOPs (78% at 128k for a Llama-3.2-1B
shape) and grows with S^2, while everything else in a layer grows with S. Full recompute, ALST's
policy, pays one extra attention forward per layer; Megatron's "selective" recomputes the attention and
keeps the rest, the opposite of what long context needs. This policy keeps what the attention kernel
saves for its own backward (q, k, v, out, logsumexp) and the layer input, 7 x hidden bytes per token
per layer in bf16 with GQA 32/8 (3.5 GiB per layer at 256k for hidden 2048; at cp > 1 the recorded
output in sequence layout adds 2 x hidden), and recomputes the projections, norms, RoPE and MLP, which are cheap
per token. Under CP, nothing between the projections and o_proj is re-run either, so the recompute
issues no all-to-all.

How (torch's selective activation checkpointing cannot do this: it does not cache our all-to-all
output, memory/recompute.py explains). Each layer runs under a non-reentrant checkpoint whose
function, on its first call, runs the core attention with the checkpoint's saved-tensor hooks
overridden by identity hooks, so the kernel's saved tensors are kept as they are, and records the
output (detached: no reference cycle through the autograd graph). When backward recomputes the layer,
the same function replays the recorded output instead of calling the kernel. The original graph's
attention node is then still the one that backward runs, with its kept tensors; the recompute only
has to rebuild the tensors the other ops saved, and o_proj's input is the recorded output itself, so
the recompute is exact. The record belongs to one layer call (a closure), so two forwards before one
backward (DPO-style losses, gradient accumulation with retained graphs) each replay their own output.

With `offload=True` (memory.attention_offload) the kept tensors and the recorded output go to pinned host memory
right after each core-attention call and come back, one layer ahead, when backward reaches the layer
(attention_offload.py); the recorded output is then replayed from its reloaded copy.

Layers listed in `full_layers` (recompute_num_layers / recompute_method) are recomputed whole, attention
included: the memory knob for lengths where keeping every layer's attention tensors does not fit.

In the recompute, the q/k/v projections whose outputs nothing but the replayed attention reads skip their GEMMs
(kernels/projections.py, where the fused kernels bound them); their gradients need only the layer's normed input.

The core attention is reached through the `core_attention_wrapper` attribute that the "ds_ulysses"
attention function (integrate.py) honours, so the model must have gone through
`enable_context_parallel` (any cp, including 1); otherwise the policy refuses to apply. A layer call
whose forward never reached the wrapper raises instead of silently recomputing attention.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels.projections import outputs_unused
from .attention_offload import AttentionOffload, AttentionStash
from .offload import HostLink
from .policy import MemoryPolicy, decoder_layers
from .recompute import _warn_if_hf_checkpointing, checkpointed, recompute_layer_indices

CP_ATTENTION = "ds_ulysses"  # integrate.ATTN_NAME; not imported, so memory/ does not depend on integrate

_active = threading.local()  # the record of the layer call running on this thread (recompute runs on autograd's)


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _AttentionRecord:
    """The core-attention outputs of one layer call: recorded on the first run, replayed on recomputes."""

    def __init__(self, offload: Optional[AttentionOffload] = None) -> None:
        # (detached output or, with offload, its stash handle; its stash or None; it required grad)
        self.outputs: list[tuple[object, Optional[AttentionStash], bool]] = []
        self.recording = True
        self.position = 0
        self.offload = offload

    def run(self, core: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.recording:
            if self.offload is None:
                # the innermost hooks win: the kernel's saved tensors bypass the checkpoint and are kept
                with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                    out = core()
                self.outputs.append((out.detach(), None, out.requires_grad))
                return out
            # the same, into a stash that goes to the host as soon as the kernel has returned
            stash = self.offload.new_stash()
            with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
                out = core()
            self.outputs.append((stash.pack(out.detach()), stash, out.requires_grad))
            stash.offload()
            return out
        if self.position >= len(self.outputs):
            raise RuntimeError("except_attention recompute: the recomputed layer called attention more often "
                               "than its forward did; the layer is not deterministic in its control flow")
        recorded, stash, requires_grad = self.outputs[self.position]
        self.position += 1
        if stash is not None:
            recorded = stash.unpack(recorded)
        # a fresh leaf with the original's requires_grad, so the recompute saves the same tensors as the
        # forward did (an op saves its other operand only for an input that requires grad)
        return recorded.detach().requires_grad_(requires_grad)


def core_attention_wrapper(core: Callable[[], torch.Tensor]) -> torch.Tensor:
    record: Optional[_AttentionRecord] = getattr(_active, "record", None)
    return core() if record is None else record.run(core)


def _layer_forward(forward: Callable, offload: Optional[AttentionOffload] = None) -> Callable:
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        record = _AttentionRecord(offload)

        def body(*a, **kw):
            if not record.recording:  # the recompute: the first thing this layer's backward does
                for _, stash, _ in record.outputs:
                    if stash is not None:
                        stash.begin_backward()  # reload this layer's attention tensors, prefetch the layer below's
            previous = getattr(_active, "record", None)
            _active.record = record
            record.position = 0
            try:
                # the replay: projections whose outputs only the replayed attention read may skip their GEMMs
                with contextlib.nullcontext() if record.recording else outputs_unused():
                    out = forward(*a, **kw)
            finally:
                _active.record = previous
            if record.recording:
                if not record.outputs:
                    raise RuntimeError("except_attention: this decoder layer's forward never reached the "
                                       "ds_ulysses attention, so its attention would be recomputed silently; "
                                       "keep attn_implementation='ds_ulysses' (enable_context_parallel)")
                record.recording = False
            return out
        return checkpoint(body, *args, use_reentrant=False, **kwargs)
    return wrapper


def _token_mixer(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """The module whose core the policy keeps: `self_attn`, or a hybrid's linear-attention layer (`linear_attn`; Ling-3.0
    names its linear modules `self_attn` too). A linear layer's core, the all-to-all, the conv and the chunked delta
    rule (linear_attention/layer.py `_exchange_and_mix`), is kept out of recompute like the attention kernel rather than
    recomputing the linear layer whole: the bound forward runs that core through the same `core_attention_wrapper`, so
    the record-and-replay is the attention's, as exact, and the recompute issues no all-to-all there either; what is
    recomputed is per token (the projections, the gated output norm, out_proj, the MLP). The bound forward exists only
    after enable_context_parallel (any cp); HF's own would never reach the wrapper, and _layer_forward would raise."""
    mixer = getattr(layer, "self_attn", None)
    if mixer is None:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            raise ValueError(f"memory.recompute=except_attention: decoder layer {index} ({type(layer).__name__}) has "
                             "neither self_attn nor linear_attn, so there is no core to keep out of recompute")
    if hasattr(mixer, "conv1d") and "_cp_linear" not in mixer.__dict__:
        raise ValueError(f"memory.recompute=except_attention: decoder layer {index}'s linear attention "
                         f"({type(mixer).__name__}) runs HF's forward, which does not honour the policy's core "
                         "wrapper; call enable_context_parallel on the model first (cp=1 included)")
    return mixer


class ExceptAttentionRecompute(MemoryPolicy):
    """Recompute each decoder layer but its core attention; `full_layers` of them are recomputed whole."""

    name = "except_attention"

    def __init__(self, full_layers: int = 0, method: str = "uniform", offload: bool = False,
                 link: Optional[HostLink] = None) -> None:
        super().__init__()
        self.full_layers = full_layers
        self.method = method
        self.full_indices: list[int] = []
        # memory.attention_offload: the kept attention tensors live in pinned host memory (attention_offload.py)
        self.offload = AttentionOffload(link) if offload else None

    def _apply(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None) or model.hf.config
        if getattr(config, "_attn_implementation", None) != CP_ATTENTION:
            raise ValueError(
                f"memory.recompute=except_attention needs the {CP_ATTENTION!r} attention (call "
                "enable_context_parallel on the model first, cp=1 included); the model uses "
                f"{getattr(config, '_attn_implementation', None)!r}")
        layers = decoder_layers(model)
        _warn_if_hf_checkpointing(layers)
        self.full_indices = recompute_layer_indices(len(layers), self.full_layers, self.method)
        for i, layer in enumerate(layers):
            if i in self.full_indices:
                self._wrap_forward(layer, checkpointed)
            else:
                self._wrap_forward(layer, lambda forward: _layer_forward(forward, self.offload))
                self._set_attr(_token_mixer(layer, i), "core_attention_wrapper", core_attention_wrapper)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(full_layers={self.full_layers}, method={self.method!r}, "
                f"offload={self.offload is not None})")
