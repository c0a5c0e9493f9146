"""The fast random-init build (no HF init, parameters made on the device, threaded draws) must give what the
plain build gave: HF's from_config with HF's own init, then one seeded draw per parameter name, in order.
Those values are the reference weights of every exactness test."""
import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from configs import compose_config, validate
from engine.ds.build import _uninitialised_on, build_hf_model
from engine.ds.config import to_deepspeed_dict
from engine.ds.hf_config import hf_config_of
from engine.ds.init import init_random_weights
from tiny_models import tiny_config

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
SEED, STD = 3, 0.02


def _sequential_init(model, seed, std):
    # the per-parameter draw as it was before the threads, written out on its own
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
        if name.endswith(".bias"):
            value = torch.zeros(p.shape)
        elif p.dim() == 1:
            value = torch.ones(p.shape)
        else:
            value = torch.randn(p.shape, generator=g) * std
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def _plain_build(hf_config, dtype, seed=SEED, std=STD):
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    _sequential_init(model, seed, std)
    return model


def _uninitialised(family, **overrides):
    return _uninitialised_on(torch.device("cpu"), tiny_config(family, **overrides), torch.float32)


def _fast_build(hf_config, dtype):
    model = _uninitialised_on(torch.device("cpu"), hf_config, dtype)
    init_random_weights(model, SEED, STD)
    return model


def _tensors(model):
    # remove_duplicate=False: a tied weight is compared under both of its names
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def _assert_same_state(new, ref):
    a, b = _tensors(new), _tensors(ref)
    assert a.keys() == b.keys()
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    # deduplicated names: a tie lost (or made) on one side shows as a name more (or less)
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in ref.named_parameters()]


def _logits(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_build_equals_hf_init_then_random_init(family, tied, dtype):
    new = _fast_build(tiny_config(family, tie_word_embeddings=tied), dtype)
    ref = _plain_build(tiny_config(family, tie_word_embeddings=tied), dtype)
    _assert_same_state(new, ref)
    assert (new.lm_head.weight is new.model.embed_tokens.weight) == tied
    assert torch.equal(_logits(new.eval()), _logits(ref.eval()))


@pytest.mark.parametrize("preset", ["tiny", "tiny_qwen3"])
def test_build_hf_model_on_zero2_equals_the_plain_build(preset):
    cfg = compose_config([f"model={preset}", "parallelism=cp1", "precision=bf16", f"run.seed={SEED}"])
    ds_dict = to_deepspeed_dict(cfg, validate(cfg, 1))
    assert ds_dict["zero_optimization"]["stage"] == 2  # the path with the fast build
    new = build_hf_model(cfg, ds_dict, torch.device("cpu"))
    hf_config = hf_config_of(cfg.model)
    _assert_same_state(new, _plain_build(hf_config, torch.bfloat16))
    assert not new.config.use_cache and new.training


def test_parameters_are_made_on_the_device_and_stay_tied():
    # meta stands in for CUDA: nothing is built on the CPU and moved, and ties survive the move
    model = _uninitialised_on(torch.device("meta"), tiny_config("llama", tie_word_embeddings=True), torch.bfloat16)
    assert {t.device.type for t in _tensors(model).values()} == {"meta"}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_threaded_init_equals_a_sequential_loop():
    old_threads = torch.get_num_threads()
    torch.set_num_threads(4)  # several draws in flight at once, whatever this machine's core count
    try:
        new = _uninitialised("qwen3_moe", num_hidden_layers=6)
        init_random_weights(new, SEED, STD)
    finally:
        torch.set_num_threads(old_threads)
    ref = _uninitialised("qwen3_moe", num_hidden_layers=6)
    _sequential_init(ref, SEED, STD)
    _assert_same_state(new, ref)


def test_every_parameter_is_written():
    # no_init_weights leaves memory as it was: a parameter the init skipped would keep garbage, here NaN
    model = _uninitialised("qwen2", tie_word_embeddings=True)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    init_random_weights(model, SEED, STD)
    assert not [n for n, p in model.named_parameters() if p.isnan().any()]


def test_a_parameter_without_a_rule_fails_from_the_threads():
    model = _uninitialised("llama")
    model.model.register_parameter("scale", torch.nn.Parameter(torch.empty(4)))
    with pytest.raises(ValueError, match="no random-init rule for parameter 'model.scale'"):
        init_random_weights(model, SEED, STD)


@pytest.mark.parametrize("hf_init", [False, True])
def test_every_build_path_leaves_the_same_global_rng_state(monkeypatch, hf_init):
    # HF's own init draws from the global RNG (ZeRO-3 path, old transformers); the fast path does not.
    # Whatever ran, the state after the build must be the seed's, or a later global draw differs by layout.
    import engine.ds.build as build
    if hf_init:
        monkeypatch.setattr(build, "no_init_weights", None)
    cfg = compose_config(["model=tiny", "parallelism=cp1", "precision=fp32", f"run.seed={SEED}"])
    build_hf_model(cfg, to_deepspeed_dict(cfg, validate(cfg, 1)))
    after = torch.rand(4)
    torch.manual_seed(SEED)
    assert torch.equal(after, torch.rand(4))


def _zero3_build_gathers_to_the_reference(rank, world):
    import deepspeed
    from dist_harness import patch_deepspeed_shm_build
    patch_deepspeed_shm_build()
    cfg = compose_config(["model=tiny", "parallelism=cp2", "precision=fp32", f"run.seed={SEED}",
                          "deepspeed=zero3", "deepspeed.stage3_param_persistence_threshold=0"])
    ds_dict = to_deepspeed_dict(cfg, validate(cfg, world))
    assert ds_dict["zero_optimization"]["stage"] == 3
    import engine.ds.build
    engine.ds.build._HF_DS_CONFIG.clear()  # the reference is a plain build: no live ZeRO-3 config may leak into it
    hf_config = hf_config_of(cfg.model)
    ref = dict(_plain_build(hf_config, torch.float32, seed=SEED, std=hf_config.initializer_range).named_parameters())
    model = build_hf_model(cfg, ds_dict)
    params = list(model.named_parameters())
    assert params and all(hasattr(p, "ds_id") for _, p in params)  # really partitioned
    for name, p in params:
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.data, ref[name]), (rank, name)


def test_zero3_build_at_world_2_gathers_to_the_reference_weights():
    # the collective path: rank 0 draws ahead in threads, each parameter is gathered and broadcast in order
    from dist_harness import run_ranks
    run_ranks(_zero3_build_gathers_to_the_reference, 2)


@pytest.mark.parametrize("preset", ["tiny", "tiny_qwen3_5", "tiny_qwen3_next", "tiny_cohere2_moe"])
def test_norm_weights_start_where_hfs_own_init_starts_them(preset):
    """Every 1-D norm weight that HF's own init sets to a constant (1 for a plain RMSNorm, 0 for Qwen3.5 / Qwen3-Next's
    (1 + weight) norms) gets the same constant from ours: a zero-centred norm at 1 ran at twice its scale."""
    cfg = compose_config([f"model={preset}"])
    torch.manual_seed(0)
    hf_init = AutoModelForCausalLM.from_config(hf_config_of(cfg.model))
    ours = AutoModelForCausalLM.from_config(hf_config_of(cfg.model))
    init_random_weights(ours, SEED, STD)
    checked = 0
    for (name, want), (_, got) in zip(hf_init.named_parameters(), ours.named_parameters()):
        if want.dim() == 1 and "norm" in name and bool((want == want.flatten()[0]).all()):
            assert torch.equal(got, want), (name, want.flatten()[0].item(), got.flatten()[0].item())
            checked += 1
    assert checked > 0
