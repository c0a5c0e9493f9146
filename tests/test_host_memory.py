"""engine/observe/host_memory.py: the pinned host memory activation offload will take, said before the first step."""
import pytest

from configs import compose_config, validate
from engine.observe.host_memory import attention_offload_estimate_gib, offload_estimate_gib, offload_report

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
    # except_attention checkpoints every layer too: offload moves the same layer inputs (its attention is its own)
    assert _estimate(["memory=except_attention", "memory.offload_activations=true"], 1) == pytest.approx(64.0)
    # no offload, or a policy whose offloaded tensors are not just the layer inputs: no estimate
    assert _estimate(["memory=full_recompute"], 1) is None
    assert _estimate(["memory=selective", "memory.offload_activations=true"], 1) is None


class _Llama1B:  # the Llama-3.2-1B attention shape
    num_attention_heads, num_key_value_heads, head_dim, hidden_size, num_hidden_layers = 32, 8, 64, 2048, 16


def _attention_estimate(overrides, world):
    cfg = compose_config(ONE_M + [f"parallelism.cp={world}"] + overrides)
    return attention_offload_estimate_gib(cfg, validate(cfg, world), _Llama1B())


def test_attention_offload_estimate():
    # per token per layer, bf16: q 4096 + k 1024 + v 1024 + out 4096 + fp32 logsumexp 128 = 10,368 bytes;
    # x 1,048,576 tokens x 16 layers = 162 GiB (the bytes per token are checked against what the policy moves, at
    # cp 1, 2, 4 and with the ring, in tests/test_except_attention.py)
    assert _attention_estimate(["memory=except_attention_offload"], 1) == pytest.approx(10368 * 16 / 1024)
    # cp 2: half the tokens, plus the recorded output in sequence layout (4096 bytes) that the exchange makes
    assert _attention_estimate(["memory=except_attention_offload"], 2) == pytest.approx(14464 * 16 / 2048)
    # a pure ring of 2 exchanges nothing: the recorded output stays a view of out
    assert _attention_estimate(["memory=except_attention_offload", "parallelism.ring=2"], 2) == pytest.approx(
        10368 * 16 / 2048)
    # layers recomputed whole keep no attention; fp32 doubles all but the logsumexp
    assert _attention_estimate(["memory=except_attention_offload", "memory.recompute_num_layers=4"], 1) == \
        pytest.approx(10368 * 12 / 1024)
    assert _attention_estimate(["memory=except_attention_offload", "precision=fp32"], 1) == pytest.approx(
        (10240 * 2 + 128) * 16 / 1024)
    assert _attention_estimate(["memory=except_attention"], 1) is None
    message, too_much = offload_report(162.0, local_ranks=1, available_gib=100.0, what="attention tensors")
    assert too_much and "162.0 GiB of attention tensors" in message and "memory.recompute_num_layers" in message


def test_report_warns_when_the_node_would_run_out():
    message, too_much = offload_report(64.0, local_ranks=2, available_gib=100.0)
    assert too_much and "128.0 GiB for the 2 rank(s)" in message and "memory.offload_max_gib" in message
    message, too_much = offload_report(64.0, local_ranks=1, available_gib=100.0)
    assert not too_much and "memory.offload_max_gib" not in message
