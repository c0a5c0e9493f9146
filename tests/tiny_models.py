"""Tiny HF causal LMs built from config (no downloads), shared by the tests."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
              tie_word_embeddings=False)


def tiny_config(family: str, **overrides):
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3_moe": Qwen3MoeConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}  # Mistral >= v0.2: full attention
    if family == "qwen3_moe":
        extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    return cls(**{**COMMON, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, attn="sdpa", **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn,
                                             dtype=torch.float32)
    return model.train()
