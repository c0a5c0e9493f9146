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


def tiny_config(family: str, **overrides):
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config, "glm4_moe_lite": Glm4MoeLiteConfig,
           "glm4_moe": Glm4MoeConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}  # Mistral >= v0.2: full attention
    if family == "qwen3_moe":
        extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    if family in DEEPSEEK_LIKE:
        extra = DEEPSEEK_LIKE[family]
    return cls(**{**COMMON, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, attn="sdpa", **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn,
                                             dtype=torch.float32)
    if family in DEEPSEEK_LIKE:  # HF starts the selection bias at 0; a non-zero one shows it steers selection only
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    return model.train()
