"""engine.ds.patches.one_pass_zero2_grad_norm: DeepSpeed's ZeRO-1/2 gradient norm, computed in one multi-tensor pass,
against DeepSpeed's own per-tensor fp64 method and against an fp64 reference over every rank's gradients."""
import math
from types import SimpleNamespace

import pytest
import torch

from dist_harness import patch_deepspeed_shm_build, run_ranks

SHAPES = [(64, 32), (32,), (7, 5, 3), (1000,)]


def _grads(rank, dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(s, generator=gen) * (1 + i)).to(dtype) for i, s in enumerate(SHAPES)]


def _fake_optimizer():
    # the attributes get_grad_norm_direct reads; no model parallelism, the dp group is the whole world
    return SimpleNamespace(model_parallel_rank=0, dp_process_group=None, device="cpu",
                           _model_parallel_all_reduce=lambda tensor, op: None)


def _check(rank, world, dtype, poison):
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    patch_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm over the harness's process group
    from engine.ds.patches import one_pass_zero2_grad_norm
    grads = _grads(rank, dtype)
    if poison and rank == world - 1:
        grads[2][0, 0, 0] = float("nan")
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    theirs = DeepSpeedZeroOptimizer.get_grad_norm_direct(_fake_optimizer(), grads, params)
    one_pass_zero2_grad_norm()
    ours = DeepSpeedZeroOptimizer.get_grad_norm_direct(_fake_optimizer(), grads, params)
    if poison:  # DeepSpeed's sentinel for a non-finite norm, kept
        assert float(ours) == float(theirs) == -1.0, (float(ours), float(theirs))
        return
    reference = math.sqrt(sum(float((g.double() ** 2).sum()) for r in range(world) for g in _grads(r, dtype)))
    assert abs(float(ours) - reference) / reference < 1e-6, (float(ours), reference)
    assert abs(float(ours) - float(theirs)) / float(theirs) < 1e-6, (float(ours), float(theirs))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_norm_matches_deepspeed_and_the_reference(world, dtype):
    run_ranks(_check, world, dtype, False)


def test_one_pass_norm_keeps_the_nonfinite_sentinel():
    run_ranks(_check, 2, torch.float32, True)
