"""validate(cfg, world_size) -> Plan: every cross-field rule, checked before any model is loaded.

Each config group's module holds its own checks (configs/model.py check_model, configs/parallel.py
check_parallelism, ...); validate() runs them in turn and derives the Plan. Only _check_choices, the table of
every group's enum fields, lives here.
Each refusal is a ConfigError whose message names the field(s) and the fix, in override syntax where it
can (`parallelism.cp=2`), so the user can paste it. Rules about the model's shape read `model.arch`, or with
model.source=pretrained from a local folder the checkpoint's config.json (configs/model.py shape_arch); a hub
checkpoint's shape is known only at load, where the model is checked again.
The config is never mutated: derived values (dp, grad_accum) are returned in the Plan.
"""

from dataclasses import dataclass, field, replace

from configs.conditional import check_conditional_keys
from configs.data import BAD_LINE_POLICIES, DATA_FORMATS, DATA_SOURCES, OVERLONG_POLICIES, check_data
from configs.errors import one_of, require
from configs.linear_attention import check_linear_attention
from configs.log import WANDB_MODES, check_logging
from configs.memory import RECOMPUTE_METHODS, RECOMPUTE_POLICIES, check_memory
from configs.model import (ATTN_BACKENDS, MODEL_SOURCES, SUPPORTED_FAMILIES, check_model, check_positions, check_rope,
                           shape_arch)
from configs.moe import check_moe
from configs.parallel import MASTER_WEIGHTS, check_deepspeed, check_parallelism, resolve_ring
from configs.precision import PRECISIONS, check_fp8
from configs.device import DEVICES, DIST_BACKENDS, check_dist_backend
from configs.train import TrainConfig
from configs.trainer import check_batch, check_eval, check_optimizer_in_backward, check_trainer
from ds_ulysses_ext.kernels import KERNEL_MODES, LOSS_HEADS


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
    # keys set that this run never reads but whose neglect changes nothing trained (configs/conditional.py): the run
    # logs each once
    unread: tuple = field(default=(), compare=False)


def validate(cfg: TrainConfig, world_size: int) -> Plan:
    """Refuse any config that cannot run exactly on `world_size` ranks; return the derived Plan."""
    _check_choices(cfg)
    check_model(cfg.model)
    check_fp8(cfg)
    # from here on the shape rules read the checkpoint's own config.json where there is one (configs/model.py
    # shape_arch); a copy: the config itself is never changed
    cfg = replace(cfg, model=replace(cfg.model, arch=dict(shape_arch(cfg.model))))
    check_data(cfg.data)
    check_trainer(cfg.trainer)
    check_logging(cfg)
    check_eval(cfg)
    check_memory(cfg.memory, cfg.model.arch)
    check_deepspeed(cfg, world_size)
    check_linear_attention(cfg, world_size)  # before the head and ring rules: they do not know linear layers
    dp = check_parallelism(cfg, world_size)
    ring, ring_reason = resolve_ring(cfg)
    check_dist_backend(cfg, ring)
    check_moe(cfg, world_size)
    check_positions(cfg, ring)  # after parallelism.cp/ring are known to be valid: the padding depends on them
    check_rope(cfg)
    grad_accum = check_batch(cfg.trainer, dp)
    check_optimizer_in_backward(cfg, grad_accum)
    unread = check_conditional_keys(cfg)  # last: each group's own rules name their keys first
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
        unread=tuple(unread),
    )


def _check_choices(cfg: TrainConfig) -> None:
    """Every enum-like string field holds one of its known values."""
    require(
        cfg.precision != "fp16",
        "precision=fp16 is not supported (it needs loss scaling, which this engine does not do); "
        "use precision=bf16 on GPU or precision=fp32",
    )
    one_of("precision", cfg.precision, PRECISIONS)
    one_of("device", cfg.device, DEVICES)
    one_of("dist_backend", cfg.dist_backend, DIST_BACKENDS)
    one_of("deepspeed.master_weights", cfg.deepspeed.master_weights, MASTER_WEIGHTS)
    families = ", ".join(SUPPORTED_FAMILIES)
    require(
        cfg.model.family in SUPPORTED_FAMILIES,
        f"model.family={cfg.model.family} is not supported under cp; supported families: {families}; "
        "pick a model preset of one of them (e.g. model=tiny) or set model.family",
    )
    one_of("model.source", cfg.model.source, MODEL_SOURCES)
    one_of("model.attn_backend", cfg.model.attn_backend, ATTN_BACKENDS)
    one_of("model.kernels", cfg.model.kernels, KERNEL_MODES)
    one_of("model.loss_head", cfg.model.loss_head, LOSS_HEADS)
    require(cfg.model.loss_head != "liger" or cfg.model.kernels in ("liger", "auto"),
            f"model.loss_head=liger runs Liger-Kernel's head, and model.kernels={cfg.model.kernels} does not load "
            "Liger; set model.kernels=liger, or model.loss_head=auto")
    one_of("data.source", cfg.data.source, DATA_SOURCES, " (presets: data=synthetic, data=demo, data=jsonl)")
    one_of("data.format", cfg.data.format, DATA_FORMATS)
    one_of("data.overlong", cfg.data.overlong, OVERLONG_POLICIES)
    one_of("data.on_bad_line", cfg.data.on_bad_line, BAD_LINE_POLICIES)
    one_of("memory.recompute", cfg.memory.recompute, RECOMPUTE_POLICIES)
    one_of("memory.recompute_method", cfg.memory.recompute_method, RECOMPUTE_METHODS)
    one_of("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be >= 1")
