"""Config-time rules for families with linear-attention layers (Qwen3.5 / 3.6, Qwen3-Next, Ling-3.0; models.py
`linear`), before any model is loaded. ds_ulysses_ext/linear_attention/checks.py refuses the same at model load.

- cp must split the linear layers' heads as well as the full attention's (value heads split, key heads split or
  copied); the message lists the cp values that split both and divide the world.
- No ring: parallelism.ring > 1 is refused, and so is ring=auto where it would pick one (heads that pure Ulysses
  cannot split at this cp). The linear layers' state runs along whole sequences; the largest cp that pure Ulysses
  splits is named.
- memory=auto, scripts/plan.py, memory.recompute=except_attention and model.kernels are not refused here: the planner
  counts the linear layers (memory/planner.py), except_attention keeps their cores out of recompute as it keeps the
  attention's (memory/except_attention.py), and the fused RMSNorm binding leaves their gated output norms eager
  (kernels/bind.py binds a norm of one input that agrees with an RMSNorm; tests/test_linear_attention_memory.py).
- model.linear_attn_kernel=fla on a CPU run, or where flash-linear-attention (with triton) does not import: its
  kernels are Triton, on CUDA; torch or auto is asked for (check_linear_attn_kernel). On a family without linear
  layers the key is refused by configs/conditional.py (set away from auto, it would be ignored).
"""

from configs.device import runs_on_cuda
from configs.errors import ConfigError, divisors, fmt, one_of, require
from ds_ulysses_ext.attention.layout import valid_cp_values
from ds_ulysses_ext.linear_attention.fla_kernels import KERNELS, fla_available
from ds_ulysses_ext.linear_attention.heads import valid_linear_cp
from ds_ulysses_ext.models import SUPPORTED

# the families whose runs read model.linear_attn_kernel (configs/conditional.py refuses it on the others)
LINEAR_FAMILIES = tuple(f.model_type for f in SUPPORTED.values() if f.linear)


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
    check_linear_attn_kernel(cfg)
    name, par, arch = cfg.model.family, cfg.parallelism, cfg.model.arch
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


def check_linear_attn_kernel(cfg) -> None:
    """model.linear_attn_kernel, on a family with linear layers: a known value, and fla only where it can run."""
    choice = cfg.model.linear_attn_kernel
    one_of("model.linear_attn_kernel", choice, KERNELS)
    if choice != "fla":
        return
    require(runs_on_cuda(cfg.device), f"model.linear_attn_kernel=fla with model.family={cfg.model.family}: "
            "flash-linear-attention's kernels run on CUDA only (Triton), and this run is on the CPU (device="
            f"{cfg.device}); set model.linear_attn_kernel=torch (or auto, which picks fla on CUDA)")
    require(fla_available(), "model.linear_attn_kernel=fla needs flash-linear-attention, which does not import here "
            "(pip install fla-core==0.6.0; it needs triton); install it, or set model.linear_attn_kernel=torch (or "
            "auto, which runs fla where it imports)")
