"""Keys a run reads only under a condition. Set away from its default while the condition is false, a key would be
accepted and ignored: check_conditional_keys refuses it, or, where ignoring it cannot change what is trained (a
checkpoint or logging knob), returns a warning that the run logs once.

CONDITIONAL: key -> Rule(when the key is read, that condition in override syntax, refuse or warn).
UNCONDITIONAL: every other leaf of TrainConfig; each path reads it (or a check of its own group refuses the values
that path cannot take). tests/test_config_keys.py walks the config tree: a new key must be classified here.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Callable

from configs.errors import ConfigError
from configs.linear_attention import LINEAR_FAMILIES
from configs.moe import EP_FAMILIES


@dataclass(frozen=True)
class Rule:
    read: Callable[[Any], bool]  # cfg -> whether the run reads the key
    when: str  # that condition, in override syntax, for the message
    warn: bool = False  # True: ignoring it changes nothing trained, so a warning; False: refused
    moe: bool = False  # read only for a model with MoE layers (and then when `read` says)


def _always(cfg) -> bool:
    return True


_PASSKEY = Rule(lambda c: c.data.source == "passkey", "data.source=passkey")

CONDITIONAL: dict[str, Rule] = {
    "model.path": Rule(lambda c: c.model.source == "pretrained", "model.source=pretrained"),
    "data.path": Rule(lambda c: c.data.source != "synthetic", "data.source=jsonl, passkey or demo"),
    "data.format": Rule(lambda c: c.data.source in ("jsonl", "demo"), "data.source=jsonl or demo"),
    "data.tokenizer_path": Rule(lambda c: c.data.source != "synthetic", "data.source=jsonl, passkey or demo"),
    "data.masked_fraction": Rule(lambda c: c.data.source == "synthetic", "data.source=synthetic"),
    "data.num_samples": Rule(lambda c: c.data.source in ("synthetic", "passkey"), "data.source=synthetic or passkey"),
    "data.overlong": Rule(lambda c: c.data.source in ("jsonl", "demo"), "data.source=jsonl or demo", warn=True),
    "data.on_bad_line": Rule(lambda c: c.data.source in ("jsonl", "demo"), "data.source=jsonl or demo", warn=True),
    **{f"data.passkey.{k}": _PASSKEY for k in (
        "lengths", "depth_min", "depth_max", "key", "key_length", "num_needles", "num_distractors", "filler",
        "eval_lengths", "eval_depths", "eval_samples_per_cell")},
    "trainer.min_lr_ratio": Rule(lambda c: c.trainer.lr_decay != "constant", "trainer.lr_decay=cosine or linear"),
    "trainer.on_corrupt_checkpoint": Rule(lambda c: c.trainer.resume, "trainer.resume=true", warn=True),
    "trainer.reshard_on_resume": Rule(lambda c: c.trainer.resume, "trainer.resume=true", warn=True),
    "trainer.keep_checkpoints": Rule(
        lambda c: c.trainer.save_at_end or c.trainer.save_every > 0 or c.trainer.save_every_minutes > 0,
        "trainer.save_at_end=true, trainer.save_every > 0 or trainer.save_every_minutes > 0", warn=True),
    "memory.recompute_num_layers": Rule(lambda c: c.memory.recompute in ("block", "except_attention"),
                                        "memory.recompute=block or except_attention"),
    "memory.recompute_method": Rule(lambda c: c.memory.recompute in ("block", "except_attention"),
                                    "memory.recompute=block or except_attention"),
    # checked in configs/memory.py too (with their own messages, which come first)
    "memory.budget_gib": Rule(lambda c: c.memory.recompute in ("budget", "except_attention"),
                              "memory.recompute=budget or except_attention"),
    "memory.probe_none_gib": Rule(
        lambda c: c.memory.recompute == "budget" or (c.memory.recompute == "except_attention" and c.memory.budget_gib),
        "memory.recompute=budget, or except_attention with memory.budget_gib"),
    "memory.probe_full_gib": Rule(
        lambda c: c.memory.recompute == "budget" or (c.memory.recompute == "except_attention" and c.memory.budget_gib),
        "memory.recompute=budget, or except_attention with memory.budget_gib"),
    "memory.selective_kept": Rule(lambda c: c.memory.recompute in ("block", "budget"), "memory.recompute=block or budget"),
    "memory.offload_max_gib": Rule(lambda c: c.memory.offload_activations, "memory.offload_activations=true"),
    "memory.offload_inflight_gib": Rule(lambda c: c.memory.offload_activations or c.memory.attention_offload,
                                        "memory.offload_activations=true or memory.attention_offload=true"),
    "memory.mlp_tile_tokens": Rule(lambda c: c.memory.tiled_mlp, "memory.tiled_mlp=true"),
    "memory.attention_offload": Rule(lambda c: c.memory.recompute == "except_attention",
                                     "memory.recompute=except_attention"),
    "memory.auto_gpu_gib": Rule(lambda c: c.memory.auto, "memory=auto (memory.auto=true)"),
    "memory.auto_host_gib": Rule(lambda c: c.memory.auto, "memory=auto (memory.auto=true)"),
    # the loss head: with trainer.fused_loss=false the head is loss.py's unfused one whatever model.loss_head says,
    # and Liger's fused head chunks the tokens itself (trainer.loss_chunk_size is loss.py's)
    "model.loss_head": Rule(lambda c: c.trainer.fused_loss, "trainer.fused_loss=true"),
    "trainer.loss_chunk_size": Rule(lambda c: not (c.trainer.fused_loss and c.model.loss_head == "liger"),
                                    "model.loss_head=auto or ours, or trainer.fused_loss=false"),
    # the projection groups are bound with the fused kernels (kernels/bind.py); model.kernels=none binds nothing
    "model.projection_groups": Rule(lambda c: c.model.kernels != "none", "model.kernels=auto, liger or compile"),
    # the linear layers' delta rule (configs/linear_attention.py checks its values where it is read)
    "model.linear_attn_kernel": Rule(lambda c: c.model.family in LINEAR_FAMILIES,
                                     f"model.family in {{{', '.join(LINEAR_FAMILIES)}}}"),
    "deepspeed.stage3_param_persistence_threshold": Rule(lambda c: c.deepspeed.zero_stage == 3,
                                                         "deepspeed.zero_stage=3", warn=True),
    "deepspeed.stage3_prefetch_bucket_size": Rule(lambda c: c.deepspeed.zero_stage == 3, "deepspeed.zero_stage=3",
                                                  warn=True),
    **{f"deepspeed.{k}": Rule(lambda c: c.deepspeed.zero_stage != 0, "deepspeed=zero2 or zero3", warn=True)
       for k in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size")},  # ZeRO's buffers; zero0 has none
    **{f"fp8.{k}": Rule(lambda c: c.precision == "fp8", "precision=fp8")
       for k in ("recipe", "linears", "compile", "emulate_on_cpu")},
    "fp8.amax_history": Rule(lambda c: c.precision == "fp8" and c.fp8.recipe == "delayed",
                             "precision=fp8 and fp8.recipe=delayed"),
    "moe.dispatcher": Rule(_always, "", moe=True),
    "moe.balance": Rule(_always, "", moe=True),
    "moe.aux_loss_coef": Rule(lambda c: c.moe.balance == "aux", "moe.balance=aux", moe=True),
    "moe.bias_update_rate": Rule(lambda c: c.moe.balance == "bias", "moe.balance=bias", moe=True),
    "moe.recompute": Rule(_always, "", moe=True),

    "moe.recompute_group_size": Rule(lambda c: c.moe.recompute == "experts", "moe.recompute=experts", moe=True),
    "moe.offload_inputs": Rule(lambda c: c.moe.recompute == "experts", "moe.recompute=experts", moe=True),
    "logging.wandb.project": Rule(lambda c: c.logging.wandb.mode != "disabled", "logging.wandb.mode=offline or online",
                                  warn=True),
    "logging.wandb.entity": Rule(lambda c: c.logging.wandb.mode != "disabled", "logging.wandb.mode=offline or online",
                                 warn=True),
}

UNCONDITIONAL = (
    "run.seed", "run.out_dir", "run.name", "precision", "device", "dist_backend",
    # model.arch: the whole shape under source=config; under pretrained the checkpoint's config.json is the truth
    # and arch only repeats its counts for the checks before the load
    "model.name", "model.family", "model.source", "model.arch", "model.attn_backend", "model.kernels",
    "data.source", "data.seq_len", "data.eval_samples", "data.eval_path", "data.padding_side", "data.pack",
    "parallelism.cp", "parallelism.ring", "parallelism.ep", "parallelism.tp",
    "deepspeed.zero_stage", "deepspeed.offload_optimizer", "deepspeed.offload_param", "deepspeed.master_weights",
    "trainer.max_steps", "trainer.global_batch_size", "trainer.micro_batch_size", "trainer.lr", "trainer.lr_decay",
    "trainer.warmup_steps", "trainer.weight_decay", "trainer.adam_beta1", "trainer.adam_beta2", "trainer.adam_eps",
    "trainer.grad_clip", "trainer.on_nonfinite", "trainer.gc_every", "trainer.eval_every", "trainer.save_every",
    "trainer.save_every_minutes", "trainer.save_at_end", "trainer.resume", "trainer.max_minutes",
    "trainer.stop_after_steps", "trainer.export_hf", "trainer.fused_loss",
    "trainer.optimizer_in_backward",
    "memory.recompute", "memory.offload_activations", "memory.tiled_mlp", "memory.auto",
    "memory.expandable_segments",  # the CUDA allocator's; a CPU run has none to configure, and nothing changes
    "logging.wandb.mode", "logging.progress_bar", "logging.log_every", "logging.phase_times", "logging.profile_step",
    "logging.memory_snapshot_step", "logging.peak_tflops",
    # read only with W&B on, but every logging preset fills them from run.name / run.out_dir (so that turning W&B on
    # is one key): a warning here would fire on every run
    "logging.wandb.name", "logging.wandb.dir",
)


def leaves(obj, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """path -> (value, default) for every leaf field of a config dataclass tree."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if is_dataclass(value):
            out.update(leaves(value, path + "."))
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        out[path] = (value, default)
    return out


def check_conditional_keys(cfg) -> list[str]:
    """Refuse the keys set away from their default that this run would never read (every one, in one message);
    return a warning for each whose neglect changes nothing trained."""
    refused, warnings = [], []
    for path, (value, default) in leaves(cfg).items():
        rule = CONDITIONAL.get(path)
        if rule is None or value == default:
            continue
        drop = f"drop the override ({path}={default} is the default)"
        if rule.moe and cfg.model.family not in EP_FAMILIES:
            message = (f"{path}={value} is read only for a model with MoE layers (model.family in "
                       f"{{{', '.join(EP_FAMILIES)}}}), and model.family={cfg.model.family} has none, so it would be "
                       f"ignored; {drop}")
        elif not rule.read(cfg):
            message = (f"{path}={value} is read only with {rule.when}, which this run does not have, so it would be "
                       f"ignored; {drop} or set {rule.when}")
        else:
            continue
        (warnings if rule.warn else refused).append(message)
    if refused:
        raise ConfigError("; ".join(refused))
    return warnings
