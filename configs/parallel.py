"""ParallelismConfig (how ranks split the work) and DeepSpeedConfig (ZeRO knobs).

dp is not a field: it is derived, dp = world_size // cp (see validate.Plan).
"""

from dataclasses import dataclass

from ds_ulysses_ext.zigzag import auto_ring_size, valid_ring_sizes

MASTER_WEIGHTS = ("fp32", "bf16")


@dataclass
class ParallelismConfig:
    cp: int = 1  # context parallel degree: ranks that split one sequence (Ulysses all-to-all); divides world
    # ranks of the cp group that form a ring (docs/ring.md): the cp group is a Ulysses group of cp / ring consecutive
    # ranks times a ring across them. auto: 1 (pure Ulysses) when the heads split over cp, else the smallest ring that
    # makes them split; N must divide cp and leave a Ulysses group that splits the heads. A string so that both
    # `auto` and an integer override (parallelism.ring=2) parse; validate() turns it into Plan.ring.
    ring: str = "auto"
    ep: int = 1  # expert parallel degree: ranks that split the MoE experts; divides world and the expert count
    tp: int = 1  # tensor parallel degree; only 1 is supported (TP+CP is refused at config time)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 3  # 2 or 3: the stages whose gradient reduction over cp we have verified to be exact
    offload_optimizer: bool = False  # optimizer state to host memory (ZeRO-Offload)
    offload_param: bool = False  # parameters to host memory; needs zero_stage=3
    overlap_comm: bool = True  # overlap gradient reduction with backward
    contiguous_gradients: bool = True  # copy grads into one buffer as produced; less fragmentation
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduce bucket
    stage3_param_persistence_threshold: int = 100_000  # params smaller than this stay gathered (ZeRO-3)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements prefetched ahead of use (ZeRO-3)
    # dtype of the optimizer's master weights, gradients and Adam moments. fp32: DeepSpeed's mixed precision
    # (an fp32 copy of the bf16 weights takes the update); bf16: the update is computed and stored in bf16, as
    # a plain torch AdamW on bf16 parameters does (about half the optimizer's memory and time, but updates
    # smaller than a weight's bf16 spacing are lost). bf16 needs precision=bf16.
    master_weights: str = "fp32"


def resolve_ring(cfg) -> tuple[int, str]:
    """parallelism.ring (auto | N) -> (ring, why); refuses a ring that cp or the heads do not allow. Called by
    validate(). Packing, sliding windows and sinks run under any ring (ds_ulysses_ext/ring.py)."""
    from configs.errors import ConfigError

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    def fmt(values) -> str:
        return "{" + ", ".join(str(v) for v in values) + "}"

    def divisors(n: int) -> list[int]:
        return [d for d in range(1, n + 1) if n % d == 0]

    par, arch = cfg.parallelism, cfg.model.arch
    cp, text = par.cp, str(par.ring).strip().lower()
    require(text == "auto" or (text.isdigit() and int(text) >= 1),
            f"parallelism.ring={par.ring} is neither auto nor a positive integer; set parallelism.ring=auto or a "
            f"divisor of parallelism.cp={cp}: {fmt(divisors(cp))}")
    num_q = arch.get("num_attention_heads")
    num_kv = arch.get("num_key_value_heads", num_q)  # HF's default: one KV head per query head
    if num_q is None:  # a pretrained preset without head counts: enable_context_parallel checks at model load
        valid = divisors(cp)
        ring, why = (1, "head counts unknown before the model loads: Ulysses only (parallelism.ring=N adds a ring)") \
            if text == "auto" else (int(text), f"parallelism.ring={text}")
    else:
        valid = valid_ring_sizes(num_q, num_kv, cp)
        ring, why = auto_ring_size(num_q, num_kv, cp) if text == "auto" else (int(text), f"parallelism.ring={text}")
    require(
        ring in valid,
        f"parallelism.ring={ring} with parallelism.cp={cp}: the ring must divide cp and leave Ulysses groups of "
        f"cp / ring ranks that split the heads (model.arch.num_attention_heads={num_q}, "
        f"model.arch.num_key_value_heads={num_kv}); choose parallelism.ring in "
        f"{fmt(valid)} or parallelism.ring=auto",
    )
    return ring, why
