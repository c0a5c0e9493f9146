"""ParallelismConfig (how ranks split the work) and DeepSpeedConfig (ZeRO knobs).

dp is not a field: it is derived, dp = world_size // cp (see validate.Plan).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from configs.errors import ConfigError, divisors, fmt, require
from configs.model import check_experts, decoder_arch
from configs.precision import bf16_weights
from ds_ulysses_ext.attention.layout import valid_cp_values
from ds_ulysses_ext.attention.zigzag import auto_ring_size, valid_ring_sizes

if TYPE_CHECKING:  # configs.train imports this module
    from configs.train import TrainConfig

MASTER_WEIGHTS = ("fp32", "bf16")
# 2 and 3: the stages whose gradient reduction over cp is verified exact (docs/design.md); 0: no ZeRO, one rank only
ZERO_STAGES = (0, 2, 3)


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
    # 2 or 3: the stages whose gradient reduction over cp we have verified to be exact. 0 (deepspeed=zero0): one
    # rank, no ZeRO: torch's fused AdamW steps the parameters and their own .grad (engine/ds/clipping_adamw.py)
    zero_stage: int = 3
    offload_optimizer: bool = False  # optimizer state to host memory (ZeRO-Offload)
    offload_param: bool = False  # parameters to host memory; needs zero_stage=3
    overlap_comm: bool = True  # overlap gradient reduction with backward
    contiguous_gradients: bool = True  # copy grads into one buffer as produced; less fragmentation
    # elements per gradient reduce bucket; 0: sized to the run (engine/ds/config.py reduce_bucket_elements)
    reduce_bucket_size: int = 0
    stage3_param_persistence_threshold: int = 100_000  # params smaller than this stay gathered (ZeRO-3)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements prefetched ahead of use (ZeRO-3)
    # dtype of the optimizer's master weights, gradients and Adam moments. fp32: DeepSpeed's mixed precision
    # (an fp32 copy of the bf16 weights takes the update); bf16: the update is computed and stored in bf16, as
    # a plain torch AdamW on bf16 parameters does (about half the optimizer's memory and time, but updates
    # smaller than a weight's bf16 spacing are lost). bf16 needs precision=bf16.
    master_weights: str = "fp32"


def check_deepspeed(cfg: "TrainConfig", world_size: int) -> None:
    stage = cfg.deepspeed.zero_stage
    require(
        stage in ZERO_STAGES,
        f"deepspeed.zero_stage={stage} is not supported: exactness under cp is verified for ZeRO-2 and "
        "ZeRO-3 only (and ZeRO-0 on one rank); use deepspeed=zero2 or deepspeed=zero3",
    )
    if stage == 0:
        check_zero0(cfg, world_size)
    require(
        not cfg.deepspeed.offload_param or stage == 3,
        f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {stage}: only ZeRO-3 partitions "
        "parameters); use deepspeed=zero3_offload or set deepspeed.offload_param=false",
    )
    # a bf16 master copy of fp32 weights would only round every update the fp32 model receives
    require(
        cfg.deepspeed.master_weights == "fp32" or bf16_weights(cfg.precision),
        f"deepspeed.master_weights={cfg.deepspeed.master_weights} needs precision=bf16 (got precision="
        f"{cfg.precision}: the master weights cannot be narrower than the model's); set precision=bf16 or "
        "deepspeed.master_weights=fp32",
    )


def check_zero0(cfg: "TrainConfig", world_size: int) -> None:
    """deepspeed=zero0 is the one-GPU path of a plain torch loop: no partition, no reduction, no master copy."""
    require(
        world_size == 1,
        f"deepspeed=zero0 runs on one rank only (got a world of {world_size}): it reduces no gradient between ranks; "
        "use deepspeed=zero2 or deepspeed=zero3 on several",
    )
    require(
        not (cfg.deepspeed.offload_optimizer or cfg.deepspeed.offload_param),
        "deepspeed=zero0 keeps everything on the device; offloading needs deepspeed=zero2 (optimizer) or "
        "deepspeed=zero3_offload (parameters)",
    )
    # the optimizer steps the parameters themselves: the master weights are the model's own dtype
    model_dtype = "bf16" if bf16_weights(cfg.precision) else "fp32"
    require(
        cfg.deepspeed.master_weights == model_dtype,
        f"deepspeed=zero0 steps the optimizer on the parameters themselves, so its master weights are the model's "
        f"{model_dtype} (got deepspeed.master_weights={cfg.deepspeed.master_weights} with precision={cfg.precision}); "
        f"set deepspeed.master_weights={model_dtype}, or use deepspeed=zero2 for an fp32 master copy",
    )


def check_parallelism(cfg: "TrainConfig", world_size: int) -> int:
    """Check cp/ep/tp against the world and the model shape; return dp."""
    par = cfg.parallelism
    require(world_size >= 1, f"world_size={world_size} must be >= 1 (the number of ranks, WORLD_SIZE)")
    require(par.cp >= 1, f"parallelism.cp={par.cp} must be >= 1; use parallelism.cp=1 to turn cp off")
    require(par.ep >= 1, f"parallelism.ep={par.ep} must be >= 1; use parallelism.ep=1 to turn ep off")
    require(
        par.tp <= 1 or par.cp == 1,
        f"TP+CP is not supported: parallelism.tp={par.tp} with parallelism.cp={par.cp}; "
        "set parallelism.tp=1 and split long sequences with parallelism.cp",
    )
    require(
        par.tp == 1,
        f"parallelism.tp={par.tp}: tensor parallelism is not supported yet; set parallelism.tp=1 "
        "(use parallelism.cp to split long sequences, ZeRO-3 to shard the weights)",
    )
    require(
        world_size % par.cp == 0,
        f"parallelism.cp={par.cp} does not divide the world size {world_size}; "
        f"choose parallelism.cp in {fmt(divisors(world_size))}",
    )
    # seq_len need not divide by cp (the batch is padded up to a multiple of cp), but every rank needs a token.
    require(
        cfg.data.seq_len >= par.cp,
        f"data.seq_len={cfg.data.seq_len} is shorter than parallelism.cp={par.cp}; "
        f"raise data.seq_len to at least {par.cp} or lower parallelism.cp",
    )
    if str(par.ring).strip() == "1":  # pure Ulysses asked for; any other ring is checked by resolve_ring
        check_heads(cfg.model.arch, par.cp, world_size)
    check_experts(cfg.model, par.ep, world_size)
    return world_size // par.cp


def check_heads(arch: Mapping[str, Any], cp: int, world_size: int) -> None:
    arch, at = decoder_arch(arch)
    num_q = arch.get("num_attention_heads")
    if num_q is None:
        return  # a pretrained preset without head counts: enable_context_parallel checks at model load
    num_kv = arch.get("num_key_value_heads", num_q)  # HF's default: one kv head per query head
    # Ulysses gives each cp rank num_q / cp query heads; kv heads are split too, or replicated when cp > num_kv
    splits = valid_cp_values(num_q, num_kv)
    if cp in splits:
        return
    valid = [c for c in divisors(world_size) if c in splits]
    raise ConfigError(
        f"parallelism.cp={cp} cannot split the heads of {at}num_attention_heads={num_q}, "
        f"{at}num_key_value_heads={num_kv}: Ulysses needs num_attention_heads % cp == 0 and "
        f"num_key_value_heads % cp == 0 or cp % num_key_value_heads == 0; "
        f"choose parallelism.cp in {fmt(valid)} (world size {world_size}), or add a ring: parallelism.ring=auto"
    )


def resolve_ring(cfg) -> tuple[int, str]:
    """parallelism.ring (auto | N) -> (ring, why); refuses a ring that cp or the heads do not allow. Called by
    validate(). Packing, sliding windows and sinks run under any ring (ds_ulysses_ext/attention/ring.py)."""
    par, (arch, at) = cfg.parallelism, decoder_arch(cfg.model.arch)
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
        f"cp / ring ranks that split the heads ({at}num_attention_heads={num_q}, "
        f"{at}num_key_value_heads={num_kv}); choose parallelism.ring in "
        f"{fmt(valid)} or parallelism.ring=auto",
    )
    return ring, why

