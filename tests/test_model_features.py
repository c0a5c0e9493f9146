"""Every switchable model feature of the supported families, under CP, against the unsplit model (fp32, rel 1e-5).

The audit behind this file read each family's configuration_*.py and modeling_*.py in transformers 5.22 for the
config fields that change the forward. AUDIT below is its table: every field of every registry family's config
says where it is covered at cp > 1 (a case here, another test) or where it is refused before training
(ds_ulysses_ext/models.py check_model_config / check_attention_config, rope.py check_rope, configs/model.py and the other group modules),
or why it cannot change the math. A field a transformers upgrade adds, or a family added to the registry without
cases, fails test_every_config_field_of_every_family_is_audited first.

Dropout: attention_dropout is the only dropout these families have. The CP kernels take none, and even with one
each rank would draw its share's mask from its own random stream, so a CP run could match the unsplit model only
in distribution and never be checked against it. The pretrained checkpoints of every family ship 0.0, so it is
refused (at config time and at model load) rather than built.

Each case also checks its premise on the unsplit model (the feature is really on: the parameter exists, the layer
is windowed, the block is dense, ...), and the cases that add no parameter are checked to change the logits, so
no case passes because the feature did nothing.

The cases live in two files: DENSE (each family's own modules under CP) in tests/test_dense_features.py, MOE (our
MoE block at cp 2 x ep 2) here, beside the audit and its guard, which reads both.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, hf_moe_reference, moe_batch
from ds_ulysses_ext import CPCausalLM, Topology, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.moe import AllToAllDispatcher, MoEContext, moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel
from test_dense_features import DENSE, EFFECT, _params, _tied, _windows
from tiny_models import FAMILIES_2026, tiny_model

# field: where it is covered at cp > 1, refused, or why it cannot change the math (transformers 5.22)
AUDIT = {
    # shapes: every test's tiny models vary them; the head counts cp must split are checked (check_model_config,
    # validate), head_dim is overridden in every tiny model (8, not hidden / heads) and cp 4 replicates kv heads
    "vocab_size": "shape", "hidden_size": "shape", "intermediate_size": "shape", "num_hidden_layers": "shape",
    "moe_intermediate_size": "shape", "num_attention_heads": "tests/test_hf_cp.py; refused: check_model_config",
    "num_key_value_heads": "tests/test_hf_cp.py (GQA, replicated at cp 4); refused: check_model_config",
    "head_dim": "every tiny model", "rms_norm_eps": "per token", "initializer_range": "the init only",
    "bos_token_id": "data only", "eos_token_id": "data only", "use_cache": "CP runs no cache (generate refused)",
    "max_position_embeddings": "refused past it: validate; warned for a checkpoint (engine/ds/hf_config.py)",
    "pad_token_id": "llama_pad_token (the embedding's padding_idx)",
    "hidden_act": "llama_gelu; MoE experts: silu only, refused otherwise (configs/moe.py, hf_moe_spec)",
    "mlp_bias": "llama_mlp_bias",
    "attention_bias": "*_attention_bias, gpt_oss_no_attention_bias, qwen3_moe_bias_tied (qwen2's fixed q/k/v biases: "
                      "tests/test_hf_cp.py)",
    "tie_word_embeddings": "*_tied; tests/test_engine.py (engine layouts); Qwen3-VL: the VL config's own flag "
                           "(qwen3_vl_tied, qwen3_vl_moe_tied), its text config's is never read; inert for "
                           "bailing_hybrid (HF's Ling-3.0 class ties nothing: no _tied_weights_keys)",
    "rope_parameters": "tests/test_rope.py (all seven types; partial_rotary_factor in `proportional`, which HF's "
                       "other types fail on loudly, split or not), *_rope here; unknown types refused (check_rope, "
                       "validate)",
    "use_sliding_window": "qwen2_window_*, qwen3_window_layer_types, qwen3_moe_window, latent_moe_window; "
                          "tests/test_sliding_sinks.py, test_ring.py",
    "sliding_window": "as use_sliding_window; mistral, gpt_oss: tests/test_sliding_sinks.py, test_ring.py",
    "max_window_layers": "qwen2_window_max_window_layers; tests/test_sliding_sinks.py (qwen3)",
    "layer_types": "qwen2_window_layer_types, qwen3_window_layer_types, gpt_oss_all_sliding; sliding layers without "
                   "a window refused (check_attention_config); HF's Mistral ignores it",
    "attention_dropout": "refused (check_attention_config, validate): see the module docstring",
    "pretraining_tp": "inert: transformers 5.22's Llama never reads it",
    "norm_topk_prob": "qwen3_moe_norm_topk_prob_false, latent_moe_no_shared_no_norm, mistral4_groups, "
                      "cohere2_moe_sigmoid_no_norm; true: tests/test_moe_model.py; Qwen3-VL-MoE's router never "
                      "reads it (false refused: hf_moe_spec)",
    "mlp_only_layers": "qwen3_moe_mlp_only_layers, latent_moe_mlp_only_layers",
    "decoder_sparse_step": "qwen3_moe_decoder_sparse_step",
    "num_experts": "tests/test_moe_model.py, test_moe_layer.py; ep must divide it (validate)",
    "num_local_experts": "tests/test_moe_gpt_oss.py; ep must divide it (validate)",
    "num_experts_per_tok": "tests/test_moe_model.py (2), test_moe_gpt_oss.py (2, 4)",
    "output_router_logits": "refused (check_model_config, hf_moe_spec, configs/moe.py)",
    "router_aux_loss_coef": "inert: HF reads it only with output_router_logits (refused); moe.aux_loss_coef sets "
                            "our per-sequence loss",
    "swiglu_alpha": "gpt_oss_swiglu", "swiglu_limit": "gpt_oss_swiglu; the default clips in tests/test_moe_gpt_oss.py",
    "latent_size": "tests/test_moe_engine.py (the preset); multiples of 512 only (validate)",
    "router_score": "latent_moe_sigmoid; softmax: tests/test_moe_engine.py",
    "shared_expert_intermediate_size": "latent_moe_no_shared_no_norm; tests/test_moe_engine.py (the preset has one)",
    # DeepSeek-V3 / GLM-4-MoE-Lite (MLA) and GLM-4-MoE: tests/test_mla_cp.py (cp 2, 4, ring 2, 2 x 2, packed) with
    # q/k head dim 12 != v's 8, and the cases below
    "q_lora_rank": "deepseek_v3_no_q_lora, glm4_moe_lite_no_q_lora, mistral4_no_q_lora; 16 in every tiny MLA model",
    "kv_lora_rank": "shape (per token, before the exchange)", "qk_nope_head_dim": "tests/test_mla_cp.py (8)",
    "qk_rope_head_dim": "tests/test_mla_cp.py (4: k's rope part shared by the heads, rotated before the exchange)",
    "v_head_dim": "tests/test_mla_cp.py (8 != q/k's 12: the exchange, masks, ring blocks and merge take it)",
    "rope_interleave": "deepseek_v3_rope_not_interleaved, mistral4_rope_not_interleaved; true in every tiny MLA model",
    "first_k_dense_replace": "deepseek_v3_all_dense, glm4_moe_first_k_dense_0, mistral4_all_dense; 1 in the tiny "
                             "models (the dense layer stays HF's at ep > 1: tests/test_moe_deepseek.py)",
    "mlp_layer_types": "glm4_moe_lite_mlp_layer_types; tests/test_moe_deepseek.py (dense, sparse at ep 2)",
    "n_routed_experts": "tests/test_mla_cp.py (8); ep must divide it (validate)",
    # the MoE fields at ep > 1 through our block: tests/test_moe_deepseek.py (the block against HF's with groups on
    # and off, norm false, scaling 1 and 2.5, two shared experts; whole models at cp x ep 2x2, 4x4, 4x2, ring 2)
    "n_shared_experts": "deepseek_v3_two_shared, mistral4_two_shared; tests/test_moe_deepseek.py (2 in the block test)",
    "n_group": "deepseek_v3_groups, mistral4_groups (softmax scores); tests/test_moe_deepseek.py (2 and 4 groups)",
    "topk_group": "deepseek_v3_groups, mistral4_groups; tests/test_moe_deepseek.py; refused where HF's rule cannot run "
                  "(router.py)",
    "routed_scaling_factor": "deepseek_v3_groups, mistral4_groups; tests/test_moe_deepseek.py (2.5), "
                             "tests/test_families_2026.py (2.5)",
    "use_qk_norm": "glm4_moe_no_qk_norm; true in the tiny model",
    "num_mtp_layers": "inert: transformers 5.22 builds no multi-token-prediction layers (their weights are dropped "
                      "at load)",
    # Issue 40's families (tests/test_families_2026.py: cp 2 and 4, ring 2 and 2 x 2, cp x ep, packed, for each).
    # Mistral4's fields are DeepSeek-V3's (rows above); in its rope_parameters, llama_4_scaling_beta and
    # original_max_position_embeddings scale each query by its global position: mistral4_llama4_scale (also ring 2)
    "logit_scale": "cohere2_moe_logit_scale (0.3, not a power of 2); 0.0625 in the tiny model; the loss head "
                   "applies it (lm.py; tests/test_families_2026.py)",
    "layer_norm_eps": "per token (Cohere2-MoE's mean-centred LayerNorm when rms_norm_eps is unset, as in the tiny "
                      "model; cohere2_moe_rms_norm for the RMSNorm)",
    "rope_theta": "cohere2_moe_rope_theta (Cohere2-MoE's own spelling, folded into rope_parameters)",
    "rope_scaling": "inert: transformers 5.22's Cohere2-MoE keeps it as a field it never folds into rope_parameters "
                    "(tests/test_families_2026.py shows the logits unchanged)",
    "num_shared_experts": "cohere2_moe_no_shared; 1 in the tiny model",
    "shared_expert_combination_strategy": "cohere2_moe_sum; average in the tiny model; others refused (hf_moe_spec)",
    "expert_selection_fn": "cohere2_moe_sigmoid, cohere2_moe_sigmoid_no_norm; softmax in the tiny model; others "
                           "refused (hf_moe_spec)",
    "prefix_dense_intermediate_size": "cohere2_moe_dense_prefix_rope, cohere2_moe_dense_prefix",
    "prefix_dense_sliding_window_pattern": "cohere2_moe_dense_prefix_rope (1: a global dense layer with RoPE), "
                                           "cohere2_moe_prefix_pattern (2: derived layer types, no forced RoPE)",
    "sliding_window_pattern": "cohere2_moe_all_global, cohere2_moe_prefix_pattern; explicit layer_types in the tiny "
                              "model",
    # Qwen3-VL(-MoE): the VL config around a text config, whose fields are the rows above (its mrope_section and
    # mrope_interleaved, inside rope_parameters, cannot act on text: tests/test_families_2026.py shows it bitwise)
    "text_config": "qwen3_vl_attention_bias, qwen3_vl_tied, qwen3_vl_moe_*; the decoder's shape, attention and "
                   "RoPE are its (models.py text_config_of)",
    "vision_config": "inert under CP: text never runs the vision tower, which is frozen (integrate.py); images are "
                     "refused with the fix named",
    "image_token_id": "inert on text: only the multimodal forward reads it (images refused)",
    "video_token_id": "inert on text, as image_token_id", "vision_start_token_id": "inert on text, as image_token_id",
    "vision_end_token_id": "inert on text, as image_token_id",
    # Linear attention interleaved with full attention (tests/test_linear_attention_cp.py: cp 2 and 4 against stock HF,
    # packed rows against each document alone, cp x ep through our MoE block, the train script), and the cases below
    "linear_num_key_heads": "tests/test_linear_attention_cp.py (2, copied to 2 ranks at cp 4); a cp that neither "
                            "splits nor copies them refused (check_model_config, validate)",
    "linear_num_value_heads": "tests/test_linear_attention_cp.py (4); cp must divide them (check_model_config, "
                              "validate)",
    "linear_key_head_dim": "tests/test_linear_attention_cp.py (8)",
    "linear_value_head_dim": "tests/test_linear_attention_cp.py (6, not the key dim: a swapped dim fails)",
    "linear_conv_kernel_dim": "shape (4 in the tiny models: the conv runs per channel on whole sequences, from zero at "
                              "each document; tests/test_linear_attention_cp.py)",
    "short_conv_kernel_size": "Ling-3.0's spelling of linear_conv_kernel_dim (its config copies it there)",
    "kda_safe_gate": "bailing_hybrid_unsafe_gate; true in the tiny model",
    "kda_lower_bound": "bailing_hybrid_lower_bound; -5 in the tiny model",
    "layer_group_size": "bailing_hybrid_layer_group_size (layer_types derived from it); explicit in the tiny model",
    "mtp_loss_scaling_factor": "inert: transformers 5.22's Ling-3.0 builds no multi-token-prediction layers and never "
                               "reads it",
    # not a dataclass field but a switch transformers reads from any config (masking_utils, utils/generic.py)
    "is_causal": "refused (check_attention_config, validate): false would make HF bidirectional",
}


# --- MoE features through our block (what the engine runs for these families) at cp 2 x ep 2 ---------------------

COEF = 0.1  # large, so the balance loss moves the router gradient far beyond the tolerance
E, K = 8, 2
QWEN_MOE = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True)


def _spec(m):
    return moe_blocks(m)[0].spec


# name: (family, overrides, premise on the model after enable_expert_parallel, changes the parameter set)
MOE = {
    "qwen3_moe_norm_topk_prob_false": ("qwen3_moe", {"norm_topk_prob": False}, lambda m: not _spec(m).norm_topk_prob,
                                       False),
    "qwen3_moe_mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [0]},
                                  lambda m: [b.layer_id for b in moe_blocks(m)] == [1], True),
    "qwen3_moe_decoder_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2},
                                      lambda m: [b.layer_id for b in moe_blocks(m)] == [1], True),
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 3},
                         lambda m: _windows(m) == [3, 3], False),
    "qwen3_moe_bias_tied": ("qwen3_moe", {"attention_bias": True, "tie_word_embeddings": True},
                            lambda m: _tied(m) and "model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    "gpt_oss_no_attention_bias": ("gpt_oss", {"attention_bias": False},
                                  lambda m: "model.layers.0.self_attn.o_proj.bias" not in _params(m), True),
    "gpt_oss_swiglu": ("gpt_oss", {"swiglu_limit": 3.0, "swiglu_alpha": 1.0},
                       lambda m: (_spec(m).swiglu_limit, _spec(m).swiglu_alpha) == (3.0, 1.0), False),
    "gpt_oss_all_sliding": ("gpt_oss", {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 3},
                            lambda m: _windows(m) == [3, 3], False),
    "gpt_oss_tied": ("gpt_oss", {"tie_word_embeddings": True}, _tied, True),
    "latent_moe_sigmoid": ("latent_moe", {"router_score": "sigmoid"}, lambda m: _spec(m).score == "sigmoid", False),
    "latent_moe_no_shared_no_norm": ("latent_moe", {"shared_expert_intermediate_size": 0, "norm_topk_prob": False},
                                     lambda m: (_spec(m).shared_intermediate_size, _spec(m).norm_topk_prob)
                                     == (0, False), True),
    "latent_moe_mlp_only_layers": ("latent_moe", {"mlp_only_layers": [1]},
                                   lambda m: [b.layer_id for b in moe_blocks(m)] == [0], True),
    "latent_moe_window": ("latent_moe", {"use_sliding_window": True, "sliding_window": 3},
                          lambda m: _windows(m) == [3, 3], False),
    "mistral4_groups": ("mistral4", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0,
                                     "norm_topk_prob": False},
                        lambda m: (_spec(m).score, _spec(m).n_group, _spec(m).norm_topk_prob) == ("softmax", 4, False),
                        False),
    "mistral4_two_shared": ("mistral4", {"n_shared_experts": 2}, lambda m: _spec(m).shared_intermediate_size == 32,
                            True),
    "cohere2_moe_sigmoid": ("cohere2_moe", {"expert_selection_fn": "sigmoid"},
                            lambda m: (_spec(m).score, _spec(m).norm_topk_prob) == ("sigmoid", True), False),
    "cohere2_moe_sigmoid_no_norm": ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False},
                                    lambda m: (_spec(m).score, _spec(m).norm_topk_prob) == ("sigmoid", False), False),
    "cohere2_moe_sum": ("cohere2_moe", {"shared_expert_combination_strategy": "sum"},
                        lambda m: _spec(m).shared_combine == "sum", False),
    "cohere2_moe_no_shared": ("cohere2_moe", {"num_shared_experts": 0},
                              lambda m: _spec(m).shared_intermediate_size == 0, True),
    "cohere2_moe_dense_prefix": ("cohere2_moe", {"mlp_layer_types": ["dense", "sparse"],
                                                 "prefix_dense_intermediate_size": 24},
                                 lambda m: [b.layer_id for b in moe_blocks(m)] == [1], True),
    "qwen3_vl_moe_mlp_only_layers": ("qwen3_vl_moe", {"mlp_only_layers": [0]},
                                     lambda m: [b.layer_id for b in moe_blocks(m)] == [1], True),
    "qwen3_vl_moe_decoder_sparse_step": ("qwen3_vl_moe", {"decoder_sparse_step": 2},
                                         lambda m: [b.layer_id for b in moe_blocks(m)] == [1], True),
}


def _gpt_oss_moe(overrides, seed=0):
    """tests/test_moe_gpt_oss.py's tiny GPT-OSS (8 experts; clamping expert weights, biases, sinks) with overrides."""
    from test_moe_gpt_oss import tiny_gpt_oss
    return tiny_gpt_oss(seed, **overrides)


def _latent_moe(overrides, seed=0):
    """A LatentMoE small enough for a test (the 512 rule on latent_size is configs/model.py check_latent_size's, not the model's)."""
    from ds_ulysses_ext.moe.latent_model import LatentMoeConfig, LatentMoeForCausalLM
    args = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, latent_size=16,
                shared_expert_intermediate_size=8, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    config = LatentMoeConfig(**{**args, **overrides})
    config._attn_implementation = "sdpa"
    model = LatentMoeForCausalLM(config).float()
    with torch.no_grad():  # routers and experts drawn wide, so the top-k choice and the expert outputs matter
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.3)
    return model.train()


def _moe_model(family, overrides):
    if family in FAMILIES_2026:
        return tiny_model(family, **overrides)
    if family == "qwen3_moe":
        return tiny_model("qwen3_moe", **{**QWEN_MOE, **overrides})
    return (_gpt_oss_moe if family == "gpt_oss" else _latent_moe)(overrides)


def _hf_reference_aux(router_logits, mask, top_of_logits):
    """The per-sequence balance loss from HF's router logits (tests/test_moe_model.py writes it out too)."""
    B, S_ = mask.shape
    total = 0.0
    for logits in router_logits:  # one [B*S, E] per MoE layer
        probs = torch.softmax(logits.float(), -1).view(B, S_, E)
        top = torch.topk(logits.view(B, S_, E) if top_of_logits else probs, K, dim=-1).indices
        for b in range(B):
            real = mask[b].bool()
            counts = torch.bincount(top[b][real].flatten(), minlength=E).float()
            total = total + (counts * E / (K * real.sum()) * probs[b][real].mean(0)).sum()
    return total / B


def _moe_reference(name):
    """Stock HF (qwen3_moe, gpt_oss: output_router_logits and the balance loss written out), or for our own
    latent_moe the same model unsplit in this process (every expert local, no CP group)."""
    family, overrides, _, _ = MOE[name]
    model = _moe_model(family, overrides)
    ids, labels, mask = moe_batch()
    if family in FAMILIES_2026:  # their routers' own choice, hooked (moe_check.py)
        return hf_moe_reference(model, moe_batch(), COEF, sigmoid=overrides.get("expert_selection_fn") == "sigmoid")
    if family == "latent_moe":
        ctx = MoEContext(dispatcher=AllToAllDispatcher(E), cp_group=None)
        for block in moe_blocks(model):
            block._ctx[0] = ctx
        model._moe_context = ctx
        local = shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, Topology(1, 0, 1, 1))
        local["moe_token_mask"] = mask
        lm = CPCausalLM(model, loss_chunk_size=4)
        loss_sum, count = lm(**local)
        ce, aux = loss_sum / count, lm.moe_aux_share / ids.shape[0]
    else:
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=-100)
        aux = _hf_reference_aux(out.router_logits, mask, top_of_logits=family == "gpt_oss")
    (ce + COEF * aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_moe(name):  # the model the CP side builds (a seam, as test_dense_features.py's _cp_dense)
    family, overrides, _, _ = MOE[name]
    return _moe_model(family, overrides)


def _moe_case(name):
    family, _, premise, _ = MOE[name]
    ref = _moe_reference(name)
    topo = init_topology(2, ep_size=2)
    model = enable_context_parallel(_cp_moe(name), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    assert premise(model), (name, "the feature is not on in the model under test")
    names = assert_moe_split_matches(model, topo, moe_batch(), COEF, *ref, E, 1e-5)
    assert names == set(ref[2]), name  # every parameter of the reference was compared


def _all_moe(rank, world):
    for name in MOE:
        _moe_case(name)


def test_moe_features_under_cp_and_ep_match_unsplit():
    run_ranks(_all_moe, 2)


# --- premises: a feature that adds no parameter must change the model by well over the tolerance of the
# check above (EFFECT: test_dense_features.py), or its case there proves nothing ----------------------------

@pytest.mark.parametrize("name", [n for n, case in MOE.items() if not case[3]])
def test_each_parameter_free_moe_feature_changes_the_logits(name):
    family, overrides, _, _ = MOE[name]
    ids, _, _ = moe_batch()
    with torch.no_grad():
        on = _moe_model(family, overrides)(input_ids=ids, use_cache=False).logits
        off = _moe_model(family, {})(input_ids=ids, use_cache=False).logits
    assert ((on - off).norm() / off.norm()).item() > EFFECT, name


# --- the audit's own guard ----------------------------------------------------------------------------------------

def test_every_config_field_of_every_family_is_audited():
    import dataclasses
    from transformers import AutoConfig, PreTrainedConfig
    from ds_ulysses_ext.models import SUPPORTED
    from ds_ulysses_ext.moe.latent_model import LatentMoeConfig, register_latent_moe
    register_latent_moe()
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}  # output / label bookkeeping, no model math
    for family in SUPPORTED:
        config = AutoConfig.for_model(family)
        config_class = type(config)
        fields = {f.name for f in dataclasses.fields(config_class)} - base
        if type(config.get_text_config()) is not config_class:  # a VL config: its text config's fields too
            fields |= {f.name for f in dataclasses.fields(type(config.get_text_config()))} - base
        if config_class is LatentMoeConfig:  # ours: plain __init__ arguments on top of Qwen3-MoE's fields
            fields |= {"latent_size", "shared_expert_intermediate_size", "router_score"}
        assert fields <= set(AUDIT), (family, "audit these fields, then add them to AUDIT", sorted(fields - set(AUDIT)))
    covered = {case[0] for case in DENSE.values()} | {case[0] for case in MOE.values()}
    assert covered == set(SUPPORTED), ("a registry family without feature cases", set(SUPPORTED) - covered)
    import re
    named = set(DENSE) | set(MOE)
    families = "|".join(sorted(SUPPORTED, key=len, reverse=True))
    for where in AUDIT.values():  # every case AUDIT names exists (a renamed case must be renamed there too)
        for ref in re.findall(rf"\b(?:{families})_[a-z0-9_]*", where):
            prefix = ref.endswith("_")  # `qwen2_window_*`: some case of that prefix
            assert any(n.startswith(ref) for n in named) if prefix else ref in named, (where, ref)
