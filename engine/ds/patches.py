"""Every monkeypatch of DeepSpeed lives here: one plain function per patch, applied by the engine at start-up.

The rule: no other module (library, engine, scripts, tests) patches DeepSpeed. A patch here changes how
DeepSpeed does something, never what it computes (beyond rounding), and says which DeepSpeed version it was written against;
each is idempotent, so callers may apply it more than once (tests do). engine/ds/distributed.py applies them
before the process group exists; tests/dist_harness.py applies the shm skip for the multi-rank tests.
"""
from __future__ import annotations

import torch

from .clipping_adamw import clip_divisor, squared_norm


def skip_deepspeed_shm_build() -> None:
    """Stop DeepSpeed's CPU accelerator from JIT-compiling `deepspeed_shm_comm` at init (35-75 s).

    That op only serves inference all-reduce; training never uses it, and DeepSpeed 0.19 has no switch
    to skip it (TorchBackend.__init__ builds the op through the CPU accelerator's op builder).
    `import deepspeed.comm.torch` would return the torch module (a name clash inside deepspeed.comm),
    hence importlib.
    """
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def one_pass_zero2_grad_norm() -> None:
    """Make DeepSpeed's ZeRO-1/2 gradient norm one multi-tensor pass instead of a copy and a kernel per tensor.

    DeepSpeedZeroOptimizer.get_grad_norm_direct (0.19.8) copies each gradient to fp64 and reduces each copy
    in its own kernel: two launches per tensor, a measurable part of the optimizer step (docs/benchmarks.md,
    section G), paid every step, since the norm is logged and clipped on.
    torch._foreach_norm computes the per-tensor norms in a few launches with fp32 accumulation; their squares
    are summed in fp64 as DeepSpeed sums its own. The result agrees to ~1e-7 relative. Which tensors count,
    the reductions over the dp and model-parallel groups, and inf/NaN -> -1 stay DeepSpeed's. Other norm
    types keep DeepSpeed's method.
    """
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed import comm as ds_dist

    original = DeepSpeedZeroOptimizer.get_grad_norm_direct
    if getattr(original, "_one_pass", False):
        return

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return original(self, gradients, params, norm_type)
        grads = [g.detach() for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
                 if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
                 and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
        total = squared_norm(grads, self.device)
        ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total, op=ds_dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=self.device)
        return total

    get_grad_norm_direct._one_pass = True
    DeepSpeedZeroOptimizer.get_grad_norm_direct = get_grad_norm_direct


def clip_inside_fused_adam() -> None:
    """Fold ZeRO-1/2's unscale-and-clip into torch's fused Adam(W) step instead of a separate pass over every gradient.

    DeepSpeedZeroOptimizer.step (0.19.8) multiplies the flat fp32 gradient partition by 1 / (clip coefficient x loss
    scale) in its own kernel (`unscale_and_clip_grads`), then runs the optimizer, which reads every gradient again:
    12-19 ms of a 40 ms optimizer phase for 3.1B parameters on an H200 (issue 22's profile). torch's fused
    Adam/AdamW divide each gradient by a device scalar `grad_scale` inside their one kernel (the hook GradScaler
    uses), so the same coefficient, computed as a device tensor from DeepSpeed's own formula (no host sync), is
    handed to it there. The update is the same up to rounding (g / c instead of g x (1 / c)). Any other
    optimizer (DeepSpeed's CPU Adam under ZeRO-Offload, a non-fused torch one) keeps DeepSpeed's pass.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.unscale_and_clip_grads
    if getattr(original, "_into_fused_adam", False):
        return

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        opt = self.optimizer
        if not takes_grad_scale(opt) or getattr(self, "torch_autocast_gradscaler", None):
            return original(self, grad_groups_flat, total_norm)
        opt.grad_scale = None  # a step without clipping or loss scale divides by nothing
        if self.clip_grad == 0.0 and self.loss_scale == 1.0:
            return
        device = grad_groups_flat[0].device
        if self.clip_grad > 0.0:
            norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
            opt.grad_scale = clip_divisor(norm, self.clip_grad, float(self.loss_scale))
        else:
            opt.grad_scale = torch.as_tensor(float(self.loss_scale), dtype=torch.float32, device=device).reshape(())

    unscale_and_clip_grads._into_fused_adam = True
    DeepSpeedZeroOptimizer.unscale_and_clip_grads = unscale_and_clip_grads


def takes_grad_scale(optimizer) -> bool:
    """torch's fused Adam / AdamW: their step divides each gradient by `optimizer.grad_scale` in-kernel."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and all(g.get("fused") for g in optimizer.param_groups))


def share_master_weights(engine) -> bool:
    """ZeRO-1/2 with master weights in the parameters' own dtype: let the master partition BE the parameters' slice.

    DeepSpeedZeroOptimizer (0.19.8) always clones this rank's partition of the flat parameter buffer into
    `single_partition_of_fp32_groups`, steps the optimizer on the clone, and copies the clone back into the
    parameters after every step. When both are the same dtype (deepspeed.master_weights=bf16 in bf16, or fp32
    training) the clone is a second copy of the weights (2.3 GiB for a 1.2B model in bf16) and the copy back a pass
    over them. Pointing the master tensors at the parameters' slices makes the optimizer update the parameters in
    place; the copy back becomes a copy onto itself. The values are those DeepSpeed computes: the clone always
    equals the parameters between steps. Checkpoints save and load the same tensors (now one storage).
    Returns whether it applied; CPU offload keeps the master on the host, other stages own their buffers.
    """
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload:
        return False
    shared = []
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        part = opt.parallel_partitioned_bit16_groups[i][ds_dist.get_rank(group=opt.real_dp_process_group[i])]
        if part.dtype != master.dtype or part.numel() != master.numel() or part.device != master.device:
            return False
        shared.append((master, part))
    for master, part in shared:
        master.data = part.data
    # DeepSpeed's per-parameter views of the master partition (`_hp_mapping`, for checkpoints and safe_get_*) were
    # cut from the clone: cut them again from the shared storage, or they alone keep the clone alive (seen on the
    # H200: 2.3 GiB stayed allocated with no master copy counted)
    opt._link_all_hp_params()
    return True


def no_reduction_alone(engine) -> None:
    """ZeRO-0 on one rank: turn off DeepSpeed's end-of-backward gradient all-reduce (0.19.8 `allreduce_gradients`,
    taken whenever `enable_backward_allreduce`). Over a group of one it changes no value, yet it flattens the
    gradients into buckets of up to 5e8 elements and copies them back: a second copy of every gradient at the end of
    the backward, the very peak ZeRO-0 exists to avoid (engine/ds/clipping_adamw.py)."""
    engine.enable_backward_allreduce = False


EXPERT_GROUP_NAME = "ds_ulysses_ep"


def mark_expert_parallel(expert_params, topology) -> None:
    """Give DeepSpeed's ZeRO-3 the expert parameters of one EP rank as expert-parallel, before it partitions them.

    DeepSpeed 0.19.8 has the mechanism (written for its AutoEP layer), but only AutoEP's own modules get it:
    - `ds_zero_partition_process_group` = the EDP group: zero.Init's conversion partitions the parameter over the
      replicas of this expert shard, and ZeRO-3 reduce-scatters its gradient there only, never averaging it with
      another rank's different experts (without it every parameter is partitioned over all ranks);
    - family "autoep_expert" with a registered group name: ZeRO-3 then averages the gradient by the world size,
      as it does dense gradients (stage3 `_gradient_averaging_world_size`), so the engine's one loss scale
      (dp x cp, engine/ds/grad_reduction.py) is exact for experts too, and it adds the expert sub-groups' squared
      norms over the EP group (`get_grad_norm_direct`), so the norm covers every expert once.
    The group name is put into DeepSpeed's own registry of expert groups (`deepspeed.utils.groups`), which is
    where that code looks it up. Tested for exactness against one process (tests/test_moe_engine.py).
    """
    from deepspeed.utils import groups
    groups._EXPERT_PARALLEL_GROUP[EXPERT_GROUP_NAME] = topology.ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[EXPERT_GROUP_NAME] = topology.edp_group
    for p in expert_params:
        if hasattr(p, "ds_id"):
            raise RuntimeError("an expert parameter was ZeRO-partitioned before it was marked; mark experts before "
                               "deepspeed.initialize")
        p.allreduce = False
        p.group_name = EXPERT_GROUP_NAME
        p.ds_zero_placement_family = "autoep_expert"
        p.ds_zero_partition_group_name = EXPERT_GROUP_NAME
        p.ds_zero_partition_process_group = topology.edp_group
