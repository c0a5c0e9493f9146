"""Recompute policies: which decoder-layer activations are dropped in forward and rebuilt in backward.

- `NoRecompute`: keep everything (the null policy).
- `FullRecompute`: every decoder layer runs under a non-reentrant checkpoint; only layer inputs are kept.
- `BlockRecompute(num_layers, method)`: as Megatron's recompute_num_layers/recompute_method, on whole
  layers: `uniform` spreads the recomputed layers evenly over depth (every L/num_layers-th),
  `block` takes the first num_layers. (Megatron's `uniform` instead checkpoints consecutive groups of
  num_layers layers, recomputing all of them; here both methods recompute exactly num_layers layers.)
- `SelectiveRecompute`: keeps matmul outputs and the attention output; recomputes only the RMSNorms and
  the MLP's SiLU(gate) * up product. Never re-runs attention, so never re-issues its all-to-alls.
  The MLP is rewritten only where its class's forward is exactly down(act(gate) * up) (hf_code.py, to the bytecode);
  any other MLP with gate/up/down projections (a biased, clamped or otherwise changed SwiGLU) runs its own
  forward under one checkpoint instead, with a log line, since rewriting it would change the model.

Full and block recompute re-run the attention of a recomputed layer in backward, so they re-issue its 3
forward all-to-alls there (3 forward + 3 recompute + 3 adjoint per recomputed layer): the price of
keeping only the layer input. Selective recompute issues 3 forward and 3 adjoint per layer, as none.

Why SelectiveRecompute is not torch's selective activation checkpointing (SAC) over the whole layer:
SAC decides per aten op inside a TorchDispatchMode, and our all-to-all (comm.py) reaches the dispatcher
as `aten.empty_like` (the receive buffer) followed by the in-place `c10d.alltoall_base_`, which
returns only a Work handle. Measured at cp=2 (torch 2.13): with a MUST_SAVE policy on `c10d.*`, the
recompute replays the cached Work handle instead of exchanging, but the received data is not part of
that cache, so the recomputed receive buffer stays uninitialised and the gradients come out wrong. Saving it correctly
would also mean caching the buffer and every view of it (twice the memory of the output) and relying
on SAC internals. Checkpointing small regions around the element-wise work instead keeps attention
outside every recomputed region by construction and saves about what SAC would for Llama/Qwen3 layers:
the RMSNorm internals (fp32 copies, normalised values) and the SiLU output are recomputed, while the
residual adds and RoPE save nothing large in the first place.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..hf_code import is_plain_gated_mlp
from .policy import MemoryPolicy, decoder_layers, decoder_of

log = logging.getLogger(__name__)

RECOMPUTE_METHODS = ("uniform", "block")


def checkpointed(fn: Callable) -> Callable:
    """fn(*args, **kwargs) under a non-reentrant checkpoint when grad is on (plain call otherwise)."""
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return wrapper


def recompute_layer_indices(num_layers_total: int, num_layers: int, method: str) -> list[int]:
    """Which of L layers are recomputed for recompute_num_layers=num_layers and recompute_method=method."""
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"recompute_method must be one of {RECOMPUTE_METHODS}, got {method!r} (memory.recompute_method)")
    if not 0 <= num_layers <= num_layers_total:
        raise ValueError(f"recompute_num_layers={num_layers} is outside [0, {num_layers_total}] for a model with "
                         f"{num_layers_total} decoder layers (memory.recompute_num_layers)")
    if method == "block":
        return list(range(num_layers))
    # floor(i * L / N) is strictly increasing because L / N >= 1: N distinct, evenly spaced layers
    return [i * num_layers_total // num_layers for i in range(num_layers)]


def _warn_if_hf_checkpointing(layers: list[torch.nn.Module]) -> None:
    if any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        log.warning("HF gradient checkpointing is enabled as well as a recompute policy: layers will be "
                    "recomputed twice. Call model.gradient_checkpointing_disable() and select memory.recompute")


class NoRecompute(MemoryPolicy):
    name = "none"


class BlockRecompute(MemoryPolicy):
    """Recompute num_layers whole decoder layers, chosen by method (uniform | block)."""

    name = "block"

    def __init__(self, num_layers: int, method: str = "uniform") -> None:
        super().__init__()
        self.num_layers = num_layers
        self.method = method
        self.layer_indices: list[int] = []

    def _apply(self, model: torch.nn.Module) -> None:
        layers = decoder_layers(model)
        _warn_if_hf_checkpointing(layers)
        self.layer_indices = recompute_layer_indices(len(layers), self.num_layers, self.method)
        for i in self.layer_indices:
            self._wrap_forward(layers[i], checkpointed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_layers={self.num_layers}, method={self.method!r})"


class FullRecompute(BlockRecompute):
    """Recompute every decoder layer."""

    name = "full"

    def __init__(self) -> None:
        super().__init__(num_layers=-1, method="block")

    def _apply(self, model: torch.nn.Module) -> None:
        self.num_layers = len(decoder_layers(model))
        super()._apply(model)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _looks_gated(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _selective_mlp_forward(mlp: torch.nn.Module, act_mul: Optional[Callable] = None) -> Callable:
    """The HF gated MLP, down(act(gate(x)) * up(x)), with only act(.) * . under a checkpoint; `act_mul`: the fused
    product kernels/bind.py bound in its place (the same function of gate and up).

    gate(x) and up(x) are matmul outputs and stay saved (they are the region's inputs); the
    [tokens, intermediate] act(gate) tensor that the product would save is rebuilt in backward.
    """
    act_mul = checkpointed(act_mul or (lambda gate, up: mlp.act_fn(gate) * up))

    def forward(x):
        return mlp.down_proj(act_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    return forward


class SelectiveRecompute(MemoryPolicy):
    """Recompute the cheap element-wise work (RMSNorms, SiLU * mul); keep matmul and attention outputs."""

    name = "selective"

    def __init__(self) -> None:
        super().__init__()
        self.num_norms = 0
        self.num_mlps = 0  # rewritten: only act(gate) * up is recomputed
        self.num_whole_mlps = 0  # unknown gated MLPs: their own forward recomputed whole

    def _apply(self, model: torch.nn.Module) -> None:
        layers = decoder_layers(model)
        _warn_if_hf_checkpointing(layers)
        # every RMSNorm of the decoder: the two per layer, Qwen3's q_norm/k_norm, and the final norm
        for module in decoder_of(model).modules():
            if _is_rms_norm(module):
                self._wrap_forward(module, checkpointed)
                self.num_norms += 1
        unknown = set()
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not _looks_gated(mlp):
                continue
            if getattr(mlp.__dict__.get("forward"), "keeps_no_product", False):
                # fp8.recipe=delayed's MLP (kernels/fp8_delayed.py) forms the product again in its backward
                self.num_mlps += 1
                continue
            bound = getattr(mlp.__dict__.get("forward"), "act_mul", None)  # the fused kernels' MLP (kernels/bind.py)
            if "forward" in mlp.__dict__ and bound is None:
                # our MLP forward calls the projections directly and would bypass the patch silently
                raise RuntimeError("SelectiveRecompute must be applied before any policy that patches "
                                   "mlp.forward (TiledMLP); apply_memory_policies uses that order")
            if bound is not None:
                self._wrap_forward(mlp, lambda _current, mlp=mlp, bound=bound: _selective_mlp_forward(mlp, bound))
                self.num_mlps += 1
            elif is_plain_gated_mlp(mlp):
                self._wrap_forward(mlp, lambda _current, mlp=mlp: _selective_mlp_forward(mlp))
                self.num_mlps += 1
            else:
                self._wrap_forward(mlp, checkpointed)
                self.num_whole_mlps += 1
                unknown.add(type(mlp).__qualname__)
        if unknown:
            log.info("selective recompute: %s is not a known down(act(gate) * up) MLP; its %d layers recompute "
                     "their whole MLP forward instead", ", ".join(sorted(unknown)), self.num_whole_mlps)
        kept = len(layers) - self.num_mlps - self.num_whole_mlps
        if kept:
            log.warning("selective recompute: %d of %d layers have no gated MLP (gate_proj/up_proj/down_proj); "
                        "their MLP activations are kept", kept, len(layers))
