"""How much pinned host memory activation offload will take, said before the first step.

A rank that runs the host out of memory is killed by the kernel (SIGKILL): the launcher reports an exit code
and no Python error, which reads as a silent failure. Under memory.recompute=full with offload, what goes to
the host is each decoder layer's input, so the amount is known before the model is built:
local tokens x hidden x bytes per element x layers, capped by memory.offload_max_gib. Other recompute
policies offload more, or other tensors, and get no estimate.
"""
from __future__ import annotations

import os
from typing import Optional

from configs import Plan, TrainConfig

GIB = 2 ** 30


def offload_estimate_gib(cfg: TrainConfig, plan: Plan, hidden_size: int, num_layers: int) -> Optional[float]:
    """Host GiB one rank's forward will hold under full recompute + offload; None where there is no estimate."""
    mem = cfg.memory
    if not mem.offload_activations or mem.recompute != "full":
        return None
    tokens = plan.micro_batch_size * plan.seq_len // plan.cp
    gib = tokens * hidden_size * (2 if cfg.precision == "bf16" else 4) * num_layers / GIB
    return min(gib, mem.offload_max_gib) if mem.offload_max_gib > 0 else gib


def offload_report(estimate_gib: float, local_ranks: int, available_gib: float) -> tuple[str, bool]:
    """(message, too_much): the estimate for this node's ranks against the host memory available now."""
    node = estimate_gib * local_ranks
    msg = (f"activation offload: about {estimate_gib:.1f} GiB of layer inputs per rank in pinned host memory, "
           f"{node:.1f} GiB for the {local_ranks} rank(s) of this node; {available_gib:.1f} GiB available now")
    too_much = node > 0.9 * available_gib
    if too_much:
        msg += (". That may not fit, and a rank that runs the host out of memory is killed without a Python "
                "error: set memory.offload_max_gib (per rank) to keep the rest on the GPU, or raise "
                "parallelism.cp. Hosts that grow their memory on demand report too little here")
    return msg, too_much


def local_ranks() -> int:
    """Ranks on this node: torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))


def available_gib() -> float:
    import psutil
    return psutil.virtual_memory().available / GIB


def log_offload_estimate(cfg: TrainConfig, plan: Plan, hf_config, log) -> None:
    """On rank 0, before the model is built: the estimate against this host's memory, a warning if it may not fit."""
    estimate = offload_estimate_gib(cfg, plan, hf_config.hidden_size, hf_config.num_hidden_layers)
    if estimate is not None:
        message, too_much = offload_report(estimate, local_ranks(), available_gib())
        (log.warning if too_much else log.info)(message)
