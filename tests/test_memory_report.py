"""engine.observe.memory_report: the parts of what a DeepSpeed engine holds, counted from its tensors, against what
they must be for a known model: fp32 AdamW keeps two moments per partition element, one fp32 master copy and one
gradient buffer of the partition; ZeRO-1/2 keep every parameter, ZeRO-3 its partition."""
import pytest
import torch

from dist_harness import patch_deepspeed_shm_build, run_ranks


def _check(rank, world, stage):
    import deepspeed
    from engine.observe.memory_report import memory_breakdown
    patch_deepspeed_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    # eight equal weights: ZeRO-1/2's partitions (whole parameters per rank) then split the model exactly in two
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(32, 32, bias=False), torch.nn.Tanh())])
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.randn(2, 32)).square().sum())
    engine.step()
    gib = memory_breakdown(engine, torch.device("cpu"))
    share = n * 4 / 2**30 / world  # fp32 bytes of this rank's partition (DeepSpeed pads to an alignment: 1%)
    full = n * 4 / 2**30 if stage < 3 else share  # ZeRO-1/2 keep every parameter on every rank
    assert gib["parameters"] == pytest.approx(full, rel=0.01)
    assert gib["master_weights"] == pytest.approx(share, rel=0.01)
    assert gib["optimizer_states"] == pytest.approx(2 * share, rel=0.01)
    assert gib["gradients"] == pytest.approx(share, rel=0.01)


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 2), (2, 3)])
def test_memory_parts_of_a_known_model(world, stage):
    run_ranks(_check, world, stage)
