"""Config-time rules for families with linear-attention layers (Qwen3.5 / 3.6, Qwen3-Next, Ling-3.0; models.py
`linear`), before any model is loaded. ds_ulysses_ext/linear_attention/checks.py refuses the same at model load.

- cp must split the linear layers' heads as well as the full attention's (value heads split, key heads split or
  copied); the message lists the cp values that split both and divide the world.
- No ring: parallelism.ring > 1 is refused, and so is ring=auto where it would pick one (heads that pure Ulysses
  cannot split at this cp). The linear layers' state runs along whole sequences; the largest cp that pure Ulysses
  splits is named.
- memory=auto: the planner (ds_ulysses_ext/memory/planner.py) counts every layer as softmax attention; it does not
  know the linear layers' saved tensors or FLOPs, so its choice would rest on a wrong model. A preset is asked for.
- memory.recompute=except_attention: the policy keeps each layer's `self_attn` core out of recompute; Qwen's linear
  layers have no `self_attn`, and keeping a linear layer's core (memory/except_attention.py does not know it) is not
  checked. Another recompute preset is asked for.
- model.kernels other than none: the fused RMSNorm binding (ds_ulysses_ext/kernels/bind.py) would take the linear
  layers' gated output norms (a second, gate argument) for plain RMSNorms.
"""

from configs.errors import ConfigError, divisors, fmt, require
from ds_ulysses_ext.attention.layout import valid_cp_values
from ds_ulysses_ext.linear_attention.heads import valid_linear_cp
from ds_ulysses_ext.models import SUPPORTED


def _linear_heads(arch, family) -> tuple:
    """(value heads, key heads, the arch keys) of the linear layers, or None where model.arch does not say them."""
    if family.linear == "kda":  # Ling-3.0: the linear layers have the attention's head count
        heads = arch.get("num_attention_heads")
        return None if heads is None else (heads, heads, "model.arch.num_attention_heads")
    num_v, num_k = arch.get("linear_num_value_heads"), arch.get("linear_num_key_heads")
    if num_v is None or num_k is None:
        return None
    return num_v, num_k, "model.arch.linear_num_value_heads / linear_num_key_heads"


def check_linear_attention(cfg, world_size: int) -> None:
    family = SUPPORTED.get(cfg.model.family)
    if family is None or not family.linear:
        return
    name, par, arch = cfg.model.family, cfg.parallelism, cfg.model.arch
    require(
        not cfg.memory.auto,
        f"memory=auto with model.family={name}: the memory planner counts every layer as softmax attention and does "
        "not know the linear-attention layers' saved tensors or FLOPs, so its choice would rest on a wrong model. "
        "Choose a memory preset (memory=none, memory=full_recompute, memory=selective, ...)",
    )
    require(
        cfg.memory.recompute != "except_attention",
        f"memory.recompute=except_attention with model.family={name}: the policy keeps each layer's self_attn core "
        "out of recompute and does not know the linear-attention layers. Choose another recompute policy "
        "(memory=full_recompute, memory=selective, memory=block_recompute)",
    )
    require(
        cfg.model.kernels == "none",
        f"model.kernels={cfg.model.kernels} with model.family={name}: the fused RMSNorm binding "
        "(ds_ulysses_ext/kernels/bind.py) would take the linear-attention layers' gated output norms for plain "
        "RMSNorms. Set model.kernels=none",
    )
    if par.cp < 1 or world_size % par.cp:
        return  # check_parallelism names that
    ring = str(par.ring).strip().lower()
    num_q = arch.get("num_attention_heads")
    linear = _linear_heads(arch, family)
    valid = None
    if num_q is not None and linear is not None:
        num_kv = num_q if family.mla else arch.get("num_key_value_heads", num_q)
        splits = set(valid_cp_values(num_q, num_kv)) & set(valid_linear_cp(linear[0], linear[1]))
        valid = [c for c in divisors(world_size) if c in splits]
    largest = f" (the largest: {max(valid)})" if valid else ""
    why = (f"model.family={name} has linear-attention layers, whose conv and recurrent state run along the whole "
           "sequence of a head; a ring splits that sequence over ranks and would have to pass the state from rank to "
           "rank, which is not built")
    if ring not in ("1", "auto"):
        choose = f"parallelism.cp in {fmt(valid)}{largest}" if valid is not None else "a cp that splits the heads"
        raise ConfigError(f"parallelism.ring={par.ring}: {why}. Use pure Ulysses: parallelism.ring=1 with {choose}")
    if valid is not None and par.cp not in valid:
        raise ConfigError(
            f"parallelism.cp={par.cp} cannot split the heads of model.family={name} with pure Ulysses "
            f"(model.arch.num_attention_heads={num_q}, model.arch.num_key_value_heads="
            f"{num_q if family.mla else arch.get('num_key_value_heads', num_q)}, {linear[2]}={linear[0]} / "
            f"{linear[1]}: value heads must split over cp, key heads split or be copied to it), and a ring "
            f"(parallelism.ring=auto would add one) is refused: {why}. Choose parallelism.cp in {fmt(valid)}{largest}")
