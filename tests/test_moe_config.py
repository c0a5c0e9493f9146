"""MoE refusals before any model is built (each names the field and the fix), the LatentMoE model's own checks and
round trip, and a saved HF Qwen3-MoE checkpoint through our blocks."""
import pytest
import torch

from configs import ConfigError, compose_config, validate

MOE = ["model=tiny_moe", "trainer.global_batch_size=8"]


@pytest.mark.parametrize("overrides,world,match", [
    (["parallelism.ep=2", "deepspeed=zero2"], 4, r"parallelism.ep=2 needs deepspeed=zero3"),
    (["parallelism.ep=3"], 6, r"parallelism.ep=3 does not divide model.arch.num_experts=8"),
    (["parallelism.ep=4"], 2, r"parallelism.ep=4 does not divide the world size 2"),
    (["moe.dispatcher=deepep"], 4, r"moe.dispatcher=deepep needs the optional deep_ep package"),
    (["moe.offload_inputs=true"], 4, r"moe.offload_inputs=true needs moe.recompute=experts"),
    (["moe.recompute=all"], 4, r"moe.recompute=all is not one of"),
    (["moe.balance=bias", "moe.bias_update_rate=0"], 4, r"moe.balance=bias needs moe.bias_update_rate > 0"),
    (["+model.arch.output_router_logits=true"], 4, r"output_router_logits=true .* moe.balance=aux"),
    (["+model.arch.hidden_act=gelu"], 4, r"hidden_act=gelu: our experts compute SwiGLU"),
])
def test_moe_refusals_name_the_field_and_the_fix(overrides, world, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(MOE + overrides), world_size=world)


def test_deepep_is_refused_on_a_shared_gpu(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "deep_ep" else real(name, *a))
    cfg = MOE + ["moe.dispatcher=deepep", "device=cuda", "parallelism.ep=2"]
    with pytest.raises(ConfigError, match=r"moe.dispatcher=deepep with dist_backend=gloo: .*use moe.dispatcher=alltoall"):
        validate(compose_config(cfg + ["dist_backend=gloo"]), world_size=4)
    assert validate(compose_config(cfg), world_size=4).ep == 2  # the same with NCCL passes


def test_dense_models_refuse_ep_and_moe_settings():
    with pytest.raises(ConfigError, match=r"parallelism.ep=2 .* set parallelism.ep=1"):
        validate(compose_config(["model=tiny", "parallelism.ep=2", "trainer.global_batch_size=4"]), world_size=4)
    with pytest.raises(ConfigError, match=r"moe.recompute=experts .* apply to MoE layers"):
        validate(compose_config(["model=tiny", "moe=expert_recompute", "trainer.global_batch_size=4"]), world_size=4)


def test_valid_moe_layouts_pass():
    for ep in (1, 2, 4):
        plan = validate(compose_config(MOE + [f"parallelism.ep={ep}", "parallelism.cp=2"]), world_size=4)
        assert (plan.ep, plan.cp, plan.dp) == (ep, 2, 2)


def test_latent_size_must_be_a_multiple_of_512():
    with pytest.raises(ConfigError, match=r"latent_size=500 is not a multiple of 512.*latent_size=512"):
        validate(compose_config(["model=tiny_latent_moe", "model.arch.latent_size=500",
                                 "trainer.global_batch_size=4"]), world_size=2)
    with pytest.raises(ConfigError, match=r"latent_size=1100 .*latent_size=1024 or 1536"):
        validate(compose_config(["model=tiny_latent_moe", "model.arch.latent_size=1100",
                                 "trainer.global_batch_size=4"]), world_size=2)


def _latent_config(**kw):
    from ds_ulysses_ext.moe.latent_model import LatentMoeConfig
    args = dict(vocab_size=64, hidden_size=1024, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                latent_size=512, shared_expert_intermediate_size=64)
    return LatentMoeConfig(**{**args, **kw})


def test_latent_moe_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM
    from ds_ulysses_ext.moe.latent_model import register_latent_moe
    register_latent_moe()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_latent_config(), dtype=torch.float32)
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape == (8, 64, 512)  # experts live in the latent space
    assert block.fc1_latent_proj.weight.shape == (512, 1024) and block.shared_experts is not None
    assert block.experts.gate_up_proj.abs().sum() > 0 and block.gate.weight.abs().sum() > 0  # initialised
    ids = torch.randint(0, 64, (1, 12))
    ref = model.eval()(ids).logits  # eval on both sides: from_pretrained returns an eval-mode model
    model.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(loaded).__name__ == "LatentMoeForCausalLM"
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    # equal weights, but HF's loader may hand them back with another memory layout (its checkpoint conversion
    # stacks per-expert tensors), and a GEMM over another layout rounds differently: rel 1e-6, not bitwise
    out = loaded(ids).logits
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_saved_hf_qwen3_moe_checkpoint_matches_through_our_blocks(tmp_path):
    """A tiny HF Qwen3-MoE saved with save_pretrained: loaded, its sparse blocks swapped for ours, the logits and the
    loss equal HF's own (fp32, rel 1e-6), and HF's blocks are really gone."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from ds_ulysses_ext.moe import MoEBlock
    from ds_ulysses_ext.moe.parallel import replace_hf_blocks
    from tiny_models import tiny_model
    tiny_model("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16).save_pretrained(
        str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert replace_hf_blocks(ours) == 2
    assert not any(isinstance(m, Qwen3MoeSparseMoeBlock) for m in ours.modules())
    assert sum(isinstance(m, MoEBlock) for m in ours.modules()) == 2
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    a, b = hf(ids, labels=ids), ours(ids, labels=ids)
    assert ((a.logits - b.logits).abs().max() / a.logits.abs().max()).item() < 1e-6
    assert abs(a.loss.item() - b.loss.item()) / a.loss.item() < 1e-6


def test_hf_router_loss_switch_is_refused_by_the_library():
    """output_router_logits=true would be accepted and silently dropped by CPCausalLM (issue: silent holes)."""
    from ds_ulysses_ext import UnsupportedError, enable_context_parallel, init_topology
    from tiny_models import tiny_model
    model = tiny_model("qwen3_moe", output_router_logits=True)
    with pytest.raises(UnsupportedError, match="output_router_logits=true"):
        enable_context_parallel(model, init_topology(1))


def test_a_local_model_path_that_does_not_exist_is_refused_before_the_build(tmp_path):
    missing = tmp_path / "stage1" / "hf_export"
    with pytest.raises(ConfigError, match=r"model.path=.*hf_export is not a folder here"):
        validate(compose_config(["model.source=pretrained", f"model.path={missing}",
                                 "trainer.global_batch_size=2"]), world_size=2)
    missing.mkdir(parents=True)
    validate(compose_config(["model.source=pretrained", f"model.path={missing}", "trainer.global_batch_size=2"]),
             world_size=2)


@pytest.mark.parametrize("overrides,key,family", [
    (["model=tiny_moe", "+model.arch.router_score=sigmoid"], "router_score", "qwen3_moe"),
    (["model=tiny_moe", "+model.arch.shared_expert_intermediate_size=8"], "shared_expert_intermediate_size", "qwen3_moe"),
    (["model=tiny_gpt_oss", "+model.arch.router_score=sigmoid"], "router_score", "gpt_oss"),
    (["model=tiny", "+model.arch.latent_size=512"], "latent_size", "llama"),
])
def test_a_key_only_other_families_read_is_refused(overrides, key, family):
    # HF's class for the family never reads the key, so the export would not be the model trained
    with pytest.raises(ConfigError, match=rf"^model\.arch\.{key}=\S+ with model\.family={family}: HF's {family} model "
                                          rf"never reads it \(read by: latent_moe[^)]*\).*remove it \(~model\.arch\.{key}\) "
                                          r"or use a family that reads it \(model\.family=latent_moe\)$"):
        validate(compose_config(overrides + ["trainer.global_batch_size=8"]), world_size=2)
    validate(compose_config(["model=tiny_latent_moe", "+model.arch.router_score=sigmoid", "trainer.global_batch_size=8"]),
             world_size=2)  # the family whose class reads it


def test_megatron_latent_key_is_refused():
    with pytest.raises(ConfigError, match=r"model\.arch\.moe_latent_size=512 .*read by: no supported family.*"
                                          r"remove it \(~model\.arch\.moe_latent_size\)$"):
        validate(compose_config(["model=tiny_latent_moe", "+model.arch.moe_latent_size=512",
                                 "trainer.global_batch_size=8"]), world_size=2)


def test_a_checkpoint_config_with_a_key_its_family_never_reads_is_refused_at_load():
    # config.json of a qwen3_moe checkpoint with router_score: HF's Qwen3MoeConfig keeps it as an attribute, unread
    from transformers import Qwen3MoeConfig
    from ds_ulysses_ext import UnsupportedError
    from ds_ulysses_ext.moe.parallel import hf_moe_spec
    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12)
    assert hf_moe_spec(config).score == "softmax"
    config.router_score = "sigmoid"
    with pytest.raises(UnsupportedError, match=r"router_score='sigmoid' in the qwen3_moe config: HF's qwen3_moe "
                                               r"model never reads it \(read by: latent_moe\).*Remove router_score"):
        hf_moe_spec(config)


@pytest.mark.parametrize("arch, message", [
    (["model.arch.n_group=3"], "equal groups"),  # 8 experts do not split into 3 groups
    (["model.arch.n_group=4", "model.arch.topk_group=0"], "topk_group=0"),
])
def test_group_limited_routing_hf_cannot_run_is_refused_before_the_build(arch, message):
    """n_group / topk_group that HF's DeepSeek-V3 router cannot run: refused by validate, naming the keys."""
    cfg = compose_config(["model=tiny_deepseek_v3", "parallelism.cp=1", *arch])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)
