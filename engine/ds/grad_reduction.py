"""How DeepSpeed combines per-rank gradients under CP, and the scale that makes the step exact.

Each rank backprops its share  local_loss_sum / global_token_count  (ds_ulysses_ext/loss.py); the shares
of all ranks and micro-batches add up to the objective (docs/design.md §1.1), so the exact gradient is the SUM
of the per-rank gradients. DeepSpeed 0.19.8 does not sum; measured on CPU/gloo with SGD(lr=1) and the
weight update compared with the unsplit gradient (tests/test_engine.py::test_layouts_match_single_process
keeps measuring it):

    path                              what DeepSpeed applies            scale we multiply by
    ZeRO-3, reduce_scatter=true       mean over dp*cp ranks             dp * cp
    ZeRO-3, reduce_scatter=false      sum over cp, mean over dp         dp
    ZeRO-2 (either)                   sum over cp, mean over dp         dp
    ZeRO-0 (one rank only)            none (reduction turned off)       1
and DeepSpeed's backward() divides by gradient_accumulation_steps unless scale_wrt_gas=False, which
the step uses. ds_config.py pins reduce_scatter=true; check_engine() refuses anything else at start-up
so that a config change cannot silently break the scale.
"""
from __future__ import annotations

import torch.distributed as dist

from configs import Plan


def loss_scale(zero_stage: int, reduce_scatter: bool, plan: Plan) -> float:
    if zero_stage == 3 and reduce_scatter:
        return float(plan.dp * plan.cp)
    if zero_stage in (2, 3):
        return float(plan.dp)
    if zero_stage == 0 and plan.world_size == 1:
        return 1.0
    raise ValueError(f"ZeRO stage {zero_stage} has no verified gradient-reduction scale; use zero2 or zero3 "
                     "(deepspeed=zero2|zero3)")


def check_engine(engine, plan: Plan) -> float:
    """Assert the engine is on the measured reduction path and return the loss scale for it."""
    stage = engine.zero_optimization_stage()
    reduce_scatter = bool(engine.zero_reduce_scatter())
    problems = []
    if engine.gradient_predivide_factor() != 1.0 or engine.postscale_gradients() is not True:
        problems.append("gradient pre/post-division is changed")
    if engine.sequence_parallel_size != plan.cp:
        problems.append(f"engine sequence_parallel_size {engine.sequence_parallel_size} != cp {plan.cp}")
    if dist.get_world_size(engine.seq_data_parallel_group) != plan.world_size:
        problems.append("ZeRO's partition group is not all dp x cp ranks")
    if stage == 3:
        # expert shards (ep > 1) are partitioned over their expert-data-parallel group, world / ep ranks, and
        # marked so that ZeRO-3 averages them by the world size like the rest (engine/ds/patches.py)
        for p in engine.module.parameters():
            if not hasattr(p, "ds_process_group"):
                continue
            size = dist.get_world_size(p.ds_process_group)
            expert = getattr(p, "ds_zero_placement_family", None) == "autoep_expert"
            want = plan.world_size // plan.ep if expert else plan.world_size
            if size != want:
                problems.append(f"a ZeRO-3 {'expert ' if expert else ''}parameter is partitioned over {size} "
                                f"ranks, not {want}")
                break
    elif stage == 0 and (plan.world_size != 1 or engine.enable_backward_allreduce):
        problems.append("ZeRO-0 runs on one rank with DeepSpeed's gradient all-reduce off (engine/ds/patches.py)")
    elif plan.ep > 1:
        problems.append(f"ep={plan.ep} needs ZeRO-3: ZeRO-{stage} would average different ranks' experts")
    if engine.gradient_accumulation_steps() != plan.grad_accum:
        problems.append("gradient accumulation differs from the plan")
    if problems:
        raise RuntimeError("DeepSpeed is not on the gradient-reduction path whose scale was measured: "
                           + "; ".join(problems))
    return loss_scale(stage, reduce_scatter, plan)
