"""TrainerConfig: the optimisation loop (steps, batch, optimizer, schedule, checkpoints)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from configs.errors import ConfigError, one_of, require

if TYPE_CHECKING:  # configs.train imports this module
    from configs.train import TrainConfig

NONFINITE_POLICIES = ("abort", "skip")
LR_DECAYS = ("cosine", "linear", "constant")
CORRUPT_CHECKPOINT_POLICIES = ("fallback", "abort")


@dataclass
class TrainerConfig:
    max_steps: int = 10  # optimizer steps in the whole run (a resumed run continues up to this)
    # Samples per optimizer step, over all ranks. Gradient accumulation is derived:
    # global_batch_size // (micro_batch_size * dp), and must come out whole.
    global_batch_size: int = 4
    micro_batch_size: int = 1  # samples per forward/backward on one dp rank (one cp group)
    lr: float = 1e-3  # peak learning rate (AdamW)
    lr_decay: str = "cosine"  # after warmup: cosine | linear to lr * min_lr_ratio at max_steps, or constant
    min_lr_ratio: float = 0.1  # after warmup the lr decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 2  # linear warmup steps, counted in max_steps
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    # A step whose loss or gradient norm is inf/NaN. abort: the run stops with an error after logging that step,
    # and saves nothing after it. skip: DeepSpeed drops the update and the step is logged with "skipped": true.
    # DeepSpeed's ZeRO-3 and fp32 paths judge by the gradient norm; its bf16 ZeRO-2 path needs a scan of every
    # gradient tensor before each step (~1,000 small kernels for a 16-layer model, 24 ms per step at 1B on an
    # H200), which is turned on for skip only (engine/ds/config.py).
    on_nonfinite: str = "abort"
    # Python GC every N steps on all ranks together: a collection that lands on one rank alone stalls the
    # collectives of all the others. 0 = never collect manually.
    gc_every: int = 50
    # every N steps and at the last step: the loss on the data.eval_samples held-out samples (metrics eval_loss,
    # eval_tokens); 0 = never
    eval_every: int = 0
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end (if save_at_end)
    # also checkpoint after the first step that ends this many minutes after the last checkpoint (or the start):
    # a preemption then loses at most about that much work, however long a step is; 0 = off
    save_every_minutes: float = 0.0
    save_at_end: bool = True
    # after each save, delete all but the newest N checkpoints (the one `latest` names among them); 0 = keep all
    keep_checkpoints: int = 0
    resume: bool = True  # resume from out_dir's latest checkpoint if there is one
    # `latest` fails its manifest check (a file cut short or changed). fallback: resume from the newest older
    # checkpoint that verifies, with a warning (exact: the steps since are computed again, identically; an
    # unattended, requeued job keeps going). abort: stop with an error naming the files
    on_corrupt_checkpoint: str = "fallback"
    # a ZeRO-3 checkpoint written by another number of ranks: re-partition it (DeepSpeed's universal checkpoint,
    # a temporary copy of the fp32 weights and Adam moments) and continue exactly; false: refuse (engine/checkpoints/reshard.py)
    reshard_on_resume: bool = True
    # end the run after the first step that ends this many minutes after the start, as the last step would (final
    # eval, checkpoint, HF export): for jobs with a wall-time limit. The lr schedule still runs to max_steps. 0 = off
    max_minutes: float = 0.0
    stop_after_steps: int = 0  # debug/tests: exit after N steps as if interrupted (to test resume); 0 = off
    export_hf: bool = True  # at the end, write an HF `save_pretrained` folder of the trained model
    # tokens per chunk of the chunked logits + loss (full-vocab logits never exist); 0: sized to the vocabulary, the
    # fp32 [chunk, vocab] block at most 1 GiB (ds_ulysses_ext/loss.py chunk_tokens: 2048 at a 128k vocabulary)
    loss_chunk_size: int = 0
    # compute each chunk's gradients in forward instead of recomputing lm_head in backward (ds_ulysses_ext/loss.py)
    fused_loss: bool = True
    # AdamW steps each parameter as soon as backward has its gradient, which is then freed: no step holds every
    # gradient at once (2.3 GiB at 1B, 5.8 GiB for the 4-layer Qwen3-30B-A3B shape in bf16). The same updates as
    # the step after backward, which is why it needs deepspeed=zero0, no clipping (trainer.grad_clip=0: the clip
    # needs every gradient's norm first), one micro-batch per step and on_nonfinite=abort (a skipped step would
    # have to undo updates already made). engine/ds/clipping_adamw.py
    optimizer_in_backward: bool = False


def check_trainer(t: TrainerConfig) -> None:
    require(t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    require(
        0 <= t.warmup_steps <= t.max_steps,
        f"trainer.warmup_steps={t.warmup_steps} must be in [0, trainer.max_steps={t.max_steps}]; "
        "lower trainer.warmup_steps or raise trainer.max_steps",
    )
    require(t.max_minutes >= 0, f"trainer.max_minutes={t.max_minutes} must be >= 0 (0 = no wall-time limit)")
    require(
        t.stop_after_steps == 0 or 0 < t.stop_after_steps < t.max_steps,
        f"trainer.stop_after_steps={t.stop_after_steps} must be 0 (off) or less than "
        f"trainer.max_steps={t.max_steps}; set trainer.stop_after_steps=0 or below {t.max_steps}",
    )
    require(t.micro_batch_size >= 1, f"trainer.micro_batch_size={t.micro_batch_size} must be >= 1")
    require(t.global_batch_size >= 1, f"trainer.global_batch_size={t.global_batch_size} must be >= 1")
    require(t.lr > 0, f"trainer.lr={t.lr} must be > 0")
    require(0.0 <= t.min_lr_ratio <= 1.0, f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    require(t.grad_clip >= 0, f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    one_of("trainer.on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    one_of("trainer.on_corrupt_checkpoint", t.on_corrupt_checkpoint, CORRUPT_CHECKPOINT_POLICIES)
    one_of("trainer.lr_decay", t.lr_decay, LR_DECAYS)
    require(t.gc_every >= 0, f"trainer.gc_every={t.gc_every} must be >= 0 (0 = never collect manually)")
    require(t.eval_every >= 0, f"trainer.eval_every={t.eval_every} must be >= 0 (0 = never evaluate)")
    require(t.save_every >= 0, f"trainer.save_every={t.save_every} must be >= 0 (0 = only at the end)")
    require(t.save_every_minutes >= 0,
            f"trainer.save_every_minutes={t.save_every_minutes} must be >= 0 (0 = no timed checkpoints)")
    require(t.keep_checkpoints >= 0,
            f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0 = keep every checkpoint)")
    require(t.loss_chunk_size >= 0, f"trainer.loss_chunk_size={t.loss_chunk_size} must be >= 1 (or 0: sized to "
            "the vocabulary)")


def check_optimizer_in_backward(cfg: "TrainConfig", grad_accum: int) -> None:
    """trainer.optimizer_in_backward gives the same updates as the step after backward only where each parameter's
    update depends on its own gradient alone, and only once per step."""
    if not cfg.trainer.optimizer_in_backward:
        return
    t, why = cfg.trainer, "trainer.optimizer_in_backward=true steps each parameter during backward"
    require(cfg.deepspeed.zero_stage == 0,
            f"{why}, on the parameters themselves: it needs deepspeed=zero0 (got deepspeed.zero_stage="
            f"{cfg.deepspeed.zero_stage}, where DeepSpeed reduces and steps its own gradient partition after "
            "backward); set deepspeed=zero0 or trainer.optimizer_in_backward=false")
    require(t.grad_clip == 0,
            f"{why}, before the global gradient norm is known, so it cannot clip by it (got trainer.grad_clip="
            f"{t.grad_clip}); set trainer.grad_clip=0 or trainer.optimizer_in_backward=false")
    require(grad_accum == 1,
            f"{why}, so every micro-batch would step it again: it needs one micro-batch per optimizer step (got "
            f"{grad_accum}: trainer.global_batch_size={t.global_batch_size}, trainer.micro_batch_size="
            f"{t.micro_batch_size}); set trainer.global_batch_size equal to trainer.micro_batch_size x dp, or "
            "trainer.optimizer_in_backward=false")
    require(t.on_nonfinite == "abort",
            f"{why}: a non-finite gradient is seen after earlier parameters were already updated, so "
            "trainer.on_nonfinite=skip could not leave the step undone; set trainer.on_nonfinite=abort or "
            "trainer.optimizer_in_backward=false")


def check_eval(cfg: "TrainConfig") -> None:
    held, path, every = cfg.data.eval_samples, cfg.data.eval_path, cfg.trainer.eval_every
    require(held >= 0, f"data.eval_samples={held} must be >= 0 (0 = no held-out set)")
    require(
        not (held and path),
        f"data.eval_samples={held} and data.eval_path={path}: evaluate either on held-out training samples or on a "
        "validation file, not both; set data.eval_samples=0 or drop data.eval_path",
    )
    require(
        not path or cfg.data.source == "jsonl",
        f"data.eval_path={path} needs data.source=jsonl (got {cfg.data.source}): the validation file is read like "
        "data.path, with data.tokenizer_path; use data.eval_samples to hold out part of other sources",
    )
    require(
        (held > 0 or bool(path)) == (every > 0),
        f"data.eval_samples={held}, data.eval_path={path} and trainer.eval_every={every}: evaluation needs samples "
        "(data.eval_samples or data.eval_path) and how often to score them (trainer.eval_every), or neither; a "
        "held-out set that is never scored only takes data from training. Set both, or neither",
    )


def check_batch(t: TrainerConfig, dp: int) -> int:
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
