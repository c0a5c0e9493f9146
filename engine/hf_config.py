"""The HF model config for a ModelConfig, without building the model (cheap; used before model load)."""
from __future__ import annotations


def hf_config_of(model_cfg):
    from transformers import AutoConfig
    if model_cfg.source == "pretrained":
        return AutoConfig.from_pretrained(model_cfg.path)
    return AutoConfig.for_model(model_cfg.family, **model_cfg.arch)
