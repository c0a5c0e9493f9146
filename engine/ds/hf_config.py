"""The HF model config for a ModelConfig, without building the model (cheap; used before model load)."""
from __future__ import annotations

from ds_ulysses_ext.attention.zigzag import padded_seq_len


def hf_config_of(model_cfg):
    from transformers import AutoConfig
    from ds_ulysses_ext.hf_classes import register_causal_lms
    from ds_ulysses_ext.moe.latent_model import register_latent_moe
    register_latent_moe()  # the latent_moe type is ours: HF's Auto classes learn it here
    register_causal_lms()  # and the families transformers maps to image-text-to-text only (hf_classes.py)
    if model_cfg.source == "pretrained":
        return AutoConfig.from_pretrained(model_cfg.path)
    return AutoConfig.for_model(model_cfg.family, **model_cfg.arch)


def position_warning(hf_config, seq_len: int, cp: int, ring: int) -> str | None:
    """A pretrained checkpoint's config.json is known only here, after validate(): positions past its
    max_position_embeddings make RoPE extrapolate, silently. Long-context fine-tuning does that on purpose (with
    or without a RoPE scaling), so it is said, not refused (validate() refuses it for a model built from arch)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    padded = padded_seq_len(seq_len, cp, ring)  # a ring pads to a multiple of 2 x cp
    if not limit or padded <= limit:
        return None
    return (f"data.seq_len={seq_len} (padded to {padded} for cp) exceeds the model's max_position_embeddings="
            f"{limit}: positions past it extrapolate RoPE (with whatever RoPE scaling its config.json sets). If that "
            "is not intended, shorten data.seq_len or train a checkpoint whose config.json covers the length")
