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
import torch.nn.functional as F

from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, moe_batch
from ds_ulysses_ext import enable_context_parallel, init_topology
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel
from tiny_models import tiny_model

RTOL = 1e-5
COEF = 0.1  # large, so the balance loss moves the router gradient far beyond the tolerance
E, K = 8, 2
MOE = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True)


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
    ids, labels, mask = moe_batch()
    out = model(input_ids=ids, output_router_logits=True)
    logits = out.logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    aux = _reference_aux(out.router_logits, mask)
    (ce + COEF * aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(rank, world, cp, ep):
    ref_ce, ref_aux, ref_grads = _reference()
    topo = init_topology(cp, ep_size=ep)
    model = enable_context_parallel(tiny_model("qwen3_moe", **MOE), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    assert_moe_split_matches(model, topo, moe_batch(), COEF, ref_ce, ref_aux, ref_grads, E, RTOL)


@pytest.mark.parametrize("world,cp,ep", [(2, 2, 2), (2, 1, 2), (4, 2, 2), (4, 2, 4), (4, 4, 4), (4, 4, 1)])
def test_moe_model_cp_ep_matches_unsplit(world, cp, ep):
    run_ranks(_check, world, cp, ep)


def test_aux_loss_really_counts():
    """The reference's balance term is large enough to matter: the router gradient moves well past RTOL."""
    model = tiny_model("qwen3_moe", **MOE)
    ids, _, mask = moe_batch()
    out = model(input_ids=ids, output_router_logits=True)
    aux = _reference_aux(out.router_logits, mask)
    (COEF * aux).backward()
    g = model.model.layers[0].mlp.gate.weight.grad
    assert g.norm() > 1e-3
