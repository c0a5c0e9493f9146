"""Switchable model features through each family's own modules under CP (cp 2, ring 2 for RING), against the
unsplit model (fp32, rel 1e-5): the DENSE cases of the audit in tests/test_model_features.py.

"Dense" here means no expert parallelism: HF's own blocks run, MoE blocks included (what a library user at cp > 1
runs). Apart from tests/test_model_features.py, which keeps the audit (AUDIT: every config field and where it is
covered), the MoE cases through our block at cp 2 x ep 2, and the guard that checks both files' cases against the
registry (it imports DENSE from here).

Each case checks its premise on the unsplit model (the feature is really on), the cases that add no parameter are
checked to change the logits, and every case is checked to fail when the CP side runs without its feature, so no
case passes because the feature did nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GptOssConfig

from cp_check import assert_share_matches_unsplit
from dist_harness import run_ranks
from cp_reference import grads_of
from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
from tiny_models import _YARN4, tiny_model

S = 16  # cp 2 and ring 2 (zigzag chunks of 4) divide it: the length-dependent RoPE types see no pads
DYNAMIC = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 8}  # 16 > 8: grows
# DeepSeek-V3's own RoPE: yarn with mscale_all_dim, which also scales the attention (HF's yarn_apply_mscale)
YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 8, "rope_theta": 10000.0}
LONGROPE = {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                "long_factor": [2.0, 4.0, 6.0, 9.0], "original_max_position_embeddings": 8},
            "max_position_embeddings": 8}


def _layers(m):
    return m.get_decoder().layers  # a VL model's: its language model's


def _params(m):
    return dict(m.named_parameters())


def _windows(m):
    return [layer.self_attn.sliding_window for layer in _layers(m)]


def _tied(m):
    return m.lm_head.weight is m.get_input_embeddings().weight


def _rope(m, rope_type):
    return m.get_decoder().rotary_emb.rope_type == rope_type and S > m.config.max_position_embeddings


# name: (family, overrides, premise on the unsplit model, changes the parameter set: then the compared names show it)
DENSE = {
    "llama_attention_bias": ("llama", {"attention_bias": True},
                             lambda m: "model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    "llama_mlp_bias": ("llama", {"mlp_bias": True}, lambda m: "model.layers.0.mlp.down_proj.bias" in _params(m), True),
    "llama_gelu": ("llama", {"hidden_act": "gelu_pytorch_tanh"},
                   lambda m: "GELU" in type(_layers(m)[0].mlp.act_fn).__name__, False),
    "llama_pad_token": ("llama", {"pad_token_id": 0}, lambda m: m.model.embed_tokens.padding_idx == 0, False),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, _tied, True),
    "qwen2_window_max_window_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 3,
                                                 "max_window_layers": 1},
                                       lambda m: _windows(m) == [None, 3], False),
    "qwen2_window_layer_types": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                           "layer_types": ["sliding_attention", "full_attention"]},
                                 lambda m: _windows(m) == [4, None], False),
    "qwen2_dynamic_rope": ("qwen2", DYNAMIC, lambda m: _rope(m, "dynamic"), False),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}, _tied, True),
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True},
                             lambda m: "model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    "qwen3_window_layer_types": ("qwen3", {"use_sliding_window": True, "sliding_window": 3,
                                           "layer_types": ["full_attention", "sliding_attention"]},
                                 lambda m: _windows(m) == [None, 3], False),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}, _tied, True),
    "mistral_dynamic_rope": ("mistral", DYNAMIC, lambda m: _rope(m, "dynamic"), False),
    "mistral_longrope": ("mistral", LONGROPE, lambda m: _rope(m, "longrope"), False),
    "mistral_tied": ("mistral", {"tie_word_embeddings": True}, _tied, True),
    # HF's own sparse block (no enable_expert_parallel): what a library user at cp > 1 runs
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 3},
                         lambda m: _windows(m) == [3, 3], False),
    "qwen3_moe_dynamic_rope": ("qwen3_moe", DYNAMIC, lambda m: _rope(m, "dynamic"), False),
    "qwen3_moe_bias_tied": ("qwen3_moe", {"attention_bias": True, "tie_word_embeddings": True},
                            lambda m: _tied(m) and "model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    # HF's GptOssMLP (no enable_expert_parallel); eager attention with sinks, as its HF reference
    "gpt_oss_no_attention_bias": ("gpt_oss", {"attention_bias": False},
                                  lambda m: "model.layers.0.self_attn.o_proj.bias" not in _params(m), True),
    "gpt_oss_all_sliding": ("gpt_oss", {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 3},
                            lambda m: _windows(m) == [3, 3], False),
    "gpt_oss_default_rope": ("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                             lambda m: m.model.rotary_emb.rope_type == "default", False),
    "gpt_oss_dynamic_rope": ("gpt_oss", {**DYNAMIC, "rope_parameters": {**DYNAMIC["rope_parameters"],
                                                                         "rope_theta": 10000.0}},
                             lambda m: _rope(m, "dynamic"), False),
    "gpt_oss_swiglu": ("gpt_oss", {"swiglu_limit": 0.5, "swiglu_alpha": 1.0},
                       lambda m: _layers(m)[0].mlp.experts.limit == 0.5, False),
    "gpt_oss_tied": ("gpt_oss", {"tie_word_embeddings": True}, _tied, True),
    # MLA and GLM-4-MoE with HF's own MoE blocks (per token); through ours at cp 2 x ep 2: MOE in test_model_features.py
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None},
                              lambda m: "model.layers.0.self_attn.q_proj.weight" in _params(m), True),
    "deepseek_v3_rope_not_interleaved": ("deepseek_v3", {"rope_interleave": False},
                                         lambda m: m.config.rope_interleave is False, False),
    "deepseek_v3_yarn_rope": ("deepseek_v3", {"rope_parameters": YARN},
                              lambda m: _layers(m)[0].self_attn.scaling != 12 ** -0.5, False),
    "deepseek_v3_all_dense": ("deepseek_v3", {"first_k_dense_replace": 2},
                              lambda m: "model.layers.1.mlp.gate.weight" not in _params(m), True),
    "deepseek_v3_two_shared": ("deepseek_v3", {"n_shared_experts": 2},
                               lambda m: _layers(m)[1].mlp.shared_experts.gate_proj.out_features == 32, True),
    "deepseek_v3_groups": ("deepseek_v3", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0,
                                           "norm_topk_prob": False},
                           lambda m: _layers(m)[1].mlp.gate.num_group == 4, False),
    "glm4_moe_lite_no_q_lora": ("glm4_moe_lite", {"q_lora_rank": None},
                                lambda m: "model.layers.0.self_attn.q_proj.weight" in _params(m), True),
    "glm4_moe_lite_mlp_layer_types": ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "dense"]},
                                      lambda m: "model.layers.0.mlp.gate.weight" in _params(m), True),
    "glm4_moe_no_qk_norm": ("glm4_moe", {"use_qk_norm": False},
                            lambda m: "model.layers.0.self_attn.q_norm.weight" not in _params(m), True),
    "glm4_moe_full_rotary": ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 1.0}},
                             lambda m: m.model.rotary_emb.inv_freq.numel() == 4, False),
    "glm4_moe_first_k_dense_0": ("glm4_moe", {"first_k_dense_replace": 0},
                                 lambda m: "model.layers.0.mlp.gate.weight" in _params(m), True),
    # issue 40's families with HF's own MoE blocks (every layout: tests/test_families_2026.py); through ours: MOE, as above
    "mistral4_no_q_lora": ("mistral4", {"q_lora_rank": None},
                           lambda m: "model.layers.0.self_attn.q_proj.weight" in _params(m), True),
    "mistral4_rope_not_interleaved": ("mistral4", {"rope_interleave": False},
                                      lambda m: m.config.rope_interleave is False, False),
    "mistral4_llama4_scale": ("mistral4", {"rope_parameters": {**_YARN4, "llama_4_scaling_beta": 0.5}},
                              lambda m: m.config.rope_parameters["llama_4_scaling_beta"] == 0.5, False),
    "mistral4_attention_bias": ("mistral4", {"attention_bias": True},
                                lambda m: "model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    "mistral4_all_dense": ("mistral4", {"first_k_dense_replace": 2},
                           lambda m: "model.layers.1.mlp.gate.weight" not in _params(m), True),
    "cohere2_moe_rms_norm": ("cohere2_moe", {"rms_norm_eps": 1e-5},
                             lambda m: type(_layers(m)[0].input_layernorm).__name__.endswith("RMSNorm"), False),
    "cohere2_moe_all_global": ("cohere2_moe", {"layer_types": None, "sliding_window_pattern": 1},
                               lambda m: _windows(m) == [None, None], False),
    "cohere2_moe_dense_prefix_rope": ("cohere2_moe", {"mlp_layer_types": ["dense", "sparse"],
                                                      "prefix_dense_intermediate_size": 24,
                                                      "layer_types": ["full_attention", "full_attention"]},
                                      lambda m: _layers(m)[0].self_attn.force_rope and _windows(m) == [None, None],
                                      True),
    "cohere2_moe_prefix_pattern": ("cohere2_moe", {"first_k_dense_replace": 1, "mlp_layer_types": None,
                                                   "layer_types": None, "prefix_dense_sliding_window_pattern": 2,
                                                   "sliding_window_pattern": 1, "prefix_dense_intermediate_size": 24},
                                   lambda m: _windows(m) == [4, None] and not _layers(m)[0].self_attn.force_rope, True),
    "cohere2_moe_logit_scale": ("cohere2_moe", {"logit_scale": 0.3}, lambda m: m.logit_scale == 0.3, False),
    "cohere2_moe_rope_theta": ("cohere2_moe", {"rope_theta": 100.0},
                               lambda m: m.config.rope_parameters["rope_theta"] == 100.0, False),
    # both layers rotated: a NoPE layer's k bias shifts every score of a query alike, so its exact gradient is 0 and
    # a relative comparison would compare rounding noise
    "cohere2_moe_attention_bias": ("cohere2_moe", {"attention_bias": True,
                                                   "layer_types": ["sliding_attention", "sliding_attention"]},
                                   lambda m: "model.layers.1.self_attn.k_proj.bias" in _params(m), True),
    "cohere2_moe_tied": ("cohere2_moe", {"tie_word_embeddings": True}, _tied, True),
    "qwen3_vl_attention_bias": ("qwen3_vl", {"attention_bias": True},
                                lambda m: "model.language_model.layers.0.self_attn.o_proj.bias" in _params(m), True),
    "qwen3_vl_tied": ("qwen3_vl", {"tie_word_embeddings": True}, _tied, True),
    "qwen3_vl_moe_tied": ("qwen3_vl_moe", {"tie_word_embeddings": True}, _tied, True),
    # linear attention interleaved with full attention (tests/tiny_models.py LINEAR_FAMILIES), HF's own MoE blocks
    "qwen3_5_text_layer_types": ("qwen3_5_text", {"layer_types": ["full_attention", "linear_attention",
                                                                  "linear_attention"]},
                                 lambda m: [hasattr(layer, "linear_attn") for layer in _layers(m)] == [False, True, True],
                                 True),
    "qwen3_5_text_gelu": ("qwen3_5_text", {"hidden_act": "gelu_pytorch_tanh"},  # the conv's activation too
                          lambda m: _layers(m)[0].linear_attn.activation == "gelu_pytorch_tanh", False),
    "qwen3_5_text_full_rotary": ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                      "partial_rotary_factor": 1.0}},
                                 lambda m: m.model.rotary_emb.inv_freq.numel() == 4, False),
    "qwen3_5_text_attention_bias": ("qwen3_5_text", {"attention_bias": True},
                                    lambda m: "model.layers.1.self_attn.o_proj.bias" in _params(m), True),
    "qwen3_5_text_tied": ("qwen3_5_text", {"tie_word_embeddings": True}, _tied, True),
    "qwen3_5_moe_text_tied": ("qwen3_5_moe_text", {"tie_word_embeddings": True}, _tied, True),
    "qwen3_next_mlp_only_layers": ("qwen3_next", {"mlp_only_layers": [0]},
                                   lambda m: not hasattr(_layers(m)[0].mlp, "experts"), True),
    "qwen3_next_decoder_sparse_step": ("qwen3_next", {"decoder_sparse_step": 2},
                                       lambda m: [hasattr(layer.mlp, "experts") for layer in _layers(m)]
                                       == [False, True, False], True),
    "qwen3_next_norm_topk_prob_false": ("qwen3_next", {"norm_topk_prob": False},
                                        lambda m: not _layers(m)[0].mlp.gate.norm_topk_prob, False),
    "bailing_hybrid_unsafe_gate": ("bailing_hybrid", {"kda_safe_gate": False},
                                   lambda m: not _layers(m)[0].self_attn.forget_gate.safe_gate, False),
    "bailing_hybrid_lower_bound": ("bailing_hybrid", {"kda_lower_bound": -2.0},
                                   lambda m: _layers(m)[0].self_attn.forget_gate.lower_bound == -2.0, False),
    "bailing_hybrid_layer_group_size": ("bailing_hybrid", {"layer_types": None, "layer_group_size": 3},
                                        lambda m: hasattr(_layers(m)[1].self_attn, "forget_gate")
                                        and not hasattr(_layers(m)[2].self_attn, "forget_gate"), True),
    "bailing_hybrid_all_dense": ("bailing_hybrid", {"first_k_dense_replace": 3},
                                 lambda m: not any(hasattr(layer.mlp, "experts") for layer in _layers(m)), True),
}
RING = ["qwen2_window_max_window_layers", "qwen3_moe_window", "qwen2_dynamic_rope", "deepseek_v3_yarn_rope",
        "mistral4_llama4_scale", "cohere2_moe_prefix_pattern"]  # also under ring 2 (zigzag)


def _gpt_oss(overrides, seed=0):
    args = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**{**args, **overrides}), attn_implementation="eager",
                                             dtype=torch.float32)
    with torch.no_grad():  # large distinct sinks: a rank using the wrong ones moves the loss far past the tolerance
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(8, generator=torch.Generator().manual_seed(7)) * 2)
    return model.train()


def _dense(family, overrides):
    return _gpt_oss(overrides) if family == "gpt_oss" else tiny_model(family, **overrides)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, S), generator=g)
    ids[0, 5] = ids[1, 11] = 0  # the pad token (llama_pad_token) occurs as input
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 9] = -100
    return ids, labels


def _dense_reference(name):
    family, overrides, premise, _ = DENSE[name]
    model = _dense(family, overrides)
    assert premise(model), (name, "the feature is not on in the unsplit model")
    ids, labels = _batch()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), grads_of(model)  # a VL model's vision tower: zeros (never run, frozen under CP)


def _cp_dense(name):  # the model the CP side builds (a seam: the failure check builds it without the feature)
    family, overrides, _, _ = DENSE[name]
    return _dense(family, overrides)


def _dense_case(name, ring):
    ref_loss, ref_grads = _dense_reference(name)
    topo = init_topology(2, ring_size=ring)
    model = enable_context_parallel(_cp_dense(name), topo, backend="sdpa")
    ids, labels = _batch()
    loss_sum, count = CPCausalLM(model, loss_chunk_size=5)(**shard_batch({"input_ids": ids, "labels": labels}, topo))
    assert set(dict(model.named_parameters())) == set(ref_grads), name
    assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, (name, ring))


def _all_dense(rank, world):
    for name in DENSE:  # one process group for every case: forking the ranks costs more than a case
        _dense_case(name, 1)
    for name in RING:
        _dense_case(name, 2)


def test_dense_features_under_cp_match_unsplit():
    run_ranks(_all_dense, 2)


def _dense_cases_without_their_feature(rank, world):
    # the seam: the CP side builds the family's default model, the reference keeps the feature; every case must fail
    global _cp_dense
    real = _cp_dense
    try:
        for name, (family, _, _, changes_parameters) in DENSE.items():
            if changes_parameters:  # those fail on the compared names already (_dense_case's first assert)
                continue
            _cp_dense = lambda _name, family=family: _dense(family, {})
            try:
                _dense_case(name, 1)
            except AssertionError:
                continue
            raise RuntimeError(f"{name}: the CP check passed with the feature off on the CP side")
    finally:
        _cp_dense = real


def test_each_dense_case_fails_when_cp_runs_without_its_feature():
    run_ranks(_dense_cases_without_their_feature, 2)


# --- premises: a feature that adds no parameter must change the model (against the family's tiny default, built
# from the same seed) by well over the tolerance of the checks above, or its case there proves nothing -----------

EFFECT = 10 * 1e-5  # 10x the CP checks' rel tolerance (tiny random models: a RoPE change moves the logits ~3e-4)

@pytest.mark.parametrize("name", [n for n, case in DENSE.items() if not case[3]])
def test_each_parameter_free_dense_feature_changes_the_logits(name):
    family, overrides, _, _ = DENSE[name]
    ids, _ = _batch()
    with torch.no_grad():
        on = _dense(family, overrides)(input_ids=ids, use_cache=False).logits
        off = _dense(family, {})(input_ids=ids, use_cache=False).logits
    assert ((on - off).norm() / off.norm()).item() > EFFECT, name
