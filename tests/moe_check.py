"""The check every MoE model test ends with: one CP x EP x DP step of this rank's share (cross-entropy + the
per-sequence balance loss), then the CP/DP-summed losses and every gradient against the unsplit reference; expert
gradients are summed over their EDP group and compared with this EP rank's slice of the reference. Also the unsplit
stock-HF reference of a family whose routers return (logits, weights, indices) (hf_moe_reference)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_reference import grads_of
from ds_ulysses_ext import CPCausalLM, shard_batch
from ds_ulysses_ext.moe import moe_blocks


def moe_batch(rows=4, S=13):
    """(input_ids, labels, attention_mask): a right-padded row and masked leading labels, over a 96-token vocab."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (rows, S), generator=g)
    mask = torch.ones(rows, S, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return ids, labels, mask


def hf_moe_reference(model, batch, coef, sigmoid=False):
    """(CE, balance loss, gradients) of CE + coef x the per-sequence balance loss, on the unsplit stock HF model.

    The balance loss is written out from HF's own routers (any router returning (logits, weights, indices): their
    choice, groups and all): f_e the sequence's share of routed slots on expert e (times E / k), P_e the mean over its
    real tokens of the softmax over E of the logits, or with `sigmoid` the sigmoids normalised over E (router.py)."""
    ids, labels, mask = batch
    routers = [layer.mlp.gate for layer in model.get_decoder().layers if hasattr(layer.mlp, "experts")]
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append((o[0], o[2]))) for r in routers]
    logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    B, S = mask.shape
    aux = 0.0
    for router_logits, top in seen:
        E = router_logits.shape[-1]
        scores = torch.sigmoid(router_logits.float()) if sigmoid else torch.softmax(router_logits.float(), -1)
        probs = (scores / scores.sum(-1, keepdim=True)).view(B, S, E)
        top = top.view(B, S, -1)
        for b in range(B):
            real = mask[b].bool()
            counts = torch.bincount(top[b][real].flatten(), minlength=E).float()
            aux = aux + (counts * E / (top.shape[-1] * real.sum()) * probs[b][real].mean(0)).sum()
    aux = aux / B
    (ce + coef * aux).backward()
    return ce.detach(), aux.detach(), grads_of(model)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_moe_split_matches(model, topo, batch, coef, ref_ce, ref_aux, ref_grads, num_experts, rtol):
    """batch: (input_ids, labels, attention_mask) of the whole global batch; returns the names checked."""
    ids, labels, mask = batch
    lm = CPCausalLM(model, loss_chunk_size=4)
    rows = ids.shape[0] // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    local = shard_batch({"input_ids": ids[mine], "labels": labels[mine], "attention_mask": mask[mine]}, topo)
    local["moe_token_mask"] = shard_batch({"input_ids": mask[mine]}, topo)["input_ids"]
    loss_sum, count = lm(**local)
    # the loss's token count and the number of sequences (each counted once across its CP group), over the world
    counts = torch.stack([count.double(), torch.tensor(float(rows) / topo.cp_size, dtype=torch.float64)])
    dist.all_reduce(counts)
    aux_share = lm.moe_aux_share
    (loss_sum / counts[0] + coef * aux_share / counts[1]).backward()
    totals = torch.stack([loss_sum.detach() / counts[0], aux_share.detach() / counts[1]]).double()
    dist.all_reduce(totals)
    assert _rel(totals[0], torch.as_tensor(ref_ce).double()) < rtol, ("ce", totals[0], ref_ce)
    assert _rel(totals[1], torch.as_tensor(ref_aux).double()) < rtol, ("aux", totals[1], ref_aux)
    El = num_experts // topo.ep_size
    experts = {id(p) for b in moe_blocks(model) for p in b.experts.parameters()}
    names = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:  # a VL model's frozen vision tower (integrate.py): no reference gradient either
            assert not ref_grads[name].any(), name
            names.add(name)
            continue
        grad, ref = p.grad.clone(), ref_grads[name]
        if id(p) in experts:
            dist.all_reduce(grad, group=topo.edp_group)
            ref = ref[topo.ep_rank * El:(topo.ep_rank + 1) * El]
        else:
            dist.all_reduce(grad)
        assert _rel(grad, ref) < rtol, (name, _rel(grad, ref))
        names.add(name)
    return names
