"""Tiny HF causal LMs built from config (no downloads), shared by the tests."""
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, Glm4MoeLiteConfig, LlamaConfig,
                          MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
              tie_word_embeddings=False)


# MLA (q/k head dim 8 + 4 = 12, v's 8) and GLM-4-MoE (GQA, half the head dim rotated): 8 routed experts in 2 groups,
# top-2 of the best 1 group, sigmoid scores, a shared expert, the first layer dense. initializer_range 0.2 (not HF's
# 0.02): attention far from uniform, so a wrong scale, a lost rope part or a misplaced head moves the loss visibly
_ROUTED = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
               moe_intermediate_size=16, routed_scaling_factor=2.5, norm_topk_prob=True, initializer_range=0.2)
_MLA = dict(num_key_value_heads=8, head_dim=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, **_ROUTED)
DEEPSEEK_LIKE = {
    "deepseek_v3": dict(first_k_dense_replace=1, **_MLA),
    "glm4_moe_lite": dict(mlp_layer_types=["dense", "sparse"], **_MLA),
    "glm4_moe": dict(first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, **_ROUTED),
}


# The families of issue 40 (tests/test_families_2026.py). Mistral4: MLA as above with a softmax router and YaRN whose
# original length (4) is short enough that the Llama-4 query scale (1 + 0.1 log(1 + pos // 4)) varies along the test's
# sequences. Cohere2-MoE: a sliding layer (window 4, RoPE on interleaved pairs) and a global NoPE one, parallel
# attention + MLP, mean-centred LayerNorm (rms_norm_eps unset), logit_scale 0.0625, one shared expert averaged with the
# routed ones. Qwen3-VL(-MoE): the text config of a VL checkpoint with mrope sections [2, 1, 1] of head_dim 8's four
# frequencies, and a one-block vision tower that text never runs
_YARN4 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 4,
          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
          "partial_rotary_factor": 4 / 12}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
               num_position_embeddings=16, deepstack_visual_indexes=[0])
FAMILIES_2026 = {
    "mistral4": dict(_MLA, first_k_dense_replace=1, rope_parameters=_YARN4),
    "cohere2_moe": dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                        sliding_window=4, layer_types=["sliding_attention", "full_attention"], eos_token_id=2,
                        initializer_range=0.2),
    "qwen3_vl": dict(rope_parameters=_MROPE, initializer_range=0.2),
    "qwen3_vl_moe": dict(rope_parameters=_MROPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         initializer_range=0.2),
}
VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


# Linear attention interleaved with full attention (tests/test_linear_attention_cp.py): layers linear, full, linear.
# Gated DeltaNet with 2 key heads of dim 8 and 4 value heads of dim 6 (dk != dv: a swapped dim fails; cp 4 copies each
# key head to 2 ranks); Ling-3.0's KDA with the 4 heads of its MLA (dim 8 linear, q/k 8 + 4, v 8) and the
# DeepSeek-style MoE of DEEPSEEK_LIKE, first layer dense. initializer_range 0.1, not 0.2: at 0.2 stock HF's own fp32
# gradients are 1e-5 from an fp64 run (its KDA solves the chunk system by forward substitution), at 0.1 4e-6 (ours 4e-6,
# the two 2.5e-6 apart), so the 1e-5 check keeps a margin
_LINEAR = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], num_hidden_layers=3,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
               linear_conv_kernel_dim=4, initializer_range=0.1)
_QWEN_NEXT_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16)
LINEAR_FAMILIES = {
    "qwen3_5_text": _LINEAR,
    "qwen3_5_moe_text": dict(_LINEAR, **_QWEN_NEXT_MOE),
    "qwen3_next": dict(_LINEAR, **_QWEN_NEXT_MOE),
    "bailing_hybrid": dict(layer_types=_LINEAR["layer_types"], num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                           n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5,
                           first_k_dense_replace=1, pad_token_id=0, eos_token_id=1, initializer_range=0.1),
}


def tiny_config(family: str, **overrides):
    if family in LINEAR_FAMILIES:
        from transformers import AutoConfig
        return AutoConfig.for_model(family, **{**COMMON, **LINEAR_FAMILIES[family], **overrides})
    if family in FAMILIES_2026:
        return _config_2026(family, overrides)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config, "glm4_moe_lite": Glm4MoeLiteConfig,
           "glm4_moe": Glm4MoeConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}  # Mistral >= v0.2: full attention
    if family == "qwen3_moe":
        extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    if family in DEEPSEEK_LIKE:
        extra = DEEPSEEK_LIKE[family]
    return cls(**{**COMMON, **extra, **overrides})


def _config_2026(family: str, overrides: dict):
    from transformers import AutoConfig
    args = {**COMMON, **FAMILIES_2026[family], **overrides}
    if family == "mistral4":  # its config derives head_dim (nope + rope), of which its YaRN rotates the rope part
        del args["head_dim"]
    if family not in VL_FAMILIES:
        return AutoConfig.for_model(family, **args)
    # a VL config: the decoder's keys go to text_config, the few of the VL config itself stay on top
    top = {k: args.pop(k) for k in ("tie_word_embeddings", "image_token_id", "video_token_id") if k in args}
    return AutoConfig.for_model(family, text_config=args, vision_config=_VISION, **top)


def tiny_model(family: str, seed: int = 0, attn="sdpa", **overrides):
    from ds_ulysses_ext.hf_classes import register_causal_lms
    register_causal_lms()  # mistral4 and the VL families (ds_ulysses_ext/hf_classes.py)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn,
                                             dtype=torch.float32)
    if family in DEEPSEEK_LIKE or family == "bailing_hybrid":  # HF starts the selection bias at 0; a non-zero one
        # shows it steers selection only
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    if family in LINEAR_FAMILIES:
        # decays of at most e^-4 a token instead of HF's init (A up to 16: e^-20 and less), whose fp32 A_log gradient
        # is ill-conditioned: two exact fp32 orders of the same recurrence (HF's and ours) differ there by 1.3e-5
        g = torch.Generator().manual_seed(seed + 11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(0.5, 2.0, generator=g).log())
    return model.train()
