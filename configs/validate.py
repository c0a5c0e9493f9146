"""validate(cfg, world_size) -> Plan: every cross-field rule, checked before any model is loaded.

Each refusal is a ConfigError whose message names the field(s) and the fix, in override syntax where it
can (`parallelism.cp=2`), so the user can paste it. Rules about the model's shape read `model.arch`; with
model.source=pretrained a key the preset does not repeat is unknown here and is checked at model load.
The config is never mutated: derived values (dp, grad_accum) are returned in the Plan.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from configs.data import BAD_LINE_POLICIES, DATA_FORMATS, DATA_SOURCES, OVERLONG_POLICIES, DataConfig, check_passkey
from configs.errors import ConfigError
from configs.log import WANDB_MODES
from configs.memory import RECOMPUTE_METHODS, RECOMPUTE_POLICIES, MemoryConfig
from configs.model import ATTN_BACKENDS, MODEL_SOURCES, MOE_FAMILIES, SUPPORTED_FAMILIES, ModelConfig
from configs.moe import check_moe
from configs.parallel import MASTER_WEIGHTS, resolve_ring
from configs.train import DEVICES, PRECISIONS, TrainConfig
from configs.trainer import CORRUPT_CHECKPOINT_POLICIES, LR_DECAYS, NONFINITE_POLICIES, TrainerConfig
from ds_ulysses_ext.layout import valid_cp_values
from ds_ulysses_ext.rope import CP_ROPE_TYPES, LENGTH_DEPENDENT_TYPES, depends_on_length, unchecked_rope_types
from ds_ulysses_ext.zigzag import padded_seq_len

ZERO_STAGES = (2, 3)  # the stages whose gradient reduction over cp is verified exact (docs/design.md)
LATENT_ALIGN = 512  # a LatentMoE latent size must be a multiple of this
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen3_moe / gpt_oss, mixtral / deepseek
_LATENT_KEYS = ("latent_size", "moe_latent_size")


@dataclass(frozen=True)
class Plan:
    """The layout a valid config runs with. dp and grad_accum are derived, never stored in the config."""

    world_size: int
    cp: int  # ranks that share one sequence
    dp: int  # world_size // cp: replicas that see different samples
    ep: int  # ranks that share the experts of one MoE layer
    grad_accum: int  # micro-batches per optimizer step on each dp rank
    micro_batch_size: int
    global_batch_size: int  # samples per optimizer step = micro_batch_size * dp * grad_accum
    seq_len: int  # global sequence length, before the cp split
    zero_stage: int
    precision: str
    ring: int = 1  # ranks of the cp group in a ring (cp / ring consecutive ranks per Ulysses group); 1: pure Ulysses
    ring_reason: str = field(default="", compare=False)  # why this layout: the run logs it


def validate(cfg: TrainConfig, world_size: int) -> Plan:
    """Refuse any config that cannot run exactly on `world_size` ranks; return the derived Plan."""
    _check_choices(cfg)
    _check_model(cfg.model)
    _check_data(cfg.data)
    _check_trainer(cfg.trainer)
    _check_logging(cfg)
    _check_eval(cfg)
    _check_memory(cfg.memory, cfg.model.arch)
    _check_deepspeed(cfg)
    dp = _check_parallelism(cfg, world_size)
    ring, ring_reason = resolve_ring(cfg)
    check_moe(cfg, world_size)
    _check_positions(cfg, ring)  # after parallelism.cp/ring are known to be valid: the padding depends on them
    _check_rope(cfg, ring)
    grad_accum = _check_batch(cfg.trainer, dp)
    return Plan(
        world_size=world_size,
        cp=cfg.parallelism.cp,
        dp=dp,
        ep=cfg.parallelism.ep,
        grad_accum=grad_accum,
        micro_batch_size=cfg.trainer.micro_batch_size,
        global_batch_size=cfg.trainer.global_batch_size,
        seq_len=cfg.data.seq_len,
        zero_stage=cfg.deepspeed.zero_stage,
        precision=cfg.precision,
        ring=ring,
        ring_reason=ring_reason,
    )


# --- helpers -------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _fmt(values: Iterable[Any]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_of(field: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    _require(value in choices, f"{field}={value} is not one of {_fmt(choices)}; set {field} to one of them{hint}")


# --- rules, one noun at a time -------------------------------------------------------------------------


def _check_choices(cfg: TrainConfig) -> None:
    """Every enum-like string field holds one of its known values."""
    _require(
        cfg.precision != "fp16",
        "precision=fp16 is not supported (it needs loss scaling, which this engine does not do); "
        "use precision=bf16 on GPU or precision=fp32",
    )
    _one_of("precision", cfg.precision, PRECISIONS)
    _one_of("device", cfg.device, DEVICES)
    _one_of("deepspeed.master_weights", cfg.deepspeed.master_weights, MASTER_WEIGHTS)
    families = ", ".join(SUPPORTED_FAMILIES)
    _require(
        cfg.model.family in SUPPORTED_FAMILIES,
        f"model.family={cfg.model.family} is not supported under cp; supported families: {families}; "
        "pick a model preset of one of them (e.g. model=tiny) or set model.family",
    )
    _one_of("model.source", cfg.model.source, MODEL_SOURCES)
    _one_of("model.attn_backend", cfg.model.attn_backend, ATTN_BACKENDS)
    _one_of("data.source", cfg.data.source, DATA_SOURCES, " (presets: data=synthetic, data=demo, data=jsonl)")
    _one_of("data.format", cfg.data.format, DATA_FORMATS)
    _one_of("data.overlong", cfg.data.overlong, OVERLONG_POLICIES)
    _one_of("data.on_bad_line", cfg.data.on_bad_line, BAD_LINE_POLICIES)
    _one_of("memory.recompute", cfg.memory.recompute, RECOMPUTE_POLICIES)
    _one_of("memory.recompute_method", cfg.memory.recompute_method, RECOMPUTE_METHODS)
    _one_of("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    _require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be >= 1")


def _check_model(model: ModelConfig) -> None:
    _require(
        model.source != "pretrained" or bool(model.path),
        "model.source=pretrained needs model.path; set model.path=<local dir or hub id>, "
        "or use model.source=config for a random init",
    )
    if model.source == "pretrained" and model.path:
        # a hub id is "name" or "namespace/name"; anything else can only be a local folder, so it must exist
        # (else transformers fails after start-up with a message about repo ids)
        path = str(model.path)
        local_only = path.startswith((".", "/", "~")) or path.count("/") > 1
        _require(
            not local_only or Path(path).expanduser().is_dir(),
            f"model.path={path} is not a folder here (and cannot be a hub id, which is name or namespace/name); "
            "fix the path, or run the run that writes it first (e.g. the previous stage of a curriculum)",
        )
    # An empty arch would silently build the HF default config (a 7B Llama for family=llama).
    _require(
        model.source != "config" or bool(model.arch),
        "model.source=config needs model.arch (the HF config kwargs of the random-init model); "
        "use a preset such as model=tiny, or set model.arch.hidden_size=... etc.",
    )
    for key in _LATENT_KEYS:
        if key in model.arch:
            _check_latent_size(key, model.arch[key])
    _check_attention_keys(model.arch)


def _check_attention_keys(arch: Mapping[str, Any]) -> None:
    """What ds_ulysses_ext/models.py check_attention_config refuses at model load, here before it when arch says it
    (the engine runs the context-parallel attention at every cp, 1 included)."""
    dropout = arch.get("attention_dropout", 0) or 0
    _require(
        not dropout,
        f"model.arch.attention_dropout={dropout}: the context-parallel attention applies no dropout, and a dropout "
        "mask drawn on each rank's share could never be checked against the unsplit model; set "
        "model.arch.attention_dropout=0",
    )
    _require(
        "is_causal" not in arch,
        f"model.arch.is_causal={arch.get('is_causal')}: transformers reads it for its own masks only (false: "
        "bidirectional), and the context-parallel attention is causal only and refuses the is_causal it would be "
        "handed; remove model.arch.is_causal (~model.arch.is_causal)",
    )


def _check_latent_size(key: str, size: int) -> None:
    if size > 0 and size % LATENT_ALIGN == 0:
        return
    lower = size // LATENT_ALIGN * LATENT_ALIGN
    nearest = [n for n in (lower, lower + LATENT_ALIGN) if n > 0]
    raise ConfigError(
        f"model.arch.{key}={size} is not a multiple of {LATENT_ALIGN}, which LatentMoE requires; "
        f"use model.arch.{key}={' or '.join(str(n) for n in nearest)}"
    )


def _check_data(data: DataConfig) -> None:
    if data.source == "jsonl":
        _require(bool(data.path), "data.source=jsonl needs data.path; set data.path=<.jsonl file or folder>")
        _require(
            bool(data.tokenizer_path),
            "data.source=jsonl needs data.tokenizer_path; set data.tokenizer_path=<local dir or hub id>",
        )
    _require(
        data.padding_side == "right",
        f"data.padding_side={data.padding_side}: left padding is not supported under cp: the boundary-token "
        "label shift assumes right padding; set data.padding_side=right",
    )
    _require(data.seq_len >= 1, f"data.seq_len={data.seq_len} must be >= 1")
    _require(
        0.0 <= data.masked_fraction < 1.0,
        f"data.masked_fraction={data.masked_fraction} must be in [0, 1) (1 would leave no token to train on); "
        "set e.g. data.masked_fraction=0.25",
    )
    _require(data.num_samples >= 1, f"data.num_samples={data.num_samples} must be >= 1")
    if data.source == "passkey":
        check_passkey(data)


def _check_logging(cfg: TrainConfig) -> None:
    # after _check_trainer, so a wrong trainer.max_steps is blamed on itself, not on this key
    ps, steps = cfg.logging.profile_step, cfg.trainer.max_steps
    _require(0 <= ps <= steps, f"logging.profile_step={ps} must be a step of this run, 1..trainer.max_steps={steps} "
             "(or 0 for no profiling)")


def _check_positions(cfg: TrainConfig, ring: int) -> None:
    # positions past what the model was built for silently extrapolate RoPE; known only when arch says it
    limit = cfg.model.arch.get("max_position_embeddings")
    padded = padded_seq_len(cfg.data.seq_len, cfg.parallelism.cp, ring)
    _require(
        not limit or padded <= limit,
        f"data.seq_len={cfg.data.seq_len} (padded to {padded} for cp) exceeds model.arch.max_position_embeddings="
        f"{limit}; shorten data.seq_len or raise model.arch.max_position_embeddings (RoPE will extrapolate)",
    )


def _rope_key(arch: Mapping[str, Any]) -> str:
    # HF reads rope_scaling first when both are given (convert_rope_params_to_dict)
    return "rope_scaling" if arch.get("rope_scaling") else "rope_parameters"


def _check_rope(cfg: TrainConfig, ring: int) -> None:
    """RoPE types under cp (ds_ulysses_ext/rope.py); known only when model.arch says the rope type."""
    cp, arch = cfg.parallelism.cp, cfg.model.arch
    if cp == 1:
        return
    key = _rope_key(arch)
    params = arch.get(key)
    unknown = unchecked_rope_types(params)
    _require(
        not unknown,
        f"model.arch.{key}.rope_type={unknown[0] if unknown else ''} is not one of the RoPE types checked under cp "
        f"{_fmt(CP_ROPE_TYPES)}; set model.arch.{key}.rope_type to one of them or run with parallelism.cp=1",
    )
    seq_len, padded = cfg.data.seq_len, padded_seq_len(cfg.data.seq_len, cp, ring)
    multiple = padded_seq_len(1, cp, ring)
    lower = seq_len // multiple * multiple
    _require(
        not depends_on_length(params) or padded == seq_len,
        f"data.seq_len={seq_len} is not a multiple of "
        + (f"parallelism.cp={cp}" if ring == 1 else f"{multiple} (2 x parallelism.cp={cp} with parallelism.ring={ring})")
        + f", and model.arch.{key} selects a RoPE "
        f"type that reads the sequence length ({_fmt(LENGTH_DEPENDENT_TYPES)}): the {padded - seq_len} pad tokens "
        f"cp adds would change its frequencies from the parallelism.cp=1 run's; set data.seq_len="
        + " or ".join(str(n) for n in (lower, padded) if n > 0),
    )


def _check_trainer(t: TrainerConfig) -> None:
    _require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    _require(
        0 <= t.warmup_steps <= t.max_steps,
        f"trainer.warmup_steps={t.warmup_steps} must be in [0, trainer.max_steps={t.max_steps}]; "
        "lower trainer.warmup_steps or raise trainer.max_steps",
    )
    _require(t.max_minutes >= 0, f"trainer.max_minutes={t.max_minutes} must be >= 0 (0 = no wall-time limit)")
    _require(
        t.stop_after_steps == 0 or 0 < t.stop_after_steps < t.max_steps,
        f"trainer.stop_after_steps={t.stop_after_steps} must be 0 (off) or less than "
        f"trainer.max_steps={t.max_steps}; set trainer.stop_after_steps=0 or below {t.max_steps}",
    )
    _require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size} must be >= 1")
    _require(t.global_batch_size >= 1, f"trainer.global_batch_size={t.global_batch_size} must be >= 1")
    _require(t.lr > 0, f"trainer.lr={t.lr} must be > 0")
    _require(0.0 <= t.min_lr_ratio <= 1.0, f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _require(t.grad_clip >= 0, f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    _one_of("trainer.on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    _one_of("trainer.on_corrupt_checkpoint", t.on_corrupt_checkpoint, CORRUPT_CHECKPOINT_POLICIES)
    _one_of("trainer.lr_decay", t.lr_decay, LR_DECAYS)
    _require(t.gc_every >= 0, f"trainer.gc_every={t.gc_every} must be >= 0 (0 = never collect manually)")
    _require(t.eval_every >= 0, f"trainer.eval_every={t.eval_every} must be >= 0 (0 = never evaluate)")
    _require(t.save_every >= 0, f"trainer.save_every={t.save_every} must be >= 0 (0 = only at the end)")
    _require(t.save_every_minutes >= 0,
             f"trainer.save_every_minutes={t.save_every_minutes} must be >= 0 (0 = no timed checkpoints)")
    _require(t.keep_checkpoints >= 0,
             f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0 = keep every checkpoint)")
    _require(t.loss_chunk_size >= 1, f"trainer.loss_chunk_size={t.loss_chunk_size} must be >= 1")


def _check_eval(cfg: TrainConfig) -> None:
    held, path, every = cfg.data.eval_samples, cfg.data.eval_path, cfg.trainer.eval_every
    _require(held >= 0, f"data.eval_samples={held} must be >= 0 (0 = no held-out set)")
    _require(
        not (held and path),
        f"data.eval_samples={held} and data.eval_path={path}: evaluate either on held-out training samples or on a "
        "validation file, not both; set data.eval_samples=0 or drop data.eval_path",
    )
    _require(
        not path or cfg.data.source == "jsonl",
        f"data.eval_path={path} needs data.source=jsonl (got {cfg.data.source}): the validation file is read like "
        "data.path, with data.tokenizer_path; use data.eval_samples to hold out part of other sources",
    )
    _require(
        (held > 0 or bool(path)) == (every > 0),
        f"data.eval_samples={held}, data.eval_path={path} and trainer.eval_every={every}: evaluation needs samples "
        "(data.eval_samples or data.eval_path) and how often to score them (trainer.eval_every), or neither; a "
        "held-out set that is never scored only takes data from training. Set both, or neither",
    )


def _layer_count_in_range(count: int, lowest: int, arch: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether lowest <= count <= the model's layers (when known), and the upper bound for a message."""
    num_layers = arch.get("num_hidden_layers")
    upper = f" and <= model.arch.num_hidden_layers={num_layers}" if num_layers else ""
    return count >= lowest and (not num_layers or count <= num_layers), upper


def _check_memory(mem: MemoryConfig, arch: Mapping[str, Any]) -> None:
    if mem.recompute == "block":
        ok, upper = _layer_count_in_range(mem.recompute_num_layers, 1, arch)
        _require(
            ok,
            f"memory.recompute=block needs memory.recompute_num_layers >= 1{upper}, got "
            f"{mem.recompute_num_layers}; set memory.recompute_num_layers (or use memory=full_recompute)",
        )
    _require(
        mem.budget_gib == 0 or mem.recompute in ("budget", "except_attention"),
        f"memory.budget_gib={mem.budget_gib} only applies to memory.recompute=budget or except_attention, got "
        f"{mem.recompute!r}; set memory.budget_gib=0 or choose one of those",
    )
    _require(
        not (mem.recompute == "except_attention" and mem.budget_gib > 0)
        or (mem.probe_none_gib > 0 and mem.recompute_num_layers == 0),
        "memory.recompute=except_attention with memory.budget_gib chooses recompute_num_layers from the probe: "
        "set memory.probe_none_gib and memory.probe_full_gib (peak_mem_gib of a step with recompute_num_layers=0 "
        "and with all layers) and leave memory.recompute_num_layers=0",
    )
    if mem.recompute == "except_attention":
        ok, upper = _layer_count_in_range(mem.recompute_num_layers, 0, arch)
        _require(
            ok,
            f"memory.recompute=except_attention takes memory.recompute_num_layers >= 0{upper} (layers "
            f"recomputed whole, attention included), got {mem.recompute_num_layers}",
        )
    _require(
        not mem.selective_kept or mem.recompute in ("block", "budget"),
        f"memory.selective_kept=true only applies to memory.recompute=block or budget, got "
        f"{mem.recompute!r}; use memory.recompute=selective for selective recompute alone",
    )
    _require(
        mem.recompute != "budget" or mem.budget_gib > 0,
        f"memory.recompute=budget needs memory.budget_gib > 0, got {mem.budget_gib}; "
        "set memory.budget_gib=<target peak GiB>",
    )
    _require(
        (mem.probe_none_gib > 0) == (mem.probe_full_gib > 0) and mem.probe_none_gib >= mem.probe_full_gib,
        f"memory.probe_none_gib={mem.probe_none_gib} and memory.probe_full_gib={mem.probe_full_gib}: give both "
        "(peak_mem_gib of a memory=none and a memory=full_recompute step), none >= full, or neither",
    )
    _require(
        not mem.tiled_mlp or mem.mlp_tile_tokens >= 1,
        f"memory.tiled_mlp=true needs memory.mlp_tile_tokens >= 1, got {mem.mlp_tile_tokens}",
    )
    _require(
        mem.offload_max_gib >= 0 and (mem.offload_max_gib == 0 or mem.offload_activations),
        f"memory.offload_max_gib={mem.offload_max_gib} must be >= 0 and only caps memory.offload_activations=true "
        f"(got offload_activations={mem.offload_activations}); set memory.offload_activations=true or "
        "memory.offload_max_gib=0",
    )


def _check_deepspeed(cfg: TrainConfig) -> None:
    stage = cfg.deepspeed.zero_stage
    _require(
        stage in ZERO_STAGES,
        f"deepspeed.zero_stage={stage} is not supported: exactness under cp is verified for ZeRO-2 and "
        "ZeRO-3 only; use deepspeed=zero2 or deepspeed=zero3",
    )
    _require(
        not cfg.deepspeed.offload_param or stage == 3,
        f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {stage}: only ZeRO-3 partitions "
        "parameters); use deepspeed=zero3_offload or set deepspeed.offload_param=false",
    )
    # a bf16 master copy of fp32 weights would only round every update the fp32 model receives
    _require(
        cfg.deepspeed.master_weights == "fp32" or cfg.precision == "bf16",
        f"deepspeed.master_weights={cfg.deepspeed.master_weights} needs precision=bf16 (got precision="
        f"{cfg.precision}: the master weights cannot be narrower than the model's); set precision=bf16 or "
        "deepspeed.master_weights=fp32",
    )


def _check_parallelism(cfg: TrainConfig, world_size: int) -> int:
    """Check cp/ep/tp against the world and the model shape; return dp."""
    par = cfg.parallelism
    _require(world_size >= 1, f"world_size={world_size} must be >= 1 (the number of ranks, WORLD_SIZE)")
    _require(par.cp >= 1, f"parallelism.cp={par.cp} must be >= 1; use parallelism.cp=1 to turn cp off")
    _require(par.ep >= 1, f"parallelism.ep={par.ep} must be >= 1; use parallelism.ep=1 to turn ep off")
    _require(
        par.tp <= 1 or par.cp == 1,
        f"TP+CP is not supported: parallelism.tp={par.tp} with parallelism.cp={par.cp}; "
        "set parallelism.tp=1 and split long sequences with parallelism.cp",
    )
    _require(
        par.tp == 1,
        f"parallelism.tp={par.tp}: tensor parallelism is not supported yet; set parallelism.tp=1 "
        "(use parallelism.cp to split long sequences, ZeRO-3 to shard the weights)",
    )
    _require(
        world_size % par.cp == 0,
        f"parallelism.cp={par.cp} does not divide the world size {world_size}; "
        f"choose parallelism.cp in {_fmt(_divisors(world_size))}",
    )
    # seq_len need not divide by cp (the batch is padded up to a multiple of cp), but every rank needs a token.
    _require(
        cfg.data.seq_len >= par.cp,
        f"data.seq_len={cfg.data.seq_len} is shorter than parallelism.cp={par.cp}; "
        f"raise data.seq_len to at least {par.cp} or lower parallelism.cp",
    )
    if str(par.ring).strip() == "1":  # pure Ulysses asked for; any other ring is checked by resolve_ring
        _check_heads(cfg.model.arch, par.cp, world_size)
    _check_experts(cfg.model, par.ep, world_size)
    return world_size // par.cp


def _check_heads(arch: Mapping[str, Any], cp: int, world_size: int) -> None:
    num_q = arch.get("num_attention_heads")
    if num_q is None:
        return  # a pretrained preset without head counts: enable_context_parallel checks at model load
    num_kv = arch.get("num_key_value_heads", num_q)  # HF's default: one kv head per query head
    # Ulysses gives each cp rank num_q / cp query heads; kv heads are split too, or replicated when cp > num_kv
    splits = valid_cp_values(num_q, num_kv)
    if cp in splits:
        return
    valid = [c for c in _divisors(world_size) if c in splits]
    raise ConfigError(
        f"parallelism.cp={cp} cannot split the heads of model.arch.num_attention_heads={num_q}, "
        f"model.arch.num_key_value_heads={num_kv}: Ulysses needs num_attention_heads % cp == 0 and "
        f"num_key_value_heads % cp == 0 or cp % num_key_value_heads == 0; "
        f"choose parallelism.cp in {_fmt(valid)} (world size {world_size}), or add a ring: parallelism.ring=auto"
    )


def _check_experts(model: ModelConfig, ep: int, world_size: int) -> None:
    _require(
        world_size % ep == 0,
        f"parallelism.ep={ep} does not divide the world size {world_size}; "
        f"choose parallelism.ep in {_fmt(_divisors(world_size))}",
    )
    key = next((k for k in _EXPERT_KEYS if k in model.arch), None)
    if key is None:
        _require(
            ep == 1 or model.family in MOE_FAMILIES,
            f"parallelism.ep={ep} but model.family={model.family} has no experts; set parallelism.ep=1",
        )
        return  # an MoE preset without an expert count: checked at model load
    num_experts = model.arch[key]
    valid = [e for e in _divisors(num_experts) if world_size % e == 0]
    _require(
        num_experts % ep == 0,
        f"parallelism.ep={ep} does not divide model.arch.{key}={num_experts}; "
        f"choose parallelism.ep in {_fmt(valid)} (world size {world_size})",
    )


def _check_batch(t: TrainerConfig, dp: int) -> int:
    """Return grad_accum = global / (micro * dp), refusing a global batch that does not split evenly."""
    per_pass = t.micro_batch_size * dp  # samples in one micro-step over all dp ranks
    if t.global_batch_size % per_pass:
        lower = t.global_batch_size // per_pass * per_pass
        nearby = " or ".join(str(n) for n in (lower, lower + per_pass) if n > 0)
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
            f"trainer.micro_batch_size * dp = {t.micro_batch_size} * {dp} = {per_pass}; "
            f"use trainer.global_batch_size={nearby} (or change trainer.micro_batch_size or parallelism.cp)"
        )
    return t.global_batch_size // per_pass
