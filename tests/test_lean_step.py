"""engine.ds.patches.clip_inside_fused_adam: ZeRO-1/2's clip coefficient handed to torch's fused AdamW as its
`grad_scale` instead of a separate multiply over every gradient. The same step as DeepSpeed's own, within fp32
rounding (g / c against g x (1 / c)), for clipped and unclipped steps, at world 1 and 2."""
import pytest
import torch

from dist_harness import patch_deepspeed_shm_build, run_ranks


def _engine(clip):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _steps(engine, rank, n=3):
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(n):
        x = torch.randn(2, 16, generator=gen) * 30  # large inputs: the norm exceeds a clip of 0.1
        engine.backward(engine(x).square().sum())
        engine.step()
    return torch.cat([p.detach().flatten() for p in engine.module.parameters()])


def _check(rank, world, clip):
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    patch_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    theirs = _steps(_engine(clip), rank)
    multiplies = []
    original_mul = torch.Tensor.mul_

    from engine.ds.patches import clip_inside_fused_adam
    clip_inside_fused_adam()
    engine = _engine(clip)
    torch.Tensor.mul_ = lambda self, *a, **k: (multiplies.append(self.numel()), original_mul(self, *a, **k))[1]
    try:
        ours = _steps(engine, rank)
    finally:
        torch.Tensor.mul_ = original_mul
    assert DeepSpeedZeroOptimizer.unscale_and_clip_grads._into_fused_adam
    flat = sum(p.numel() for p in engine.module.parameters())
    assert not [n for n in multiplies if n >= flat // world], "a separate pass over the gradient partition ran"
    if clip > 0:  # the coefficient reached the fused kernel: the norm of these inputs is far above the clip
        assert float(engine.optimizer.optimizer.grad_scale) > 1.0
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 1e-6, err


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("clip", [0.1, 0.0], ids=["clipped", "unclipped"])
def test_clip_inside_fused_adam_matches_deepspeed(world, clip):
    run_ranks(_check, world, clip)


def _shared_master(rank, world):
    import deepspeed
    from engine.ds.patches import share_master_weights
    from engine.observe.memory_report import memory_breakdown
    patch_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    theirs = _steps(_engine(0.1), rank)
    engine = _engine(0.1)
    assert share_master_weights(engine)
    opt = engine.optimizer
    assert opt.single_partition_of_fp32_groups[0].untyped_storage().data_ptr() == \
        opt.bit16_groups_flat[0].untyped_storage().data_ptr()
    assert memory_breakdown(engine, torch.device("cpu"))["master_weights"] == 0  # one copy of the weights
    flat = opt.bit16_groups_flat[0].untyped_storage().data_ptr()
    mapped = [p._hp_mapping for p in engine.module.parameters() if p._hp_mapping is not None]  # this rank's
    assert mapped  # DeepSpeed's per-parameter master views do not keep the clone alive
    for mapping in mapped:
        assert mapping.hp_fragment.untyped_storage().data_ptr() == flat
    ours = _steps(engine, rank)
    assert torch.equal(ours, theirs)  # the same update, bit for bit: the clone always equalled the parameters


@pytest.mark.parametrize("world", [1, 2])
def test_master_weights_in_the_parameters_dtype_share_their_storage(world):
    """engine.ds.patches.share_master_weights: ZeRO-1/2's master partition, when of the parameters' dtype, is the
    parameters' own slice (no second copy), and the steps are DeepSpeed's own, bitwise."""
    run_ranks(_shared_master, world)
