"""ModelConfig: which HF causal LM to train and how to build it."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ds_ulysses_ext.models import SUPPORTED

# HF `model_type`s the library can split under cp: its registry, so validate and the model build agree.
SUPPORTED_FAMILIES = tuple(SUPPORTED)
MOE_FAMILIES = tuple(f.model_type for f in SUPPORTED.values() if f.moe)
MODEL_SOURCES = ("config", "pretrained")
ATTN_BACKENDS = ("auto", "sdpa", "flash_attn", "fa4")


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, for logs only
    family: str = "llama"  # HF model_type; one of SUPPORTED_FAMILIES
    source: str = "config"  # "config": random init from `arch`; "pretrained": load weights from `path`
    path: Optional[str] = None  # local dir or hub id; required when source=pretrained
    # HF config kwargs (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    # head_dim, ...). source=config: the whole model shape. source=pretrained: the checkpoint's config.json
    # is the truth; the presets repeat its head/layer/expert counts here only so `validate` can check cp and
    # ep before anything is downloaded. Keys left out are checked later, at model load.
    arch: Dict[str, Any] = field(default_factory=dict)
    attn_backend: str = "auto"  # local attention kernel after the all-to-all: auto | sdpa | flash_attn | fa4
