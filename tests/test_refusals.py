"""Every refusal of the core library names the problem and the fix."""
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, Topology, UnsupportedError, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.attention.backends import local_attention
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
    from ds_ulysses_ext.attention import backends
    from ds_ulysses_ext.attention.masks import masked_attention
    q = torch.randn(1, 6, 4, 8)
    sinks = torch.randn(4)
    with pytest.raises(UnsupportedError, match="'flash_attn' has no sinks support.*attn_backend=auto or "):
        local_attention("flash_attn", q, q, q, window=3, sinks=sinks)
    monkeypatch.setattr(backends, "resolve_backend", lambda name, *a: "flash_attn")
    backends._log_fallback.cache_clear()
    with caplog.at_level("INFO", logger="ds_ulysses_ext.attention.backends"):
        out = local_attention("auto", q, q, q, window=3, sinks=sinks)
    assert torch.equal(out, masked_attention(q, q, q, causal=True, window=3, sinks=sinks))
    assert "flash_attn lacks sinks: those layers run torch's own" in caplog.text


def test_fa4_missing_is_reported_and_auto_falls_back_to_sdpa():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(UnsupportedError, match="flash-attn-4 .flash_attn.cute. is not importable.*attn_backend=sdpa"):
        local_attention("fa4", q, q, q)
    from ds_ulysses_ext.attention.backends import resolve_backend
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
    from ds_ulysses_ext.attention import backends
    monkeypatch.setattr(backends, "_optional_func", lambda b: (lambda *a, **k: None) if b == "fa4" else None)
    assert backends.resolve_backend("auto", "cuda", torch.bfloat16) == "fa4"
    assert backends.resolve_backend("auto", "cuda", torch.float32) == "sdpa"
    assert backends.resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"


# --- model features CP would run otherwise than the unsplit model (ds_ulysses_ext/models.py check_attention_config;
# what CP runs exactly is checked against the unsplit model in tests/test_model_features.py) ------------------------

ONE = Topology(1, 0, 1, 1)  # the engine installs the CP attention at cp=1 too: the refusals hold there as well


def test_attention_dropout_is_refused_at_enable_time_at_every_cp():
    for topo in (CP2, ONE):
        with pytest.raises(UnsupportedError, match=r"attention_dropout=0\.1: the context-parallel attention applies "
                                                   r"no dropout.*Set attention_dropout=0 "
                                                   r"\(model\.arch\.attention_dropout=0"):
            enable_context_parallel(tiny_model("llama", attention_dropout=0.1), topo)
    enable_context_parallel(tiny_model("llama", attention_dropout=0.0), CP2)


def test_is_causal_in_the_model_config_is_refused():
    # the premise: HF reads it (masking_utils), and false makes the unsplit model bidirectional, which CP never is
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        causal = tiny_model("llama")(input_ids=ids).logits
        bidirectional = tiny_model("llama", is_causal=False)(input_ids=ids).logits
    assert ((bidirectional - causal).norm() / causal.norm()).item() > 1e-2
    for value, what in ((False, "asks transformers for bidirectional attention"), (True, "is the default, but")):
        with pytest.raises(UnsupportedError, match=rf"is_causal={value} in the model config {what}.*Remove "
                                                   r"is_causal from the config \(model\.arch, or the checkpoint's "
                                                   r"config\.json\)"):
            enable_context_parallel(tiny_model("llama", is_causal=value), CP2)


def test_sliding_layers_without_a_window_are_refused():
    from transformers import GptOssConfig
    sliding_first = dict(use_sliding_window=False, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"])
    # the premise: the unsplit HF model refuses this config in its own mask builder
    with pytest.raises(ValueError, match="Could not find a `sliding_window`"):
        tiny_model("qwen2", **sliding_first)(input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=False)
    for family in ("qwen2", "qwen3"):
        with pytest.raises(UnsupportedError, match=r"layer_types marks layers \[0\] sliding_attention but "
                                                   r"sliding_window is None \(use_sliding_window=false sets it to "
                                                   r"None\).*Set sliding_window=<tokens> and use_sliding_window=true, "
                                                   r"or mark those layers full_attention"):
            enable_context_parallel(tiny_model(family, **sliding_first), CP2)
    gpt_oss = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=None)
    model = AutoModelForCausalLM.from_config(gpt_oss, attn_implementation="eager")
    with pytest.raises(UnsupportedError, match=r"layer_types marks layers \[0\] sliding_attention but sliding_window "
                                               r"is None: .*Set sliding_window=<tokens>, or mark"):
        enable_context_parallel(model, CP2)
    enable_context_parallel(tiny_model("qwen2", use_sliding_window=True, sliding_window=3,
                                       layer_types=["sliding_attention", "full_attention"]), CP2)


@pytest.mark.parametrize("override, match", [
    ("+model.arch.attention_dropout=0.1", r"model\.arch\.attention_dropout=0\.1: the context-parallel attention "
                                          r"applies no dropout.*set model\.arch\.attention_dropout=0"),
    ("+model.arch.is_causal=false", r"model\.arch\.is_causal=False: .*causal only.*remove model\.arch\.is_causal"),
    ("+model.arch.is_causal=true", r"model\.arch\.is_causal=True: .*remove model\.arch\.is_causal"),
], ids=["attention_dropout", "is_causal_false", "is_causal_true"])
def test_attention_keys_are_refused_before_any_model_is_built(override, match):
    from configs import ConfigError, compose_config, validate
    for cp in ("parallelism.cp=1", "parallelism.cp=2"):
        with pytest.raises(ConfigError, match=match):
            validate(compose_config([override, cp, "trainer.global_batch_size=2"]), world_size=2)
    validate(compose_config(["+model.arch.attention_dropout=0.0", "trainer.global_batch_size=2"]), world_size=2)
