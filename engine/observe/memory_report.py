"""What the device holds, said once after the second step (the first with every part in place): parameters, master
weights, optimizer states, the gradient buffer, DeepSpeed's other resident buffers, and the activation peak.

Counted from the tensors themselves (each storage once), not estimated: ZeRO-1/2 keep the master weights in
`single_partition_of_fp32_groups`; ZeRO-3 in `fp32_partitioned_groups_flat`; the Adam moments are the inner
optimizer's state. The gradient buffer is the partition's size in the gradient dtype: ZeRO-3 keeps it
(`grad_partitions_flat_buffer`), ZeRO-1/2 allocate it in each backward (`grads_in_partition`) and free it after
the step, so there it is part of the step's peak, not of what stays. "other" is whatever else stays allocated between
steps (DeepSpeed's reduce buckets, RoPE tables, ...): the allocator's figure minus the parts; "activations" the peak
minus what stays and the gradient buffer. On CPU there is no allocator figure, so only the parts are reported.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

GIB = 2**30


def _bytes(tensors, device, seen: set) -> int:
    total = 0
    for t in tensors:
        if not torch.is_tensor(t) or t.device != device or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _flat(x):
    for item in x if isinstance(x, (list, tuple)) else [x]:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        elif item is not None:
            yield item


def resident_parts(engine, device: torch.device) -> dict:
    """Bytes per part, each storage counted once (in this order: a view shared with a later part counts here)."""
    seen: set = set()
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    master = list(_flat(getattr(opt, "single_partition_of_fp32_groups", None)
                        or getattr(opt, "fp32_partitioned_groups_flat", None) or []))
    states = [t for st in getattr(inner, "state", {}).values() for t in st.values()]
    parts = {"parameters": _bytes(params, device, seen), "master_weights": _bytes(master, device, seen),
             "optimizer_states": _bytes(states, device, seen)}
    resident_grads = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3
    if resident_grads is not None:
        parts["gradients"] = _bytes([resident_grads], device, seen)
    elif hasattr(opt, "params_in_partition"):  # ZeRO-1/2: what each backward allocates for this rank's partition
        size = torch.tensor([], dtype=getattr(opt, "dtype", torch.float32)).element_size()
        parts["gradients"] = size * sum(p.numel() for g in opt.params_in_partition for p in g)
    else:  # ZeRO-0: each parameter's own .grad, made during backward
        parts["gradients"] = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
    parts["gradients_resident"] = resident_grads is not None
    return parts


def memory_breakdown(engine, device: torch.device) -> dict:
    """GiB per part; with the allocator's figures on CUDA, `other` resident and the step's `transient_peak`."""
    parts = resident_parts(engine, device)
    grads_resident = parts.pop("gradients_resident")
    out = {k: v / GIB for k, v in parts.items()}
    if device.type == "cuda":
        resident = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
        staying = sum(v for k, v in parts.items() if k != "gradients" or grads_resident)
        out["other"] = (resident - staying) / GIB
        out["activations"] = (peak - resident - (0 if grads_resident else parts["gradients"])) / GIB
        out["peak"] = peak / GIB
    return out


def log_memory_breakdown(engine, device: torch.device) -> dict:
    out = memory_breakdown(engine, device)
    log.info("memory after the second step (GiB): %s", ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out
