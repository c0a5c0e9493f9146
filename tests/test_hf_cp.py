"""A tiny HF Llama / Qwen3 under CP (cp = 2, 4) against the unsplit model (fp32, rel 1e-5).

The reference is stock HF: full sequence, sdpa attention, `F.cross_entropy` mean over the shifted
labels. Under CP each rank backprops its share local_sum / global_count, and the parameter gradients
are summed over the CP group (how the engine combines shares, see engine/ds/grad_reduction.py).
The batch has masked labels, a length (13) that cp does not divide, and a leading masked region so
that whole chunks hold only masked targets (rank 0 has no loss token at cp=4).
"""
import pytest
import torch
import torch.nn.functional as F

from cp_check import assert_share_matches_unsplit
from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
from tiny_models import tiny_model

RTOL = 1e-5


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100          # whole leading chunks without a target
    labels[1, 9] = -100           # a hole in the middle
    return ids, labels


def _reference(family):
    model = tiny_model(family)
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(rank, world, family, chunk):
    ref_loss, ref_grads = _reference(family)
    topo = init_topology(world)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    lm = CPCausalLM(model, loss_chunk_size=chunk)
    ids, labels = _batch()
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    loss_sum, count = lm(**local)
    assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, family)
    if world == 4 and rank == 0:
        assert count == 0  # the edge case really happened: a rank whose targets are all masked


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "qwen3_moe"])  # qwen2: q/k/v biases
def test_cp_model_matches_unsplit(world, family):
    run_ranks(_check, world, family, 3)   # chunk of 3 tokens: several loss chunks per rank


def test_single_rank_path_matches_stock_hf():
    ref_loss, ref_grads = _reference("llama")
    topo = init_topology(1)
    model = enable_context_parallel(tiny_model("llama"), topo, backend="sdpa")
    ids, labels = _batch()
    loss_sum, count = CPCausalLM(model, loss_chunk_size=5)(**shard_batch({"input_ids": ids, "labels": labels}, topo))
    (loss_sum / count).backward()
    assert _rel(loss_sum / count, ref_loss) < RTOL
    for name, p in model.named_parameters():
        assert _rel(p.grad, ref_grads[name]) < RTOL, name
