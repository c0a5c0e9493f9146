"""The causal-LM class of each registry family that transformers' AutoModelForCausalLM does not map on its own.

transformers 5.22 maps `mistral4` (Mistral4ForCausalLM) and the Qwen3-VL checkpoints (`qwen3_vl`, `qwen3_vl_moe`:
their ForConditionalGeneration) to AutoModelForImageTextToText only, while the engine builds, loads and exports every
model through AutoModelForCausalLM. `register_causal_lms()` adds those entries (transformers' own `register`, no patch);
a transformers that maps a family itself keeps its own class.

A Qwen3-VL family is its whole ForConditionalGeneration: the checkpoint loads as it is (vision tower included), the
language model trains on text under CP, and save_pretrained writes the same layout back, which stock HF loads as the
VL model it came from (docs/attention.md, "Families of 2026").
"""
from __future__ import annotations

import functools

# model_type: (config class, causal-LM class), both exported by transformers
CAUSAL_LM_CLASSES = {
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
}


@functools.lru_cache(maxsize=None)  # once per process
def register_causal_lms() -> None:
    import transformers
    from transformers import AutoModelForCausalLM
    for config_name, model_name in CAUSAL_LM_CLASSES.values():
        config_class = getattr(transformers, config_name)
        if config_class not in AutoModelForCausalLM._model_mapping:
            # exist_ok: transformers skips, silently, a registration whose config class is its own without it
            AutoModelForCausalLM.register(config_class, getattr(transformers, model_name), exist_ok=True)
