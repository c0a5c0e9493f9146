"""What a model with linear-attention layers refuses under context parallelism, before training.

- cp must give every rank whole heads of both kinds: the full attention's (attention/layout.py) and the linear
  layers' (heads.py: value heads split, key heads split or copied).
- No ring (parallelism.ring > 1, or ring=auto choosing one): a ring splits each head's sequence over ranks, and the
  linear layers' conv window and recurrent state would then have to travel from each rank to the next, in order,
  through forward and backward; that pass is not built. Pure Ulysses keeps whole sequences per head, which is exact.
- Qwen3.5's rotary takes mRoPE-shaped position ids [3, B, s]: the global-length RoPE types (rope.py), which need
  [B, s], are refused for it rather than failing at the first forward.
Messages name the field and the cp values that work.
"""
from __future__ import annotations

from ..attention.layout import valid_cp_values
from ..errors import UnsupportedError
from ..rope import depends_on_length, rope_parameters_of
from .heads import key_replication, linear_head_fields, valid_linear_cp

MROPE_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")


def linear_model_cp_values(config, mla: bool = False) -> list[int]:
    """The cp values pure Ulysses can split such a model's heads over (full attention's and the linear layers')."""
    num_q = config.num_attention_heads
    num_kv = num_q if mla else (getattr(config, "num_key_value_heads", None) or num_q)
    num_v, num_k, _ = linear_head_fields(config)
    return [cp for cp in valid_cp_values(num_q, num_kv) if cp in valid_linear_cp(num_v, num_k)]


def check_linear_layers(config, cp: int) -> None:
    num_v, num_k, fields = linear_head_fields(config)
    key_replication(num_v, num_k, cp, fields)
    if config.model_type in MROPE_FAMILIES and cp > 1 and depends_on_length(rope_parameters_of(config)):
        raise UnsupportedError(
            f"{config.model_type} with a length-dependent RoPE ({rope_parameters_of(config)}): its rotary takes "
            "mRoPE position ids [3, B, s], which the global-length RoPE under context parallelism does not take. Use "
            "rope_type default (or another type that does not read the length), or parallelism.cp=1")


def refuse_ring(config, ring: int, mla: bool = False) -> None:
    if ring <= 1:
        return
    valid = linear_model_cp_values(config, mla)
    raise UnsupportedError(
        f"parallelism.ring={ring}: {config.model_type} interleaves linear-attention layers, whose conv and recurrent "
        "state run along the whole sequence of a head; a ring splits that sequence over ranks and would have to "
        "pass the state from rank to rank, which is not built. Use pure Ulysses: parallelism.ring=1 with "
        f"parallelism.cp in {valid} (the largest: {max(valid)}), or parallelism.cp=1")
