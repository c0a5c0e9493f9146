"""Shared by the packing and window/sink tests: one CP step's loss and CP-summed gradients, rel error, and a model's
gradients for a reference (grads_of)."""
import torch
import torch.distributed as dist

from ds_ulysses_ext import CPCausalLM, shard_batch


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads_of(model) -> dict:
    """Every parameter's gradient; zeros where none came (a VL model's vision tower, which text never runs)."""
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def cp_loss_and_grads(model, topo, batch: dict, chunk: int = 3):
    """(global mean loss, {name: gradient summed over the CP group}) of one forward/backward under CP.

    Each rank backprops its share local_sum / global_count and the parameter gradients are summed over the
    CP group, as the engine combines them (engine/ds/grad_reduction.py)."""
    local = shard_batch(batch, topo)
    loss_sum, count = CPCausalLM(model, loss_chunk_size=chunk)(**local)
    global_count = count.clone()
    if topo.cp_size > 1:
        dist.all_reduce(global_count, group=topo.cp_group)
    share = loss_sum / global_count
    share.backward()
    total = share.detach().clone()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
    if topo.cp_size > 1:
        dist.all_reduce(total, group=topo.cp_group)
        for g in grads.values():
            dist.all_reduce(g, group=topo.cp_group)
    return total, grads
