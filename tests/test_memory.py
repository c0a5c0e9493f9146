"""Memory policies (recompute, offload, tiled MLP) change memory, never the numbers (docs/design.md).

- single process: every policy's loss and gradients equal the no-policy model's (fp32, rel 1e-5),
  remove() restores the model bit for bit, and the policies do keep fewer saved bytes;
- cp=2, plain autograd: forward and backward issue the all-to-alls each policy promises
  (selective recompute never re-exchanges; full/block re-exchange only in recomputed layers);
- cp=2 under ZeRO-3: one SGD step with each policy gives the loss, gradients and updated weights of
  no policy, which gives those of the unsplit single-process step;
- the budget decision function on hand-written probe numbers.
"""
import glob
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from configs.memory import MemoryConfig
from dist_harness import patch_deepspeed_shm_build, run_ranks
from ds_ulysses_ext import init_topology, shard_batch, shift_labels
from ds_ulysses_ext.memory import (BlockRecompute, BudgetRecompute, ExceptAttentionRecompute, FullRecompute,
                                   NoRecompute,
                                   OffloadActivations, ProbeResult, SelectiveRecompute, TiledMLP,
                                   allocator_env, apply_memory_policies, build_memory_policies,
                                   choose_recompute_layers, measure_probe, memory_report, remove_all)
from policy_helpers import (LAYERS, RTOL, _assert_close_dicts, _batch, _count_kept, _lm, _rel, _run,
                            _saved_bytes)
from tiny_models import tiny_model

TILE = 4      # tokens per MLP tile: the tiny batches below make 7 or 8 tiles per rank
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (policies in application order, modules whose forward is patched)
LAYER = "hf.model.layers.{}"
NORMS = [f"{LAYER.format(i)}.{n}" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")]
MLPS = [f"{LAYER.format(i)}.mlp" for i in range(LAYERS)]
PROBE = ProbeResult(peak_none_gib=10.0, peak_full_gib=6.0, num_layers=LAYERS)  # 1 GiB per recomputed layer
CASES = {
    "none": (lambda: [NoRecompute()], []),
    "full": (lambda: [FullRecompute()], [LAYER.format(i) for i in range(LAYERS)]),
    "block_uniform": (lambda: [BlockRecompute(2, "uniform")], [LAYER.format(0), LAYER.format(2)]),
    "block_block": (lambda: [BlockRecompute(2, "block")], [LAYER.format(0), LAYER.format(1)]),
    "selective": (lambda: [SelectiveRecompute()], NORMS + ["hf.model.norm"] + MLPS),
    "budget": (lambda: [BudgetRecompute(7.5, PROBE)], [LAYER.format(0), LAYER.format(1), LAYER.format(2)]),
    "offload": (lambda: [OffloadActivations(min_bytes=0)], ["hf.model"]),
    # a host cap that the first layers' inputs reach (3,328 bytes each here): the later ones stay on the device
    "full_offload_capped": (lambda: [FullRecompute(), OffloadActivations(min_bytes=0, max_host_bytes=7000)],
                            [LAYER.format(i) for i in range(LAYERS)] + ["hf.model"]),
    "tiled": (lambda: [TiledMLP(TILE)], MLPS),
    "block_offload_tiled": (lambda: [BlockRecompute(2, "uniform"), TiledMLP(TILE), OffloadActivations(min_bytes=0)],
                            [LAYER.format(0), LAYER.format(2), "hf.model"] + MLPS),
    "selective_offload_tiled": (lambda: [SelectiveRecompute(), TiledMLP(TILE), OffloadActivations(min_bytes=0)],
                                NORMS + ["hf.model.norm", "hf.model"] + MLPS),
    "selective_block_tiled": (lambda: [SelectiveRecompute(), BlockRecompute(2, "uniform"), TiledMLP(TILE)],
                              NORMS + ["hf.model.norm", LAYER.format(0), LAYER.format(2)] + MLPS),
    "except_attention": (lambda: [ExceptAttentionRecompute()], [LAYER.format(i) for i in range(LAYERS)]),
    "except_attention_full2_tiled_offload": (
        lambda: [ExceptAttentionRecompute(2, "uniform"), TiledMLP(TILE), OffloadActivations(min_bytes=0)],
        [LAYER.format(i) for i in range(LAYERS)] + ["hf.model"] + MLPS),
    # memory.attention_offload: the kept attention tensors on the host too (tests/test_except_attention.py has more)
    "except_attention_offload_tiled": (lambda: [ExceptAttentionRecompute(offload=True), TiledMLP(TILE)],
                                       [LAYER.format(i) for i in range(LAYERS)] + MLPS),
}


def _patched(lm):
    return sorted(n for n, m in lm.named_modules() if "forward" in m.__dict__)


def _snapshot(lm):
    return {n: (sorted(m.__dict__), m.__dict__.get("forward"), len(m._forward_pre_hooks), len(m._forward_hooks))
            for n, m in lm.named_modules()}


# ---------------------------------------------------------------- single process: exact and removable
@pytest.mark.parametrize("case", list(CASES))
def test_policy_is_exact_and_removable(case):
    make, patched = CASES[case]
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    ref_loss, ref_grads = _run(lm, local)
    before = _snapshot(lm)  # after a forward: what CPCausalLM's own forward records is no policy's patch

    policies = [p.apply(lm.hf) for p in make()]
    assert _patched(lm) == sorted(patched)
    loss, grads = _run(lm, local)
    assert _rel(loss, ref_loss) < RTOL
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < RTOL, (name, _rel(g, ref_grads[name]))

    remove_all(policies)
    assert _snapshot(lm) == before
    loss, grads = _run(lm, local)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def test_policies_keep_fewer_saved_bytes(monkeypatch):
    # except_attention keeps the attention's tensors under its own (innermost) hooks: count them too
    import ds_ulysses_ext.memory.except_attention as except_attention
    monkeypatch.setattr(except_attention, "_keep", lambda t: _count_kept(t))
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch(seq_len=64))), topo)
    saved = {}
    for case in ("none", "full", "block_uniform", "selective", "tiled", "except_attention"):
        policies = [p.apply(lm.hf) for p in CASES[case][0]()]
        saved[case] = _saved_bytes(lm, local)
        remove_all(policies)
    assert saved["full"] < saved["block_uniform"] < saved["none"], saved
    assert saved["selective"] < saved["none"], saved
    assert saved["tiled"] < saved["none"], saved
    assert saved["full"] < saved["except_attention"] < saved["selective"], saved


def test_offload_moves_activations_not_parameters():
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    policy = OffloadActivations(min_bytes=1024).apply(lm.hf)
    _run(lm, local)
    assert policy.stats["offloaded"] > 0 and policy.stats["kept_params"] > 0 and policy.stats["kept_small"] > 0
    policy.remove()


def test_offload_host_cap_keeps_the_deepest_saved_tensors_on_the_device():
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    free = FullRecompute().apply(lm.hf)  # what is saved is the layer inputs, one per layer
    uncapped = OffloadActivations(min_bytes=0).apply(lm.hf)
    _run(lm, local)
    cap = uncapped.stats["offloaded_bytes"] // 2
    uncapped.remove()
    capped = OffloadActivations(min_bytes=0, max_host_bytes=cap).apply(lm.hf)
    packed_in_order = []
    pack = capped._pack
    capped._pack = lambda t: packed_in_order.append(pack(t)) or packed_in_order[-1]
    _run(lm, local)
    assert 0 < capped.stats["offloaded_bytes"] <= cap and capped.stats["kept_over_cap"] > 0, capped.stats
    assert capped.stats["offloaded"] + capped.stats["kept_over_cap"] == uncapped.stats["offloaded"], capped.stats
    moved = [not isinstance(p, torch.Tensor) for p in packed_in_order if not _is_param_like(p)]
    assert moved == sorted(moved, reverse=True), moved  # offloaded first, kept after: never interleaved
    capped.remove()
    free.remove()


def _is_param_like(p):
    return isinstance(p, torch.nn.Parameter) or hasattr(p, "ds_id")


def test_tiled_mlp_runs_tiles_and_accumulates_each_weight_once():
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)  # 2 x 13 = 26 tokens: 7 tiles
    policy = TiledMLP(TILE).apply(lm.hf)
    mlp = lm.hf.model.layers[1].mlp
    rows, accumulations = [], {}
    mlp.gate_proj.register_forward_hook(lambda m, i, out: rows.append(out.shape[0]))
    for name, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulations.__setitem__(
            name, accumulations.get(name, 0) + 1))
    loss_sum, _ = lm(**local)
    assert len(rows) == 7 and max(rows) <= TILE and sum(rows) == 26, rows
    loss_sum.backward()
    assert len(rows) == 14 and max(rows) <= TILE, rows  # backward rebuilt one tile at a time
    # every tile's weight gradient entered the same AccumulateGrad node, which fired once
    assert accumulations == {n: 1 for n, _ in mlp.named_parameters()}, accumulations
    policy.remove()


def test_wrong_order_is_refused_and_leaves_no_patch():
    topo = init_topology(1)
    lm = _lm(topo)
    before = _snapshot(lm)
    tiled = TiledMLP(TILE).apply(lm.hf)
    with pytest.raises(RuntimeError, match="before any policy that patches"):
        SelectiveRecompute().apply(lm.hf)  # would bypass the tiling silently
    assert _patched(lm) == sorted(MLPS)    # the failed apply undid its own norm patches
    inner, outer = OffloadActivations().apply(lm.hf), OffloadActivations().apply(lm.hf)
    with pytest.raises(RuntimeError, match="reverse order"):
        inner.remove()                     # would drop the outer wrapper with it
    remove_all([tiled, inner, outer])
    assert _snapshot(lm) == before


# ---------------------------------------------------------------- budget decision
def test_choose_recompute_layers_from_recorded_probe(caplog):
    # recorded by hand: a 16-layer model whose step peaks at 118.4 GiB without and 46.0 GiB with full recompute
    probe = ProbeResult(peak_none_gib=118.4, peak_full_gib=46.0, num_layers=16)  # 4.525 GiB per layer
    assert choose_recompute_layers(probe, 130.0) == 0
    assert choose_recompute_layers(probe, 118.4) == 0
    assert choose_recompute_layers(probe, 100.0) == 5    # 18.4 / 4.525 = 4.07 -> 5
    assert choose_recompute_layers(probe, 118.4 - 4 * 4.525) == 4  # an exact fit costs no extra layer
    assert choose_recompute_layers(probe, 60.0) == 13
    assert choose_recompute_layers(probe, 46.0) == 16
    budgets = [30 + 0.25 * i for i in range(400)]
    chosen = [choose_recompute_layers(probe, b) for b in budgets]
    assert all(a >= b for a, b in zip(chosen, chosen[1:]))  # smaller budget -> at least as many layers
    assert all(0 <= n <= 16 for n in chosen)
    for b, n in zip(budgets, chosen):  # the smallest N whose predicted peak fits
        if b >= 46.0:
            assert 118.4 - n * 4.525 <= b + 1e-9 and (n == 0 or 118.4 - (n - 1) * 4.525 > b)
    with caplog.at_level(logging.WARNING):
        assert choose_recompute_layers(probe, 40.0) == 16
    assert "will not fit" in caplog.text


def test_budget_policy_applies_uniform_blocks_or_falls_back_to_full():
    topo = init_topology(1)
    lm = _lm(topo)
    policy = BudgetRecompute(8.0, PROBE).apply(lm.hf)  # (10 - 8) / 1 GiB -> 2 layers, uniform: 0 and 2
    assert policy.num_layers == 2 and _patched(lm) == [LAYER.format(0), LAYER.format(2)]
    policy.remove()
    assert measure_probe(lambda: None, lm.hf) is None  # CPU: nothing to measure
    policy = BudgetRecompute(8.0, None).apply(lm.hf)
    assert policy.num_layers == LAYERS
    policy.remove()
    assert _patched(lm) == []


# ---------------------------------------------------------------- config, allocator, report
@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(ROOT, "hydra_conf", "memory", "*.yaml"))))
def test_every_memory_preset_builds_and_applies(preset):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MemoryConfig), OmegaConf.load(preset)))
    topo = init_topology(1)
    lm = _lm(topo)
    kinds = [type(p).__name__ for p in build_memory_policies(cfg, lm.hf)]
    expected = {"none": "NoRecompute", "full": "FullRecompute", "block": "BlockRecompute",
                "selective": "SelectiveRecompute", "budget": "BudgetRecompute",
                "except_attention": "ExceptAttentionRecompute"}[cfg.recompute]
    assert kinds == (["SelectiveRecompute"] * cfg.selective_kept + [expected] + ["TiledMLP"] * cfg.tiled_mlp
                     + ["OffloadActivations"] * cfg.offload_activations)
    before = _snapshot(lm)
    policies = apply_memory_policies(lm.hf, cfg)
    assert (getattr(policies[0], "offload", None) is not None) == cfg.attention_offload
    remove_all(policies)
    assert _snapshot(lm) == before


def test_both_offloads_share_one_host_link_with_the_configured_bound():
    # one bound on the device memory waiting for host copies, not one per offload: two links of 2 GiB each left
    # up to 4 GiB reserved above the allocated peak on an H200 (docs/benchmarks.md BE)
    cfg = MemoryConfig(recompute="except_attention", attention_offload=True, offload_activations=True,
                       offload_inflight_gib=0.75)
    lm = _lm(init_topology(1))
    recompute, offload = build_memory_policies(cfg, lm.hf)
    assert recompute.offload.link is offload._link
    assert offload._link.max_inflight_bytes == int(0.75 * 2**30)
    (alone,) = build_memory_policies(MemoryConfig(recompute="except_attention", attention_offload=True), lm.hf)
    assert alone.offload.link.max_inflight_bytes == 512 << 20  # the default


def test_allocator_env_and_memory_report():
    assert allocator_env(MemoryConfig(expandable_segments=True), current="") == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_env(MemoryConfig(expandable_segments=False), current="") == {}
    assert allocator_env(MemoryConfig(), current="max_split_size_mb:512") == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    assert allocator_env(MemoryConfig(), current="expandable_segments:False") == {}  # the user's choice wins
    assert memory_report("cpu") == {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0}


# ---------------------------------------------------------------- cp=2: all-to-alls per policy
A2A_CASES = {  # name -> (policies, all-to-alls in backward); forward always issues 3 per layer
    "none": (lambda: [], 3 * LAYERS),
    "full": (lambda: [FullRecompute()], 6 * LAYERS),            # recompute re-exchanges every layer
    "block_uniform": (lambda: [BlockRecompute(2, "uniform")], 3 * LAYERS + 3 * 2),
    "selective": (lambda: [SelectiveRecompute()], 3 * LAYERS),  # only the 3 adjoints per layer
    "tiled_offload": (lambda: [TiledMLP(TILE), OffloadActivations(min_bytes=0)], 3 * LAYERS),
    "except_attention": (lambda: [ExceptAttentionRecompute()], 3 * LAYERS),  # attention is never re-run
    "except_attention_full2": (lambda: [ExceptAttentionRecompute(2, "block"), TiledMLP(TILE)], 3 * LAYERS + 3 * 2),
    "except_attention_offload": (lambda: [ExceptAttentionRecompute(offload=True)], 3 * LAYERS),
}


def _all_to_all_counts(rank, world):
    topo = init_topology(world)
    ids, labels = _batch(seq_len=26)
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    count = (shift_labels(labels) != -100).sum()  # the global normaliser, known on every rank
    real = dist.all_to_all_single
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    ref_grads = None
    for name, (make, backward_calls) in A2A_CASES.items():
        lm = _lm(topo)
        policies = [p.apply(lm.hf) for p in make()]
        dist.all_to_all_single = counting
        try:
            calls[0] = 0
            loss_sum, _ = lm(**local)
            forward_calls = calls[0]
            calls[0] = 0
            (loss_sum / count).backward()
        finally:
            dist.all_to_all_single = real
        assert (forward_calls, calls[0]) == (3 * LAYERS, backward_calls), (name, forward_calls, calls[0])
        grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        ref_grads = ref_grads or grads
        for n, g in grads.items():
            assert _rel(g, ref_grads[n]) < RTOL, (name, n)
        remove_all(policies)


def test_all_to_all_counts_per_policy_at_cp2():
    run_ranks(_all_to_all_counts, 2)


def _tile_counts_agree(rank, world):
    topo = init_topology(1)  # dp=2: ranks may hold batches of different lengths
    lm = _lm(topo)
    policy = TiledMLP(TILE).apply(lm.hf)
    rows = []
    lm.hf.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, out: rows.append(out.shape[0]))
    seq_len = (5, 13)[rank]  # 10 or 26 tokens: 3 or 7 tiles of at most 4 on its own
    lm(**shard_batch(dict(zip(("input_ids", "labels"), _batch(seq_len))), topo))
    assert policy.agreed_tiles == 7 and len(rows) == 7 and max(rows) <= TILE, (rank, policy.agreed_tiles, rows)
    policy.remove()


def test_tiled_mlp_tile_count_is_agreed_across_ranks():
    run_ranks(_tile_counts_agree, 2)


# ---------------------------------------------------------------- cp=2 under ZeRO-3: one SGD step
ZERO3_CASES = {  # name -> (policies, sequence lengths); 26 gives 13 local tokens per sample, 32 gives 16
    "none": (lambda: [], (26, 32)),
    "full": (lambda: [FullRecompute()], (26,)),
    "block_block": (lambda: [BlockRecompute(2, "block")], (26,)),
    "selective": (lambda: [SelectiveRecompute()], (26,)),
    "offload": (lambda: [OffloadActivations(min_bytes=0)], (26,)),
    "full_offload_capped": (lambda: [FullRecompute(), OffloadActivations(min_bytes=0, max_host_bytes=7000)], (26,)),
    "tiled": (lambda: [TiledMLP(TILE)], (26, 32)),
    "block_offload_tiled": (lambda: [BlockRecompute(2, "uniform"), TiledMLP(TILE), OffloadActivations(min_bytes=0)],
                            (26, 32)),
    "selective_block_tiled": (lambda: [SelectiveRecompute(), BlockRecompute(2, "uniform"), TiledMLP(TILE)], (26,)),
    "except_attention": (lambda: [ExceptAttentionRecompute()], (26, 32)),
    "except_attention_full1_tiled_offload": (
        lambda: [ExceptAttentionRecompute(1), TiledMLP(TILE), OffloadActivations(min_bytes=0)], (26,)),
    "except_attention_offload_tiled": (lambda: [ExceptAttentionRecompute(1, offload=True), TiledMLP(TILE)], (26,)),
}
LR = 0.1


def _unsplit_reference(seq_len):
    """The single-process reference: stock HF, mean token loss over the global batch, one SGD step."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    ids, labels = _batch(seq_len)
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                    ignore_index=-100).backward()
    grads = {"hf." + n: p.grad for n, p in model.named_parameters()}
    weights = {"hf." + n: p.detach() - LR * p.grad for n, p in model.named_parameters()}
    return grads, weights


def _zero3_step(topo, make, seq_len):
    """(global loss, full gradients after backward, full weights after step) of one ZeRO-3 step at cp."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    lm = _lm(topo)
    policies = [p.apply(lm.hf) for p in make()]
    engine, *_ = deepspeed.initialize(
        model=lm, optimizer=torch.optim.SGD(lm.parameters(), lr=LR), mpu=topo,
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                "zero_allow_untested_optimizer": True, "sequence_parallel_size": topo.cp_size,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids, labels = _batch(seq_len)
    loss_sum, count = engine(**shard_batch({"input_ids": ids, "labels": labels}, topo))
    global_count = count.clone()
    dist.all_reduce(global_count)
    # ZeRO-3's reduce-scatter averages gradients over all dp*cp ranks: scale the share back up
    engine.backward(loss_sum / global_count * topo.world_size, scale_wrt_gas=False)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    engine.step()
    loss = (loss_sum / global_count).detach()
    dist.all_reduce(loss)
    offload = [p for p in policies if isinstance(p, OffloadActivations)]
    if offload:  # parameters were seen by the pack hook and left alone
        assert offload[0].stats["kept_params"] > 0 and offload[0].stats["offloaded"] > 0
    return loss, grads, {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def _zero3_steps(rank, world):
    patch_deepspeed_shm_build()
    topo = init_topology(world)
    baseline = {}
    for name, (make, seq_lens) in ZERO3_CASES.items():
        for seq_len in seq_lens:
            loss, grads, weights = _zero3_step(topo, make, seq_len)
            if name == "none":  # the no-policy run is itself the unsplit single-process step
                ref_grads, ref_weights = _unsplit_reference(seq_len)
                _assert_close_dicts(grads, ref_grads, ("unsplit grad", seq_len))
                _assert_close_dicts(weights, ref_weights, ("unsplit weight", seq_len))
                baseline[seq_len] = loss, grads, weights
                continue
            base_loss, base_grads, base_weights = baseline[seq_len]
            assert _rel(loss, base_loss) < RTOL, (name, seq_len)
            # gradients are the sensitive check: an SGD update is ~1e-4 of a weight, below fp32 weight resolution
            _assert_close_dicts(grads, base_grads, (name, "grad", seq_len))
            _assert_close_dicts(weights, base_weights, (name, "weight", seq_len))


def test_zero3_cp2_step_with_each_policy_matches_no_policy():
    run_ranks(_zero3_steps, 2)


def test_engine_builds_the_budget_policy_from_config_probe_numbers():
    # engine/ds/build.py turns memory.probe_*_gib into a ProbeResult: 4 layers, 40 GiB without recompute, 8 with
    # full recompute, so 8 GiB saved per recomputed layer; a 25 GiB budget needs ceil((40-25)/8) = 2 layers
    from configs import compose_config
    from engine.ds.build import _apply_memory
    cfg = compose_config(["memory=budget", "memory.budget_gib=25", "memory.probe_none_gib=40",
                          "memory.probe_full_gib=8"])
    lm = _lm(init_topology(1))
    policies = _apply_memory(lm.hf, cfg)
    assert policies[0].num_layers == 2
    remove_all(policies)
