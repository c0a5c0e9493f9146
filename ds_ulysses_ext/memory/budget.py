"""Budget recompute: recompute as few layers as fit a target peak memory, chosen from a measured probe.

Linear model: every recomputed layer saves the same amount, so with L layers,
    peak(N) = peak_none - N * saving,   saving = (peak_none - peak_full) / L.
`choose_recompute_layers` picks the smallest N with peak(N) <= budget (a pure function, unit-tested
with recorded numbers); `BudgetRecompute` then applies BlockRecompute(N, "uniform").
`measure_probe` takes the two peaks with `torch.cuda.max_memory_allocated` around one forward/backward
each; on CPU there is nothing to measure and it returns None (the policy then recomputes every layer).
"""
from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .policy import MemoryPolicy, decoder_layers
from .recompute import BlockRecompute, FullRecompute, NoRecompute

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeResult:
    peak_none_gib: float  # peak allocated with no recompute (measured, or extrapolated, see measure_probe)
    peak_full_gib: float  # peak allocated with every layer recomputed
    num_layers: int
    extrapolated: bool = False


def choose_recompute_layers(probe: ProbeResult, budget_gib: float) -> int:
    """Smallest number of recomputed layers whose predicted peak fits budget_gib, in [0, num_layers]."""
    L = probe.num_layers
    if probe.peak_none_gib <= budget_gib:
        return 0
    if probe.peak_full_gib > budget_gib:
        log.warning("memory budget %.2f GiB is below the peak with full recompute (%.2f GiB): recomputing all %d "
                    "layers, but the step will not fit the budget; lower data.seq_len, raise parallelism.cp, or "
                    "add memory.offload_activations / memory.tiled_mlp", budget_gib, probe.peak_full_gib, L)
        return L
    saving = (probe.peak_none_gib - probe.peak_full_gib) / L  # > 0 here: none > budget >= full
    # the tolerance keeps an exact fit (e.g. 2.0000000001 layers from float error) from costing a layer
    needed = math.ceil((probe.peak_none_gib - budget_gib) / saving - 1e-9)
    return min(max(needed, 0), L)


def _peak_gib(step_fn: Callable[[], None], model: torch.nn.Module, policy: MemoryPolicy) -> float:
    policy.apply(model)
    try:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step_fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    finally:
        policy.remove()


def measure_probe(step_fn: Callable[[], None], model: torch.nn.Module,
                  device: Optional[torch.device] = None) -> Optional[ProbeResult]:
    """Peak memory of one step with full and with no recompute; None where there is no CUDA device.

    step_fn runs one forward + backward on a representative micro-batch (the run's seq_len) and leaves
    nothing behind (it zeroes the gradients it made). Full recompute is measured first because it is the
    setting most likely to fit. If no recompute runs out of memory, half the layers are recomputed
    instead and peak_none is extrapolated on the same straight line (extrapolated=True).
    """
    device = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        log.info("memory probe skipped: no CUDA device to measure peak memory on")
        return None
    L = len(decoder_layers(model))
    peak_full = _peak_gib(step_fn, model, FullRecompute())
    try:
        return ProbeResult(_peak_gib(step_fn, model, NoRecompute()), peak_full, L)
    except torch.cuda.OutOfMemoryError:
        log.info("memory probe: no recompute runs out of memory; measuring half the layers recomputed")
    kept = L // 2
    if kept == 0:
        return None
    try:
        peak_half = _peak_gib(step_fn, model, BlockRecompute(L - kept, "uniform"))
    except torch.cuda.OutOfMemoryError:
        log.warning("memory probe: out of memory with half the layers recomputed; no probe")
        return None
    saving = (peak_half - peak_full) / kept
    return ProbeResult(peak_full + L * saving, peak_full, L, extrapolated=True)


class BudgetRecompute(MemoryPolicy):
    """BlockRecompute(choose_recompute_layers(probe, budget_gib), "uniform"); full recompute without a probe."""

    name = "budget"

    def __init__(self, budget_gib: float, probe: Optional[ProbeResult]) -> None:
        super().__init__()
        self.budget_gib = budget_gib
        self.probe = probe
        self.inner: Optional[BlockRecompute] = None

    @property
    def num_layers(self) -> Optional[int]:
        return None if self.inner is None else self.inner.num_layers

    def _apply(self, model: torch.nn.Module) -> None:
        L = len(decoder_layers(model))
        if self.probe is None:
            log.warning("memory.recompute=budget without a memory probe (no CUDA device, or the probe failed): "
                        "recomputing all %d layers", L)
            n = L
        else:
            if self.probe.num_layers != L:
                raise ValueError(f"memory probe was taken on {self.probe.num_layers} layers, the model has {L}")
            n = choose_recompute_layers(self.probe, self.budget_gib)
            log.info("memory budget %.2f GiB: recomputing %d of %d layers (probe: %.2f GiB none, %.2f GiB full)",
                     self.budget_gib, n, L, self.probe.peak_none_gib, self.probe.peak_full_gib)
        self.inner = BlockRecompute(n, "uniform").apply(model)

    def remove(self) -> None:
        if self.inner is not None:
            self.inner.remove()
        super().remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(budget_gib={self.budget_gib}, num_layers={self.num_layers})"
