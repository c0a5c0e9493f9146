"""How much pinned host memory activation offload will take, said before the first step.

A rank that runs the host out of memory is killed by the kernel (SIGKILL): the launcher reports an exit code
and no Python error, which reads as a silent failure. Under memory.recompute=full or except_attention with
offload, what goes to the host is each decoder layer's input, so the amount is known before the model is built:
local tokens x hidden x bytes per element x layers, capped by memory.offload_max_gib. Other recompute
policies offload more, or other tensors, and get no estimate.

Under memory.recompute=except_attention with memory.attention_offload=true, what goes to the host is each kept
layer's attention tensors: q, k, v and out in the compute dtype, the fp32 log-sum-exp, and, when a Ulysses
exchange runs (cp / ring > 1), the recorded output in sequence layout (otherwise a view of out). Per local token
per layer that is (2 x q heads + 2 x kv heads) x head_dim x bytes + 4 x q heads, plus q heads x head_dim x bytes
with the exchange (kv heads counted as at least cp / ring: a rank holds at least one whole kv head)
(attention_bytes_per_token), for every layer not recomputed whole. An estimate: kernels that pad their
log-sum-exp, or MLA's v padded to q's head dim, take a little more.
"""
from __future__ import annotations

import os
from typing import Optional

from configs import Plan, TrainConfig
from configs.precision import bf16_weights

GIB = 2 ** 30


def offload_estimate_gib(cfg: TrainConfig, plan: Plan, hidden_size: int, num_layers: int) -> Optional[float]:
    """Host GiB of layer inputs one rank's forward will hold under full / except_attention recompute + offload."""
    mem = cfg.memory
    # except_attention checkpoints every layer as full recompute does (its kept attention bypasses offload's hooks),
    # so what offload moves is the same: the layer inputs (checked in tests/test_host_memory.py)
    if not mem.offload_activations or mem.recompute not in ("full", "except_attention"):
        return None
    tokens = plan.micro_batch_size * plan.seq_len // plan.cp
    gib = tokens * hidden_size * (2 if bf16_weights(cfg.precision) else 4) * num_layers / GIB
    return min(gib, mem.offload_max_gib) if mem.offload_max_gib > 0 else gib


def attention_bytes_per_token(hf_config, element_bytes: int, ulysses: int) -> int:
    """Bytes per local token per layer that except_attention keeps of the attention (what attention_offload moves)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    qk_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    v_dim = qk_dim
    if getattr(hf_config, "qk_nope_head_dim", None):  # MLA: k carries nope + rope dims, v its own
        qk_dim = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        v_dim = hf_config.v_head_dim
    # fewer kv heads than Ulysses ranks: each rank still gets a whole kv head (replicated over the group)
    kv_heads = max(kv_heads, ulysses)
    per_token = (heads * qk_dim + kv_heads * qk_dim + kv_heads * v_dim + heads * v_dim) * element_bytes + 4 * heads
    if ulysses > 1:  # the recorded output, exchanged back to sequence layout: a tensor of its own (else a view)
        per_token += heads * v_dim * element_bytes
    return per_token


def attention_offload_estimate_gib(cfg: TrainConfig, plan: Plan, hf_config) -> Optional[float]:
    """Host GiB one rank's forward will hold under except_attention + attention_offload; None without it.

    With memory.budget_gib the layers recomputed whole are chosen later, from the probe: every layer is counted."""
    mem = cfg.memory
    if not getattr(mem, "attention_offload", False) or mem.recompute != "except_attention":
        return None
    tokens = plan.micro_batch_size * plan.seq_len // plan.cp
    kept = hf_config.num_hidden_layers - mem.recompute_num_layers
    element = 2 if bf16_weights(cfg.precision) else 4
    return tokens * attention_bytes_per_token(hf_config, element, plan.cp // plan.ring) * kept / GIB


def offload_report(estimate_gib: float, local_ranks: int, available_gib: float,
                   what: str = "layer inputs") -> tuple[str, bool]:
    """(message, too_much): the estimate for this node's ranks against the host memory available now."""
    node = estimate_gib * local_ranks
    msg = (f"activation offload: about {estimate_gib:.1f} GiB of {what} per rank in pinned host memory, "
           f"{node:.1f} GiB for the {local_ranks} rank(s) of this node; {available_gib:.1f} GiB available now")
    too_much = node > 0.9 * available_gib
    if too_much:
        fix = ("set memory.offload_max_gib (per rank) to keep the rest on the GPU" if what == "layer inputs" else
               "raise memory.recompute_num_layers (those layers keep no attention tensors)")
        msg += (f". That may not fit, and a rank that runs the host out of memory is killed without a Python "
                f"error: {fix}, or raise parallelism.cp. Hosts that grow their memory on demand report too "
                "little here")
    return msg, too_much


def local_ranks() -> int:
    """Ranks on this node: torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))


def available_gib() -> float:
    import psutil
    return psutil.virtual_memory().available / GIB


def log_offload_estimate(cfg: TrainConfig, plan: Plan, hf_config, log) -> None:
    """On rank 0, before the model is built: the estimate against this host's memory, a warning if it may not fit."""
    inputs = offload_estimate_gib(cfg, plan, hf_config.hidden_size, hf_config.num_hidden_layers)
    attention = attention_offload_estimate_gib(cfg, plan, hf_config)
    if inputs is None and attention is None:
        return
    what = " and ".join(w for w, e in (("layer inputs", inputs), ("attention tensors", attention)) if e is not None)
    message, too_much = offload_report((inputs or 0.0) + (attention or 0.0), local_ranks(), available_gib(), what)
    (log.warning if too_much else log.info)(message)
