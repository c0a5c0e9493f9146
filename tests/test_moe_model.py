"""A tiny HF Qwen3-MoE under CP x EP against the unsplit HF model (fp32, rel 1e-5): cross-entropy, the
per-sequence balance loss and every gradient.

The reference is stock HF (its own sparse block, full sequences, one process) plus the balance loss written
out here from HF's router logits: for each layer and sequence, f_e = E/(k n) * count_e and P_e = mean prob over
the sequence's real tokens, L = sum_e f_e P_e, averaged over sequences and summed over layers. Padding is
excluded, and sequence 1 is padded, so a layout that counted pads (or cp's extra padding) would differ.
Under CP x EP each rank backprops  ce_sum / global_tokens + coef * aux_share / global_sequences; gradients are
summed over all ranks for dense weights and over the expert-data-parallel group for an expert shard.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.moe import moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel
from tiny_models import tiny_model

RTOL = 1e-5
COEF = 0.1  # large, so the balance loss moves the router gradient far beyond the tolerance
E, K = 8, 2
MOE = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True)


def _batch(rows=4, S=13):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (rows, S), generator=g)
    mask = torch.ones(rows, S, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return ids, labels, mask


def _reference_aux(router_logits, mask):
    B, S = mask.shape
    total = 0.0
    for logits in router_logits:  # one [B*S, E] per MoE layer
        probs = torch.softmax(logits.float(), -1).view(B, S, E)
        top = torch.topk(probs, K, dim=-1).indices
        for b in range(B):
            real = mask[b].bool()
            n = real.sum()
            counts = torch.zeros(E)
            for e in top[b][real].flatten().tolist():
                counts[e] += 1
            f = counts * E / (K * n)
            P = probs[b][real].mean(0)
            total = total + (f * P).sum()
    return total / B


def _reference():
    model = tiny_model("qwen3_moe", **MOE)
    ids, labels, mask = _batch()
    out = model(input_ids=ids, output_router_logits=True)
    logits = out.logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    aux = _reference_aux(out.router_logits, mask)
    (ce + COEF * aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(rank, world, cp, ep):
    ref_ce, ref_aux, ref_grads = _reference()
    topo = init_topology(cp, ep_size=ep)
    model = enable_context_parallel(tiny_model("qwen3_moe", **MOE), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    lm = CPCausalLM(model, loss_chunk_size=4)
    ids, labels, mask = _batch()
    rows = ids.shape[0] // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    local = shard_batch({"input_ids": ids[mine], "labels": labels[mine], "attention_mask": mask[mine]}, topo)
    local["moe_token_mask"] = shard_batch({"input_ids": mask[mine]}, topo)["input_ids"]
    loss_sum, count = lm(**local)
    counts = torch.stack([count.double(), torch.tensor(float(rows) / cp, dtype=torch.float64)])
    dist.all_reduce(counts)
    aux_share = lm.moe_aux_share
    (loss_sum / counts[0] + COEF * aux_share / counts[1]).backward()
    totals = torch.stack([loss_sum.detach() / counts[0], aux_share.detach() / counts[1]]).double()
    dist.all_reduce(totals)
    assert _rel(totals[0], ref_ce.double()) < RTOL, ("ce", totals[0], ref_ce)
    assert _rel(totals[1], ref_aux.double()) < RTOL, ("aux", totals[1], ref_aux)
    El = E // ep
    experts = {id(p) for b in moe_blocks(model) for p in b.experts.parameters()}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        ref = ref_grads[name]
        if id(p) in experts:
            dist.all_reduce(grad, group=topo.edp_group)
            ref = ref[topo.ep_rank * El:(topo.ep_rank + 1) * El]
        else:
            dist.all_reduce(grad)
        assert _rel(grad, ref) < RTOL, (name, _rel(grad, ref))


@pytest.mark.parametrize("world,cp,ep", [(2, 2, 2), (2, 1, 2), (4, 2, 2), (4, 2, 4), (4, 4, 4), (4, 4, 1)])
def test_moe_model_cp_ep_matches_unsplit(world, cp, ep):
    run_ranks(_check, world, cp, ep)


def test_aux_loss_really_counts():
    """The reference's balance term is large enough to matter: the router gradient moves well past RTOL."""
    model = tiny_model("qwen3_moe", **MOE)
    ids, _, mask = _batch()
    out = model(input_ids=ids, output_router_logits=True)
    aux = _reference_aux(out.router_logits, mask)
    (COEF * aux).backward()
    g = model.model.layers[0].mlp.gate.weight.grad
    assert g.norm() > 1e-3
