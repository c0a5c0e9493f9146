"""Registry of HF model families that context parallelism supports, and the checks each one needs.

A family is supported when its attention goes through transformers' attention interface with RoPE
applied inside the attention module (so the local chunk uses its global position_ids), a plain causal
mask, and no attention sinks or sliding windows that Ulysses' dense causal kernel would silently drop.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError
from .layout import kv_replication


@dataclass(frozen=True)
class Family:
    model_type: str
    notes: str = ""


SUPPORTED = {f.model_type: f for f in (
    Family("llama"),
    Family("qwen2", "sliding window must be off (use_sliding_window=False, the default)"),
    Family("qwen3", "sliding window must be off (use_sliding_window=False, the default)"),
    Family("mistral", "sliding_window must be null (Mistral >= v0.2)"),
    Family("qwen3_moe", "attention only; experts run unsplit on every CP rank"),
)}


def check_model_config(config, cp: int) -> None:
    """Refuse a model config that CP cannot run exactly, naming the problem and the fix."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedError(
            f"model family {model_type!r} is not supported under context parallelism; supported: "
            f"{sorted(SUPPORTED)}. Use one of those or run with parallelism.cp=1")
    if _uses_sliding_window(config):
        raise UnsupportedError(
            f"{model_type} config has sliding-window attention (sliding_window={config.sliding_window}); "
            "Ulysses runs dense causal attention, which would silently change the model. Set "
            "sliding_window=None / use_sliding_window=False, or run with parallelism.cp=1")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedError("encoder-decoder models are not supported under context parallelism")
    num_q = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    kv_replication(num_q, num_kv, cp)  # raises with the valid cp values


def _uses_sliding_window(config) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return False
    if hasattr(config, "use_sliding_window"):
        return bool(config.use_sliding_window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(t == "sliding_attention" for t in layer_types)
    return True
