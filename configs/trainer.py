"""TrainerConfig: the optimisation loop (steps, batch, optimizer, schedule, checkpoints)."""

from dataclasses import dataclass

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
    # H200), which is turned on for skip only (engine/ds_config.py).
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
    # a temporary copy of the fp32 weights and Adam moments) and continue exactly; false: refuse (engine/reshard.py)
    reshard_on_resume: bool = True
    # end the run after the first step that ends this many minutes after the start, as the last step would (final
    # eval, checkpoint, HF export): for jobs with a wall-time limit. The lr schedule still runs to max_steps. 0 = off
    max_minutes: float = 0.0
    stop_after_steps: int = 0  # debug/tests: exit after N steps as if interrupted (to test resume); 0 = off
    export_hf: bool = True  # at the end, write an HF `save_pretrained` folder of the trained model
    loss_chunk_size: int = 4096  # tokens per chunk of the chunked logits + loss (full-vocab logits never exist)
    # compute each chunk's gradients in forward instead of recomputing lm_head in backward (ds_ulysses_ext/loss.py)
    fused_loss: bool = True
