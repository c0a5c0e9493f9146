"""engine/observe/host_memory.py: the pinned host memory activation offload will take, said before the first step."""
import pytest

from configs import compose_config, validate
from engine.observe.host_memory import offload_estimate_gib, offload_report

ONE_M = ["model=llama3_2_1b", "data=synthetic", "data.seq_len=1048576", "precision=bf16", "trainer.global_batch_size=1",
         "trainer.micro_batch_size=1"]


def _estimate(overrides, world):
    cfg = compose_config(ONE_M + [f"parallelism.cp={world}"] + overrides)
    return offload_estimate_gib(cfg, validate(cfg, world), hidden_size=2048, num_layers=16)


def test_estimate_is_the_layer_inputs_of_one_rank():
    # 1,048,576 tokens x 2,048 hidden x 2 bytes x 16 layers = 64 GiB: the 1M run of docs/benchmarks.md
    assert _estimate(["memory=long_context"], 1) == pytest.approx(64.0)
    assert _estimate(["memory=long_context"], 2) == pytest.approx(32.0)  # cp halves the local tokens
    assert _estimate(["memory=long_context", "memory.offload_max_gib=40"], 1) == pytest.approx(40.0)
    assert _estimate(["memory=long_context", "precision=fp32"], 1) == pytest.approx(128.0)
    # no offload, or a policy whose offloaded tensors are not just the layer inputs: no estimate
    assert _estimate(["memory=full_recompute"], 1) is None
    assert _estimate(["memory=except_attention", "memory.offload_activations=true"], 1) is None


def test_report_warns_when_the_node_would_run_out():
    message, too_much = offload_report(64.0, local_ranks=2, available_gib=100.0)
    assert too_much and "128.0 GiB for the 2 rank(s)" in message and "memory.offload_max_gib" in message
    message, too_much = offload_report(64.0, local_ranks=1, available_gib=100.0)
    assert not too_much and "memory.offload_max_gib" not in message
