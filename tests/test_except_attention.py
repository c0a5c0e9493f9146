"""memory.recompute=except_attention: exact, never re-runs the kept attention, keeps what docs/memory.md says.

The policy's rows in test_memory.py's tables cover exactness with removal, saved bytes, the all-to-all
counts at cp=2 and one ZeRO-3 step at cp=2; this file covers what is particular to it.
"""
import pytest
import torch

from configs.memory import MemoryConfig
from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.memory import ExceptAttentionRecompute, ProbeResult, build_memory_policies
from policy_helpers import (LAYERS, RTOL, _assert_close_dicts, _batch, _count_kept, _lm, _rel, _run,
                            _saved_bytes)
from tiny_models import tiny_model


def _count_attention_calls(lm, monkeypatch):
    import ds_ulysses_ext.integrate as integrate
    calls = [0]
    real = integrate.ulysses_attention

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(integrate, "ulysses_attention", counting)
    return calls


@pytest.mark.parametrize("full_layers, backward_calls", [(0, 0), (1, 1), (LAYERS, LAYERS)])
def test_except_attention_never_reruns_the_kept_attention(monkeypatch, full_layers, backward_calls):
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    policy = ExceptAttentionRecompute(full_layers).apply(lm.hf)
    calls = _count_attention_calls(lm, monkeypatch)
    norm_calls = []
    lm.hf.model.layers[0].input_layernorm.register_forward_hook(lambda *a: norm_calls.append(1))
    loss_sum, _ = lm(**local)
    assert calls[0] == LAYERS and len(norm_calls) == 1
    loss_sum.backward()
    assert calls[0] == LAYERS + backward_calls, calls  # only the layers recomputed whole re-run attention
    assert len(norm_calls) == 2                         # while every layer's other work is recomputed
    policy.remove()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_moe"])
def test_except_attention_is_exact_for_other_families(family):
    # Qwen3's q/k norms, Qwen2's projection biases and Qwen3-MoE's routed experts all sit in the recompute
    topo = init_topology(1)
    lm = CPCausalLM(enable_context_parallel(tiny_model(family, num_hidden_layers=2), topo, backend="sdpa"),
                    loss_chunk_size=5)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    ref_loss, ref_grads = _run(lm, local)
    policy = ExceptAttentionRecompute().apply(lm.hf)
    loss, grads = _run(lm, local)
    policy.remove()
    assert _rel(loss, ref_loss) < RTOL
    _assert_close_dicts(grads, ref_grads, (family,))


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "attention_offload"])
def test_except_attention_two_forwards_before_one_backward(offload):
    # each layer call replays its own recorded attention (a DPO-style loss over two batches); with the offload,
    # each forward's tensors travel to the host and back once
    topo = init_topology(1)
    lm = _lm(topo)
    first = shard_batch(dict(zip(("input_ids", "labels"), _batch(13))), topo)
    second = shard_batch(dict(zip(("input_ids", "labels"), _batch(9))), topo)

    def two(lm):
        lm.zero_grad(set_to_none=True)
        (lm(**first)[0] - 0.5 * lm(**second)[0]).backward()
        return {n: p.grad.clone() for n, p in lm.named_parameters()}
    ref = two(lm)
    policy = ExceptAttentionRecompute(offload=offload).apply(lm.hf)
    got = two(lm)
    if offload:
        assert policy.offload.stats["offloaded"] == policy.offload.stats["reloaded"] == 2 * LAYERS
    policy.remove()
    _assert_close_dicts(got, ref, ("two forwards",))


def test_except_attention_refuses_other_attention_and_a_bypassed_kernel():
    model = tiny_model("llama", num_hidden_layers=LAYERS)  # stock sdpa attention
    with pytest.raises(ValueError, match="needs the 'ds_ulysses' attention.*enable_context_parallel"):
        ExceptAttentionRecompute().apply(model)
    assert not any("forward" in m.__dict__ for m in model.modules())  # a refused apply leaves no patch
    topo = init_topology(1)
    lm = _lm(topo)
    ExceptAttentionRecompute().apply(lm.hf)
    lm.hf.set_attn_implementation("sdpa")  # switched behind the policy's back
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    with pytest.raises(RuntimeError, match="never reached the ds_ulysses attention"):
        lm(**local)


def test_except_attention_budget_chooses_whole_layers_from_the_probe():
    topo = init_topology(1)
    lm = _lm(topo)
    cfg = MemoryConfig(recompute="except_attention", budget_gib=8.0)
    probe = ProbeResult(peak_none_gib=10.0, peak_full_gib=6.0, num_layers=LAYERS)  # 1 GiB per whole layer
    (policy,) = build_memory_policies(cfg, lm.hf, probe)
    assert isinstance(policy, ExceptAttentionRecompute) and policy.full_layers == 2
    cfg.budget_gib = 7.0  # a smaller budget: more layers recomputed whole
    assert build_memory_policies(cfg, lm.hf, probe)[0].full_layers == 3
    with pytest.raises(ValueError, match="needs the probe"):
        build_memory_policies(cfg, lm.hf, None)


def _record_outputs(pack):
    """Pass the tensors the except_attention records hold (no pack hook sees those) to pack."""
    import gc
    import ds_ulysses_ext.memory.except_attention as except_attention
    for obj in gc.get_objects():
        if isinstance(obj, except_attention._AttentionRecord):
            for out, _, _ in obj.outputs:
                pack(out)


def _kept_bytes_cp(rank, world, expected_per_token_per_layer):
    import ds_ulysses_ext.memory.except_attention as except_attention
    except_attention._keep = _count_kept  # this forked rank only
    topo = init_topology(world)
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(0))
    local = shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
    saved = {}
    for layers in (2, 4):
        hf = enable_context_parallel(tiny_model("llama", num_hidden_layers=layers), topo, backend="sdpa")
        lm = CPCausalLM(hf, loss_chunk_size=16)
        ExceptAttentionRecompute().apply(lm.hf)
        saved[layers] = _saved_bytes(lm, local, also=_record_outputs)
    assert saved[4] - saved[2] == 2 * (64 // world) * expected_per_token_per_layer * 4, (world, saved)


@pytest.mark.parametrize("world, values", [(1, 32 + 64 + 16 + 16 + 64 + 8),
                                           (2, 32 + 64 + 16 + 16 + 64 + 8 + 64)])
def test_except_attention_memory_per_token_per_layer(world, values):
    # per local token per layer, fp32: the layer input 32, q 64, k 16, v 16, out 64, logsumexp 8; at cp > 1 the
    # recorded output in sequence layout is a tensor of its own, +64 (docs/memory.md); at cp = 1 it is a view
    run_ranks(_kept_bytes_cp, world, values)


# ---------------------------------------------------------------- memory.attention_offload: the kept tensors on the host
def _offload_cases():
    from ds_ulysses_ext.memory import OffloadActivations, TiledMLP
    return {  # name -> (policies, layers whose attention is kept and so offloaded)
        "alone": (lambda: [ExceptAttentionRecompute(offload=True)], LAYERS),
        # one layer recomputed whole, the MLP in tiles, the layer inputs offloaded too
        "full1_tiled_offload": (lambda: [ExceptAttentionRecompute(1, offload=True), TiledMLP(4),
                                         OffloadActivations(min_bytes=0)], LAYERS - 1),
    }


def _trace_loads(policy):
    """A list that gets ("begin" | "prefetch" | "on_demand", the stash's forward position) in backward's order."""
    from ds_ulysses_ext.memory.attention_offload import AttentionStash
    offload, trace = policy.offload, []
    position = lambda stash: [ref() for ref in offload._order].index(stash)
    real_begin, real_load = AttentionStash.begin_backward, AttentionStash.load

    def begin(stash):
        if stash.on_host and not stash.begun:
            trace.append(("begin", position(stash)))
        real_begin(stash)

    def load(stash, prefetch):
        trace.append(("prefetch" if prefetch else "on_demand", position(stash)))
        real_load(stash, prefetch)
    return trace, begin, load


def _check_offload_step(lm, local, make, kept, normaliser, monkeypatch, ref=None):
    """One step with the policies: (loss, grads); checks the offload's counts and its one-layer-ahead order."""
    from ds_ulysses_ext.memory import remove_all
    from ds_ulysses_ext.memory.attention_offload import AttentionStash
    policies = [p.apply(lm.hf) for p in make()]
    trace, begin, load = _trace_loads(policies[0])
    monkeypatch.setattr(AttentionStash, "begin_backward", begin)
    monkeypatch.setattr(AttentionStash, "load", load)
    stats = policies[0].offload.stats
    lm.zero_grad(set_to_none=True)
    loss_sum, _ = lm(**local)
    stashes = [ref() for ref in policies[0].offload._order]
    # after forward: one stash per kept layer, each on the host, no device copy held by the stash
    assert len(stashes) == kept and stats["offloaded"] == kept and stats["reloaded"] == 0, stats
    assert all(s.on_host and all(sp.source is None and sp.loaded is None for sp in s.spans) for s in stashes)
    (loss_sum / normaliser).backward()
    # backward: each stash came back once and was dropped once every saved tensor was rebuilt; the deepest on
    # demand, every other one prefetched when the layer above it began its backward
    assert (stats["reloaded"], stats["released"], stats["loaded_on_demand"], stats["prefetched"]) == (
        kept, kept, 1, kept - 1), stats
    expected = [("begin", kept - 1), ("on_demand", kept - 1)]
    for i in range(kept - 2, -1, -1):
        expected += [("prefetch", i), ("begin", i)]
    assert trace == expected, trace
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    _check_offloaded_bytes.stats = dict(stats)
    remove_all(policies)
    monkeypatch.undo()
    return (loss_sum / normaliser).detach(), grads


@pytest.mark.parametrize("case", ["alone", "full1_tiled_offload"])
def test_attention_offload_is_exact_and_moves_each_layer_once(case, monkeypatch):
    topo = init_topology(1)
    lm = _lm(topo)
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    ref_loss, ref_grads = _run(lm, local)
    make, kept = _offload_cases()[case]
    count = local["labels"].ne(-100).sum()
    loss, grads = _check_offload_step(lm, local, make, kept, count, monkeypatch)
    assert _rel(loss, ref_loss) < RTOL
    _assert_close_dicts(grads, ref_grads, (case,))
    _check_offloaded_bytes(lm, local, kept, 1)


def _offload_at_cp(rank, world, ring):
    import torch.distributed as dist
    from _pytest.monkeypatch import MonkeyPatch
    from ds_ulysses_ext import shift_labels
    topo = init_topology(world, ring_size=ring)
    assert topo.ring_size == ring
    ids, labels = _batch(seq_len=26)
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    count = (shift_labels(labels) != -100).sum()  # the global normaliser, known on every rank
    lm = _lm(topo)
    ref_loss, ref_grads = _run(lm, local, normaliser=count)
    real = dist.all_to_all_single
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch = MonkeyPatch()
    for name, (make, kept) in _offload_cases().items():
        dist.all_to_all_single = counting
        calls[0] = 0
        try:
            loss, grads = _check_offload_step(lm, local, make, kept, count, monkeypatch)
        finally:
            dist.all_to_all_single = real
        # the offload adds no exchange: whatever ran before (Ulysses, ring) runs as often as without it
        per_layer = 6 if ring == 1 else (0 if world == ring else 6)
        assert calls[0] == per_layer * LAYERS + per_layer // 2 * (LAYERS - kept), (name, calls[0])
        assert _rel(loss, ref_loss) < RTOL, (name, rank)
        _assert_close_dicts(grads, ref_grads, (name, rank, world, ring))
        _check_offloaded_bytes(lm, local, kept, world // ring)


def _check_offloaded_bytes(lm, local, kept, ulysses):
    """What the last step moved is what engine/observe/host_memory.py's start-up estimate counts (fp32 here)."""
    from engine.observe.host_memory import attention_bytes_per_token
    stats = _check_offloaded_bytes.stats
    per_token = attention_bytes_per_token(lm.hf.config, 4, ulysses)
    assert stats["offloaded_bytes"] == kept * local["input_ids"].numel() * per_token, (stats, per_token)


@pytest.mark.parametrize("world, ring", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_attention_offload_is_exact_at_cp_and_with_the_ring(world, ring):
    run_ranks(_offload_at_cp, world, ring)
