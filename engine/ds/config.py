"""to_deepspeed_dict: the only module that spells DeepSpeed JSON keys.

The gradient-reduction path is pinned here (ZeRO-3 reduce_scatter on, no pre/post-divide tricks) so
that engine/ds/grad_reduction.py can state the exact scale, and the engine checks the path at start-up.
"""
from __future__ import annotations

from configs import Plan, TrainConfig
from configs.precision import bf16_weights


def effective_zero_stage(cfg: TrainConfig, world_size: int) -> int:
    """ZeRO-3 on a single rank partitions over one rank, which saves nothing over ZeRO-2 while its module
    hooks cost a fixed time per step (on CPU, with a 16-layer model, more than the rest of the step), so a
    world-1 run uses ZeRO-2 unless parameters are offloaded (which only ZeRO-3 does)."""
    ds = cfg.deepspeed
    if ds.zero_stage == 3 and world_size == 1 and not ds.offload_param:
        return 2
    return ds.zero_stage


def to_deepspeed_dict(cfg: TrainConfig, plan: Plan, load_universal: bool = False) -> dict:
    """`load_universal`: the resume loads a re-partitioned copy (engine/checkpoints/reshard.py)."""
    ds = cfg.deepspeed
    stage = effective_zero_stage(cfg, plan.world_size)
    if stage == 0:
        return _zero0_dict(cfg, plan)
    alone = plan.world_size == 1
    zero: dict = {
        "stage": stage,
        "overlap_comm": ds.overlap_comm and not alone,  # alone there is no reduction to overlap with
        "contiguous_gradients": ds.contiguous_gradients,
        "reduce_bucket_size": reduce_bucket_elements(cfg, plan),
        "reduce_scatter": True,  # pinned: grad_reduction.py's scale assumes it
    }
    if stage == 3:
        zero.update({
            "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
            "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
            "stage3_gather_16bit_weights_on_model_save": False,
        })
        if ds.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": cfg.trainer.grad_clip,
        "sequence_parallel_size": plan.cp,
        "zero_optimization": zero,
        "bf16": bf16_section(cfg),
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "steps_per_print": 1 << 30,  # our own logger reports every step
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    if ds.offload_optimizer:
        # ZeRO-Offload needs DeepSpeed's CPU Adam; it refuses a client torch optimizer
        config["optimizer"] = {"type": "AdamW", "params": optimizer_params(cfg)}
    return config


def _zero0_dict(cfg: TrainConfig, plan: Plan) -> dict:
    """deepspeed=zero0 (one rank, configs/parallel.py check_zero0): DeepSpeed runs the loop around our optimizer,
    engine/ds/clipping_adamw.py, which clips inside its fused step. So DeepSpeed's own clip is off (a separate pass
    and a host sync), and its bf16 mode too: the parameters are already the model's dtype, and at ZeRO-0 that mode
    would wrap the optimizer in DeepSpeed's BF16_Optimizer with an fp32 copy of every weight and gradient."""
    return {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": plan.cp,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": False},
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


DEFAULT_BUCKET = 500_000_000  # DeepSpeed's own default: large messages for NCCL between GPUs
ALONE_BUCKET = 20_000_000  # one rank reduces nothing: the bucket only stages a copy (40 MB in bf16)


def reduce_bucket_elements(cfg: TrainConfig, plan: Plan) -> int:
    """deepspeed.reduce_bucket_size, or (0) one sized to the run. DeepSpeed holds one bucket (two with overlap_comm)
    of this many gradient elements for the whole run: 5e8 is 1 GB in bf16, 2 GB with overlap, which a single rank
    spends on copies only (its "reduction" is the identity), a third of the 1B model's weights and gradients."""
    if cfg.deepspeed.reduce_bucket_size:
        return cfg.deepspeed.reduce_bucket_size
    return ALONE_BUCKET if plan.world_size == 1 else DEFAULT_BUCKET


def bf16_section(cfg: TrainConfig) -> dict:
    # DeepSpeed's per-tensor bf16 overflow scan runs only where trainer.on_nonfinite=skip asks for it (its ZeRO-2
    # bf16 path skips no step without it). Under abort the loop stops on the global grad norm, which is already
    # non-finite whenever any gradient element is
    section = {"enabled": bf16_weights(cfg.precision), "check_grad_overflow": cfg.trainer.on_nonfinite == "skip"}
    if cfg.deepspeed.master_weights == "bf16":
        # both keys: DeepSpeed 0.19.8 allows bf16 master weights beside fp32 moments only with ZeRO-Offload's
        # CPU Adam. Offload needs nothing more: DeepSpeed builds that CPU Adam from our "optimizer" section and,
        # seeing bf16_optimizer_states, with bf16 moments (fp32_optimizer_states=False), as its ZeRO requires.
        section.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return section


def optimizer_params(cfg: TrainConfig) -> dict:
    t = cfg.trainer
    return {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps, "weight_decay": t.weight_decay}
