"""Every refusal of the core library names the problem and the fix."""
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, Topology, UnsupportedError, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.backends import local_attention
from tiny_models import tiny_model

CP2 = Topology(world_size=2, rank=1, cp_size=2, dp_size=1)  # no group needed for the checks below


def test_left_padding_is_refused():
    ids = torch.ones(1, 6, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    with pytest.raises(UnsupportedError, match="left padding.*right padding.*padding_side"):
        shard_batch({"input_ids": ids, "attention_mask": mask}, CP2)


def test_right_padding_masks_pad_targets():
    ids = torch.arange(6).unsqueeze(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    out = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, Topology(1, 0, 1, 1))
    assert out["labels"].tolist() == [[1, 2, 3, -100, -100, -100]]


def test_shard_batch_pads_and_splits_with_global_positions():
    ids = torch.arange(10, 15).unsqueeze(0)  # S=5, cp=2 -> padded to 6, chunks of 3
    out = shard_batch({"input_ids": ids, "labels": ids}, CP2, pad_token_id=0)
    assert out["input_ids"].tolist() == [[13, 14, 0]]
    assert out["labels"].tolist() == [[14, -100, -100]]
    assert out["position_ids"].tolist() == [[3, 4, 5]]


def test_multimodal_inputs_are_refused():
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(UnsupportedError, match="multimodal input 'pixel_values'.*cp=1"):
        shard_batch({"input_ids": ids, "pixel_values": torch.zeros(1, 3, 8, 8)}, CP2)


def test_unsupported_family_is_refused_with_the_supported_list():
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(UnsupportedError, match=r"'gpt2' is not supported.*supported: \[.*'gpt_oss', .*'llama', 'mistral'"):
        enable_context_parallel(model, CP2)


def test_head_counts_are_checked_at_enable_time():
    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=6, head_dim=8, hidden_size=48)
    with pytest.raises(UnsupportedError, match=r"cp=4 does not divide the 6 query heads.*Choose cp in"):
        enable_context_parallel(model, Topology(4, 0, 4, 1))


def test_generate_is_refused_under_cp():
    model = enable_context_parallel(tiny_model("llama"), CP2)
    with pytest.raises(UnsupportedError, match=r"generate\(\) is not supported.*cp=1 copy"):
        model.generate(torch.ones(1, 4, dtype=torch.long))


def test_flash_attn_missing_is_reported():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(UnsupportedError, match="flash-attn .the .gpu. extra. is not importable.*attn_backend=sdpa"):
        local_attention("flash_attn", q, q, q)


def test_a_named_kernel_without_a_feature_the_model_uses_is_refused(monkeypatch, caplog):
    # flash-attn has documents and windows but no sinks: named, it is refused with the fix; picked by auto, the
    # sink layers run the exact torch path and the log says so (CPU stands in for CUDA: auto is forced to it)
    from ds_ulysses_ext import backends
    from ds_ulysses_ext.masks import masked_attention
    q = torch.randn(1, 6, 4, 8)
    sinks = torch.randn(4)
    with pytest.raises(UnsupportedError, match="'flash_attn' has no sinks support.*attn_backend=auto or "):
        local_attention("flash_attn", q, q, q, window=3, sinks=sinks)
    monkeypatch.setattr(backends, "resolve_backend", lambda name, *a: "flash_attn")
    backends._log_fallback.cache_clear()
    with caplog.at_level("INFO", logger="ds_ulysses_ext.backends"):
        out = local_attention("auto", q, q, q, window=3, sinks=sinks)
    assert torch.equal(out, masked_attention(q, q, q, causal=True, window=3, sinks=sinks))
    assert "flash_attn lacks sinks: those layers run the exact torch path" in caplog.text


def test_fa4_missing_is_reported_and_auto_falls_back_to_sdpa():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(UnsupportedError, match="flash-attn-4 .flash_attn.cute. is not importable.*attn_backend=sdpa"):
        local_attention("fa4", q, q, q)
    from ds_ulysses_ext.backends import resolve_backend
    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(UnsupportedError, match="unknown attention backend 'fa5'"):
        resolve_backend("fa5", "cpu")


def _unsharded_input(rank, world):
    topo = init_topology(world)
    lm = CPCausalLM(enable_context_parallel(tiny_model("llama"), topo, backend="sdpa"))
    ids = torch.randint(0, 96, (1, 8))
    pos = torch.arange(8).unsqueeze(0)
    with pytest.raises(UnsupportedError, match="not this rank's sequence chunk. Use shard_batch"):
        lm(input_ids=ids, labels=ids, position_ids=pos)   # every rank fed the whole sequence


def test_unsharded_input_is_detected_on_first_forward():
    run_ranks(_unsharded_input, 2)


def test_auto_takes_an_importable_flash_kernel_on_cuda_only_in_half_precision(monkeypatch):
    # pretend FA4 imports: auto must take it for bf16 on CUDA, but never for fp32 (FA kernels are half-only)
    from ds_ulysses_ext import backends
    monkeypatch.setattr(backends, "_optional_func", lambda b: (lambda *a, **k: None) if b == "fa4" else None)
    assert backends.resolve_backend("auto", "cuda", torch.bfloat16) == "fa4"
    assert backends.resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert backends.resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"
