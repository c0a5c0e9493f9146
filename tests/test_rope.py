"""Every RoPE type transformers 5.22 defines, under CP (cp = 2, 4), against the unsplit model (fp32, rel 1e-5).

The batch (16 tokens) is longer than each type's pretraining length (8, or 4 for yarn / llama3), so `dynamic`
grows its base and `longrope` takes its long factors in the unsplit model while a rank's chunk alone would not
(rank 0 sees positions < 8 at cp=2): without the global length those ranks rotate differently. A length cp
does not divide (31, padded to 32) is checked at the end: the pads must not enter the length.
Compared: this rank's chunk of the logits, the loss, and every parameter gradient summed over the CP group.
Types outside the checked list are refused at model time (and at config time: tests/test_configs.py).
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import modeling_rope_utils

from cp_check import assert_share_matches_unsplit
from dist_harness import run_ranks
from ds_ulysses_ext import (CPCausalLM, Topology, UnsupportedError, enable_context_parallel, init_topology,
                            shard_batch)
from ds_ulysses_ext.attention.layout import chunk_bounds
from tiny_models import tiny_model

RTOL = 1e-5
S = 16
HALF = 4  # head_dim 8 / 2: one factor per rotated frequency

ROPE = {  # rope_parameters as a user writes them; max_position_embeddings is set next to each
    "default": ({"rope_type": "default"}, 8),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 8),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 8),
    "yarn": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}, 8),
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 9.0],
                  "original_max_position_embeddings": 8}, 8),
    "llama3": ({"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4}, 8),
    "proportional": ({"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5}, 8),
}
# each type on llama; the two that read the length on qwen3 too (its own rotary class), one of them spelt the
# pre-transformers-5 way (rope_scaling with `type`)
CASES = [("llama", t, "rope_parameters") for t in ROPE] + [("qwen3", "dynamic", "rope_scaling"),
                                                           ("qwen3", "longrope", "rope_parameters")]


def _model(family, rope_type, key):
    params, max_pos = ROPE[rope_type]
    params = dict(params)
    if key == "rope_scaling":
        params["type"] = params.pop("rope_type")
    return tiny_model(family, max_position_embeddings=max_pos, **{key: params})


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference(case):
    model = _model(*case)
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_case(rank, world, case):
    ref_logits, ref_loss, ref_grads = _reference(case)
    topo = init_topology(world)
    model = enable_context_parallel(_model(*case), topo, backend="sdpa")
    ids, labels = _batch()
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    start, end = chunk_bounds(S, world, topo.cp_rank)
    with torch.no_grad():
        logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
    assert _rel(logits, ref_logits[:, start:end]) < RTOL, (case, rank, _rel(logits, ref_logits[:, start:end]))
    loss_sum, count = CPCausalLM(model)(**local)
    assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, case)


def _check_all(rank, world):
    for case in CASES:  # one process group for every case: forking the ranks costs more than a case
        _check_case(rank, world, case)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rope_type_under_cp_matches_unsplit(world):
    run_ranks(_check_all, world)


def test_the_cases_cover_every_rope_type_transformers_defines():
    from ds_ulysses_ext.rope import CP_ROPE_TYPES
    assert set(ROPE) == {"default", *modeling_rope_utils.ROPE_INIT_FUNCTIONS}  # a new HF type fails here first
    assert set(ROPE) == set(CP_ROPE_TYPES)


def test_the_length_dependent_types_really_differ_per_chunk():
    # the premise of the test above: at rank 0's chunk length the unsplit model's frequencies would differ
    for rope_type in ("dynamic", "longrope"):
        alone, whole = _model("llama", rope_type, "rope_parameters"), _model("llama", rope_type, "rope_parameters")
        x = torch.zeros(1, 1, 8)
        cos_alone, _ = alone.model.rotary_emb(x, torch.arange(S // 2).unsqueeze(0))
        cos_whole, _ = whole.model.rotary_emb(x, torch.arange(S).unsqueeze(0))
        assert _rel(cos_alone, cos_whole[:, : S // 2]) > 1e-3, rope_type


CP2 = Topology(world_size=2, rank=0, cp_size=2, dp_size=1)  # the refusal comes before any collective


def _static_rope(config, device=None, **kwargs):
    return modeling_rope_utils.ROPE_INIT_FUNCTIONS["linear"](config, device)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unchecked_rope_type_is_refused_at_enable_time(monkeypatch, key):
    # a user's own rope type: whether it reads the sequence length is not known, so it is refused under cp
    monkeypatch.setitem(modeling_rope_utils.ROPE_INIT_FUNCTIONS, "my_rope", _static_rope)
    model = tiny_model("llama", **{key: {"rope_type": "my_rope", "factor": 2.0}})
    with pytest.raises(UnsupportedError, match=r"rope_type 'my_rope' is not one of the RoPE types checked under "
                                               r"context parallelism \['default', 'linear', 'yarn', 'llama3', "
                                               r"'proportional', 'dynamic', 'longrope'\].*Set rope_parameters "
                                               r"\(or rope_scaling\) to one of those types, or run with "
                                               r"parallelism\.cp=1"):
        enable_context_parallel(model, CP2)
    enable_context_parallel(tiny_model("llama", **{key: {"rope_type": "my_rope", "factor": 2.0}}),
                            Topology(1, 0, 1, 1))  # cp=1: the model runs unsplit, as HF's


# --- a length cp does not divide: the pads shard_batch adds must not enter the length ------------------------------
# 31 tokens are padded to 32 at cp 2, cp 4 and cp 4 with ring 2 (zigzag: a multiple of 8). `dynamic` grows its base
# from the length (31 and 32 give other frequencies); `longrope` switches to its long factors past 31, so the pads
# alone would flip it. The unsplit model sees 31 tokens.
S_PAD = 31
PADDED = {"dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 8),
          "longrope": ({**ROPE["longrope"][0], "original_max_position_embeddings": S_PAD}, S_PAD)}


def _padded_model(rope_type):
    params, max_pos = PADDED[rope_type]
    return tiny_model("llama", max_position_embeddings=max_pos, rope_parameters=dict(params))


def _check_padded(rank, world, ring):
    from ds_ulysses_ext.attention.zigzag import padded_seq_len
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 96, (2, S_PAD), generator=g)
    labels = ids.clone()
    labels[1, :4] = -100
    topo = init_topology(world, ring_size=ring)
    assert padded_seq_len(S_PAD, world, ring) > S_PAD  # the premise: cp pads this batch
    for rope_type in PADDED:
        ref = _padded_model(rope_type)
        ref_logits = ref(input_ids=ids).logits
        loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
        loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        model = enable_context_parallel(_padded_model(rope_type), topo, backend="sdpa")
        local = shard_batch({"input_ids": ids, "labels": labels}, topo)
        real = local["position_ids"][0] < S_PAD  # this rank's columns that are tokens, not cp pads
        with torch.no_grad():
            logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
        want = ref_logits.detach()[:, local["position_ids"][0][real]]
        assert _rel(logits[:, real], want) < RTOL, (rope_type, world, ring, rank, _rel(logits[:, real], want))
        loss_sum, count = CPCausalLM(model)(**local)
        assert_share_matches_unsplit(model, loss_sum, count, topo, loss.detach(), ref_grads, (rope_type, world, ring))


@pytest.mark.parametrize("world,ring", [(2, 1), (4, 1), (4, 2)])
def test_length_dependent_rope_ignores_the_cp_padding(world, ring):
    run_ranks(_check_padded, world, ring)


def test_the_padding_would_change_the_length_dependent_frequencies():
    # the premise of the test above: at the padded length the unsplit model's frequencies differ
    for rope_type in PADDED:
        x = torch.zeros(1, 1, 8)
        cos_real, _ = _padded_model(rope_type).model.rotary_emb(x, torch.arange(S_PAD).unsqueeze(0))
        cos_pad, _ = _padded_model(rope_type).model.rotary_emb(x, torch.arange(S_PAD + 1).unsqueeze(0))
        assert _rel(cos_pad[:, :S_PAD], cos_real) > 1e-3, rope_type
