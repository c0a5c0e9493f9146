"""From a MemoryConfig to applied policies, in one fixed order.

Order of application (removal is the reverse, `remove_all`):
0. with selective_kept (block/budget only): SelectiveRecompute on every layer, so the layers the
   recompute policy keeps still drop their element-wise activations;
1. the recompute policy (none | full | block | selective | budget | except_attention): wraps decoder
   layers, or for selective the RMSNorms and the MLP forward; except_attention with attention_offload
   also moves the attention tensors it keeps to the host (its own hooks, innermost: offload never sees them);
2. TiledMLP: wraps each layer's MLP forward, on top of selective's (each tile then nests its
   checkpoint inside a recomputed layer under full/block recompute, which non-reentrant checkpoints
   support);
3. OffloadActivations: wraps the decoder forward in saved-tensor hooks, outermost, so it sees what the
   other policies decided to keep (layer inputs under full recompute, tile inputs under tiling).
The config is read by attribute (configs/memory.py MemoryConfig), so the library has no config import.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .budget import BudgetRecompute, ProbeResult, choose_recompute_layers
from .except_attention import ExceptAttentionRecompute
from .offload import DEFAULT_INFLIGHT_BYTES, HostLink, OffloadActivations
from .policy import MemoryPolicy, decoder_layers
from .recompute import BlockRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from .tiling import TiledMLP

log = logging.getLogger(__name__)


def _recompute_policy(memory_cfg, num_layers: int, probe: Optional[ProbeResult],
                      link: Optional[HostLink] = None) -> MemoryPolicy:
    kind = memory_cfg.recompute
    if kind == "none":
        return NoRecompute()
    if kind == "full":
        return FullRecompute()
    if kind == "block":
        if not 1 <= memory_cfg.recompute_num_layers <= num_layers:
            raise ValueError(f"memory.recompute=block needs 1 <= memory.recompute_num_layers <= {num_layers} "
                             f"(the model's decoder layers), got {memory_cfg.recompute_num_layers}")
        return BlockRecompute(memory_cfg.recompute_num_layers, memory_cfg.recompute_method)
    if kind == "selective":
        return SelectiveRecompute()
    if kind == "budget":
        return BudgetRecompute(memory_cfg.budget_gib, probe)
    if kind == "except_attention":
        whole = memory_cfg.recompute_num_layers
        if memory_cfg.budget_gib > 0:
            if probe is None:
                raise ValueError("memory.recompute=except_attention with memory.budget_gib needs the probe: "
                                 "memory.probe_none_gib and memory.probe_full_gib = peak_mem_gib of one step with "
                                 "recompute_num_layers=0 and with recompute_num_layers=<all layers>")
            whole = choose_recompute_layers(probe, memory_cfg.budget_gib)
            log.info("except_attention: %d of %d layers recomputed whole to fit %.1f GiB (probe %.1f / %.1f GiB)",
                     whole, num_layers, memory_cfg.budget_gib, probe.peak_none_gib, probe.peak_full_gib)
        return ExceptAttentionRecompute(whole, memory_cfg.recompute_method,
                                        offload=getattr(memory_cfg, "attention_offload", False), link=link)
    raise ValueError(f"unknown memory.recompute={kind!r}; choose none, full, block, selective, budget or "
                     "except_attention")


def build_memory_policies(memory_cfg, model: torch.nn.Module,
                          probe: Optional[ProbeResult] = None) -> list[MemoryPolicy]:
    """The policies memory_cfg selects, unapplied, in application order. probe: for recompute=budget."""
    # one host link for both offloads: one side stream on the one PCIe link, and one bound on the device memory
    # that waits for device-to-host copies (memory.offload_inflight_gib), not one bound each
    inflight_gib = getattr(memory_cfg, "offload_inflight_gib", DEFAULT_INFLIGHT_BYTES / 2**30)
    link = HostLink(int(inflight_gib * 2**30))
    policies = [_recompute_policy(memory_cfg, len(decoder_layers(model)), probe, link)]
    if getattr(memory_cfg, "selective_kept", False):
        if memory_cfg.recompute not in ("block", "budget"):
            raise ValueError("memory.selective_kept=true only applies to memory.recompute=block or budget")
        # first, so that whole-layer checkpoints wrap layers whose norms/MLP already recompute selectively
        policies.insert(0, SelectiveRecompute())
    if memory_cfg.tiled_mlp:
        policies.append(TiledMLP(memory_cfg.mlp_tile_tokens))
    if memory_cfg.offload_activations:
        policies.append(OffloadActivations(max_host_bytes=int(getattr(memory_cfg, "offload_max_gib", 0.0) * 2**30),
                                           link=link))
    return policies


def apply_memory_policies(model: torch.nn.Module, memory_cfg,
                          probe: Optional[ProbeResult] = None) -> list[MemoryPolicy]:
    """Build and apply the configured policies to an HF causal LM (before deepspeed.initialize)."""
    return [policy.apply(model) for policy in build_memory_policies(memory_cfg, model, probe)]
