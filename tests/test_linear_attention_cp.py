"""Models with linear-attention layers under CP (ds_ulysses_ext/linear_attention, docs/linear_attention.md):
Qwen3.5 / 3.6 text (`qwen3_5_text`, `qwen3_5_moe_text`), Qwen3-Next and Ling-3.0 (`bailing_hybrid`, KDA layers).

Whole tiny models (tests/tiny_models.py LINEAR_FAMILIES: layers linear, full, linear; 2 key / 4 value heads of dims
8 / 6) at cp 2 and 4 against the unsplit stock HF model: loss and every parameter's gradient, fp32, rel 1e-5
(cp_check.RTOL). cp 4 copies each of Qwen's 2 key heads to 2 ranks. Packed rows against each document run alone
(HF's torch path does not reset the conv and the state at a document start, so its own packed row is checked to
differ). The MoE families through our block at cp 2 x ep 2 against HF's routers (cross-entropy + the per-sequence
balance loss). One launch per world size runs every case. The delta rule, the document rows, the head split and the
refusals are checked on one process.
"""
import pytest
import torch
import torch.nn.functional as F

from autograd_graph import graph_ops
from cp_check import RTOL, assert_share_matches_unsplit, rel
from cp_reference import cp_loss_and_grads
from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, hf_moe_reference, moe_batch
from test_packing import packed_batch, reference_packed_row, reference_per_document
from tiny_models import LINEAR_FAMILIES, tiny_config, tiny_model
from ds_ulysses_ext import CPCausalLM, Topology, UnsupportedError, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.linear_attention.delta_rule import chunked_delta_rule, recurrent_delta_rule
from ds_ulysses_ext.linear_attention.documents import per_document
from ds_ulysses_ext.linear_attention.heads import conv_channels, local_heads
from ds_ulysses_ext.models import check_model_config
from ds_ulysses_ext.moe import moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel

FAMILIES = list(LINEAR_FAMILIES)
MOE_FAMILIES = ["qwen3_5_moe_text", "qwen3_next", "bailing_hybrid"]
COEF = 0.1  # the balance loss's weight: large, so a wrong router gradient shows
E = 8


def _batch():
    # 13 tokens: neither 2 nor 4 divides it (the cp pads); masked labels up front and a hole. The fp32 floor of these
    # models' gradients is not far below the tolerance: stock HF's own fp32 gradients are 4-9e-6 from an fp64 run, and
    # the worst CP-vs-HF figure over the cases here is 4.7e-6 with this batch (seed 2), 1.1e-5 with seed 3's (at cp 4, a
    # conv gradient of a key head copied to two ranks, whose partial sums cancel; the same split in fp64: 2e-7)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 9] = -100
    return ids, labels


def _reference(family):
    model = tiny_model(family)
    ids, labels = _batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_case(family, world):
    ref_loss, ref_grads = _reference(family)
    topo = init_topology(world)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    ids, labels = _batch()
    loss_sum, count = CPCausalLM(model, loss_chunk_size=3)(**shard_batch({"input_ids": ids, "labels": labels}, topo))
    assert set(dict(model.named_parameters())) == set(ref_grads)
    assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, (family, world))


def _packed_case(family, world):
    """Against each document alone; HF's own packed row, which carries the conv and the state across documents, is
    another function (its premise: it differs by far more than the tolerance)."""
    ref_loss, ref_grads = reference_per_document(family)
    row_loss, _ = reference_packed_row(family)
    assert rel(row_loss, ref_loss) > 10 * RTOL, "HF's packed row matches the documents alone: nothing to reset?"
    topo = init_topology(world)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    loss, grads = cp_loss_and_grads(model, topo, packed_batch())
    assert rel(loss, ref_loss) < RTOL, (family, world, loss, ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL, (family, world, name, rel(g, ref_grads[name]))


def _moe_case(family, world, ep):
    # stock HF, the balance loss written out from its own routers' choice (Ling's: DeepSeek-V3's sigmoid router with
    # the selection bias and groups; Qwen's: softmax)
    ref = hf_moe_reference(tiny_model(family), moe_batch(), COEF, sigmoid=family == "bailing_hybrid")
    topo = init_topology(world, ep_size=ep)
    model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    blocks = moe_blocks(model)
    assert len(blocks) == (2 if family == "bailing_hybrid" else 3)  # Ling's first layer dense
    names = assert_moe_split_matches(model, topo, moe_batch(), COEF, *ref, E, RTOL)
    assert names == set(ref[2]), family  # every parameter of the reference, the shared expert gate included


def _world_2(rank, world):
    for family in FAMILIES:
        _cp_case(family, world)
        _packed_case(family, world)
    for family in MOE_FAMILIES:
        _moe_case(family, world, 2)


def _world_4(rank, world):
    for family in FAMILIES:
        _cp_case(family, world)
    _packed_case("qwen3_5_text", world)  # with the key heads copied
    _moe_case("qwen3_next", world, 2)  # cp 4 x ep 2: dp 1, every expert shard twice


def test_cp2_matches_unsplit_hf():
    run_ranks(_world_2, 2)


def test_cp4_matches_unsplit_hf():
    run_ranks(_world_4, 4)


def test_single_rank_path_matches_stock_hf():
    """cp=1: the bound forward (what the engine runs at every cp) on one process, and packed rows there."""
    for family in ("qwen3_5_text", "bailing_hybrid"):
        ref_loss, ref_grads = _reference(family)
        topo = Topology(1, 0, 1, 1)
        model = enable_context_parallel(tiny_model(family), topo, backend="sdpa")
        ids, labels = _batch()
        loss_sum, count = CPCausalLM(model, loss_chunk_size=5)(**shard_batch({"input_ids": ids, "labels": labels},
                                                                           topo))
        (loss_sum / count).backward()
        assert rel(loss_sum / count, ref_loss) < RTOL
        for name, p in model.named_parameters():
            assert rel(p.grad, ref_grads[name]) < RTOL, (family, name)
    ref_loss, ref_grads = reference_per_document("qwen3_next")
    model = enable_context_parallel(tiny_model("qwen3_next"), Topology(1, 0, 1, 1), backend="sdpa")
    loss, grads = cp_loss_and_grads(model, Topology(1, 0, 1, 1), packed_batch())
    assert rel(loss, ref_loss) < RTOL and all(rel(g, ref_grads[n]) < RTOL for n, g in grads.items())


# --- the pieces on one process ------------------------------------------------------------------------------------

def _rule_inputs(per_channel, S=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, S, 3, 8, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(2, S, 3, 6, generator=g, dtype=dtype)
    decay = -torch.rand(2, S, 3, *([8] if per_channel else []), generator=g, dtype=dtype) * 2
    beta = torch.rand(2, S, 3, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_delta_rule_is_the_recurrence(per_channel):
    """fp64: chunks of 8 and 16 over 37 tokens (a partial last chunk) against the token-by-token definition, values
    and every input's gradient; and against HF's own token-by-token torch references (fp32 inside: rel 1e-6)."""
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import recurrent_kimi_delta_attention
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    inputs = _rule_inputs(per_channel)
    ref = recurrent_delta_rule(*inputs)
    grads_ref = torch.autograd.grad(ref.sum(), inputs)
    for chunk in (8, 16):
        out = chunked_delta_rule(*inputs, chunk=chunk)
        assert rel(out, ref) < 1e-12, chunk
        for a, b in zip(torch.autograd.grad(out.sum(), inputs), grads_ref):
            assert rel(a, b) < 1e-10, chunk
    q, k, v, g, beta = inputs
    hf = recurrent_kimi_delta_attention if per_channel else torch_recurrent_gated_delta_rule
    hf_out = hf(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)[0]
    assert rel(ref, hf_out.double()) < 1e-6


def test_the_chunk_loop_backward_is_linear_in_the_chunks():
    # each chunk taken out of the whole tensors by indexing (SelectBackward / SliceBackward: a zero tensor of the
    # whole input per chunk in backward) made the backward quadratic in S (12.7x the time for 4x the tokens at 128k
    # on an H200); the chunks come from unbind, whose backward stacks them once. 37 tokens in chunks of 8: 5 chunks
    out = chunked_delta_rule(*_rule_inputs(False), chunk=8)
    ops = graph_ops(out)
    assert ops.count("UnbindBackward0") == 6, ops
    # outside the loop: the last chunk's cumulative decay (G[..., -1:]) and the padding cut off the output ([:S])
    assert ops.count("SelectBackward0") == 0 and ops.count("SliceBackward0") == 2, sorted(ops)


def test_documents_run_as_rows_of_their_own():
    """A causal running sum per document, through the bucketed rows (docs padded to multiples of 4: buckets of 4, 8
    and 12), against each document summed alone; gradients exact and zero for nothing."""
    cu = torch.tensor([0, 3, 8, 13, 14, 26], dtype=torch.int32)  # over 2 rows of 13: lengths 3 5 5 1 12
    x = torch.randn(2, 13, 2, dtype=torch.float64, requires_grad=True)
    out = per_document(lambda rows: rows.cumsum(1), [x], cu, multiple=4)
    flat = x.reshape(26, 2)
    ref = torch.cat([flat[a:b].cumsum(0) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]).reshape(2, 13, 2)
    assert torch.equal(out, ref)
    w = torch.randn(2, 13, 2, dtype=torch.float64)
    (gx,) = torch.autograd.grad((out * w).sum(), x)
    (gr,) = torch.autograd.grad((ref * w).sum(), x)
    assert torch.allclose(gx, gr)
    # the three buckets come from one gather (and go back through one): a gather per bucket would give each an
    # index_add over all 26 tokens in backward
    ops = graph_ops(out)
    assert ops.count("IndexSelectBackward0") == 2 and ops.count("SplitWithSizesBackward0") == 1, sorted(ops)


def test_each_rank_holds_its_heads_and_their_conv_channels():
    # 4 value heads reading 2 key heads (v head i reads key head i // 2), dk 2, dv 1: channels q 0-3 | k 4-7 | v 8-11
    assert [local_heads(4, 2, 2, r) for r in range(2)] == [([0], [0, 1]), ([1], [2, 3])]
    assert [local_heads(4, 2, 4, r) for r in range(4)] == [([0], [0]), ([0], [1]), ([1], [2]), ([1], [3])]
    assert conv_channels(4, 2, 2, 1, 2, 1) == [2, 3, 6, 7, 10, 11]
    assert conv_channels(4, 2, 2, 1, 4, 2) == [2, 3, 6, 7, 10]  # key head 1 copied to ranks 2 and 3
    assert conv_channels(4, 2, 2, 1, 1, 0) == list(range(12))


@pytest.mark.parametrize("family,overrides", [("qwen3_next", {}), ("qwen3_next", {"norm_topk_prob": False}),
                                               ("qwen3_5_moe_text", {}), ("bailing_hybrid", {})])
def test_our_block_is_hf_moe_block(family, overrides):
    """One MoE block, ours against HF's on the same weights (fp32, rel 1e-5): output and every gradient; HF's state
    dict loads into ours with nothing left over (the shared expert gate and the selection bias included)."""
    from ds_ulysses_ext.moe import MoEBlock
    from ds_ulysses_ext.moe.parallel import hf_moe_spec
    hf = tiny_model(family, **overrides).model.layers[1].mlp
    with torch.no_grad():  # routers and gates wide, so the choice and the shared expert's gate matter
        for p in hf.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    ours = MoEBlock(hf_moe_spec(tiny_config(family, **overrides)))
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out_hf, out = hf(x), ours(x2)
    assert rel(out, out_hf) < RTOL
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out_hf * w).sum().backward()
    (out * w).sum().backward()
    assert rel(x2.grad, x.grad) < RTOL
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, hf_params[name].grad) < RTOL, name


# --- refusals -----------------------------------------------------------------------------------------------------

def test_cp_that_splits_attention_but_not_the_linear_heads_is_refused():
    # full attention 8 / 2 heads splits over cp 8 (copies), the 4 linear value heads do not
    with pytest.raises(UnsupportedError, match=r"linear_num_value_heads / linear_num_key_heads = 4 / 2.*\[1, 2, 4\]"):
        check_model_config(tiny_config("qwen3_5_text"), 8)
    # 6 value heads reading 3 key heads: cp 2 splits the values, and the key heads neither split nor copy
    with pytest.raises(UnsupportedError, match=r"6 / 3.*parallelism.cp in \[1, 3, 6\]"):
        check_model_config(tiny_config("qwen3_next", linear_num_key_heads=3, linear_num_value_heads=6), 2)
    check_model_config(tiny_config("bailing_hybrid"), 4)  # KDA: its 4 heads are the MLA's (which refuses others first)


def test_a_ring_is_refused_before_the_build():
    ring = Topology(world_size=4, rank=0, cp_size=4, dp_size=1, ring_size=2)
    with pytest.raises(UnsupportedError, match=r"parallelism.ring=2: qwen3_5_text .*linear-attention.*"
                                               r"parallelism.cp in \[1, 2, 4\] \(the largest: 4\)"):
        enable_context_parallel(tiny_model("qwen3_5_text"), ring)


def test_a_cache_runs_hf_at_cp1_and_is_refused_above():
    model = tiny_model("qwen3_5_text")
    ids, _ = _batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        enable_context_parallel(model, Topology(1, 0, 1, 1), backend="sdpa")
        # a cache: HF's own forward (its decode path reads and writes the cache), the same logits
        assert torch.allclose(model(input_ids=ids, position_ids=torch.arange(13)[None].expand(2, 13)).logits, want,
                              atol=1e-6)
    layer = model.model.layers[0].linear_attn
    layer._cp_state.topology = Topology(2, 0, 2, 1)
    with pytest.raises(UnsupportedError, match="use_cache=False"):
        layer(torch.zeros(1, 2, 32), cache_params=object())


def test_an_unknown_linear_mixer_is_refused():
    model = tiny_model("qwen3_5_text")
    model.model.layers[2].linear_attn = torch.nn.Linear(32, 32)
    with pytest.raises(UnsupportedError, match="decoder layer 2 .*class Linear"):
        enable_context_parallel(model, Topology(1, 0, 1, 1))


def test_train_script_cp2_follows_the_single_process_run(tmp_path):
    """scripts/train.py model=tiny_qwen3_5 end to end (ZeRO-3, 3 steps): cp=2 on 2 ranks against 1 rank, loss and
    grad_norm at every step (rel 1e-5, tests/test_engine.py's check)."""
    import json
    from test_engine import BASE, _run, assert_same_trajectory
    base = [o for o in BASE if not o.startswith(("model=", "trainer.max_steps="))]
    runs = {}
    for name, world in (("w1", 1), ("w2_cp2", 2)):
        out = tmp_path / name
        run_ranks(_run, world, base + ["model=tiny_qwen3_5", "trainer.max_steps=3", f"parallelism.cp={world}",
                                       f"run.out_dir={out}"])
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["w1"]) == 3
    assert_same_trajectory(runs["w2_cp2"], runs["w1"], "tiny_qwen3_5 cp=2")


@pytest.mark.parametrize("preset,overrides,world,match", [
    ("tiny_qwen3_5", ["parallelism.cp=2", "parallelism.ring=2"], 4,
     r"parallelism.ring=2: model.family=qwen3_5_text has linear-attention layers.*parallelism.cp in \{1, 2, 4\} "
     r"\(the largest: 4\)"),
    ("tiny_qwen3_next", ["parallelism.cp=8"], 8,  # ring=auto would add a ring for the 4 linear value heads
     r"parallelism.cp=8 cannot split.*linear_num_value_heads / linear_num_key_heads=4 / 2.*ring.*\{1, 2, 4\} "
     r"\(the largest: 4\)"),
])
def test_config_refusals_before_the_build(preset, overrides, world, match):
    from configs import compose_config, validate
    from configs.errors import ConfigError
    cfg = compose_config([f"model={preset}", "data.seq_len=64"] + overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)
    validate(compose_config([f"model={preset}", "data.seq_len=64", "parallelism.cp=2"]), 2)  # the preset runs
