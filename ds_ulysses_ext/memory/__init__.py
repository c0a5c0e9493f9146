"""Memory policies for long context: recompute, activation offload, tiled MLP (docs/memory.md).

Each policy is an object with `apply(model) -> self` and `remove()`; `apply_memory_policies` applies
the ones a MemoryConfig selects in a fixed order and `remove_all` undoes them. Chunked logits + loss
live in ds_ulysses_ext/loss.py. Importing this package has no side effects.
"""
from .allocator import allocator_env, memory_report
from .budget import BudgetRecompute, ProbeResult, choose_recompute_layers, measure_probe
from .build import apply_memory_policies, build_memory_policies
from .except_attention import ExceptAttentionRecompute
from .offload import OffloadActivations
from .policy import MemoryPolicy, decoder_layers, remove_all
from .recompute import (BlockRecompute, FullRecompute, NoRecompute, SelectiveRecompute,
                        recompute_layer_indices)
from .tiling import TiledMLP

__all__ = ["MemoryPolicy", "NoRecompute", "FullRecompute", "BlockRecompute", "SelectiveRecompute",
           "BudgetRecompute", "ExceptAttentionRecompute", "ProbeResult", "choose_recompute_layers", "measure_probe",
           "OffloadActivations", "TiledMLP", "build_memory_policies", "apply_memory_policies", "remove_all",
           "allocator_env", "memory_report", "decoder_layers", "recompute_layer_indices"]
