"""The config layer: every preset composes and validates, and every refusal names the field and the fix.

Compose a config the way the entry point would, without a command line:
    cfg = compose_config(["experiment=cpu_cp4", "data.seq_len=1024"])   # -> TrainConfig
    plan = validate(cfg, world_size=4)                                  # -> Plan, or ConfigError
"""

import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from configs import (
    HYDRA_CONF_DIR,
    ConfigError,
    Plan,
    TrainConfig,
    compose_config,
    register_configs,
    to_dataclass,
    validate,
)

EXPERIMENTS = sorted((HYDRA_CONF_DIR / "experiment").glob("*.yaml"))
GROUP_PRESETS = sorted(
    (p.parent.name, p.stem) for p in HYDRA_CONF_DIR.glob("*/*.yaml") if p.parent.name != "experiment"
)


def _declared_world_size(path: Path) -> int:
    match = re.search(r"^# world_size: (\d+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} needs a '# world_size: N' header line"
    return int(match.group(1))


# --- presets compose and validate ------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_composes_and_validates(path, tmp_path, monkeypatch):
    cfg = compose_config([f"experiment={path.stem}"])
    assert isinstance(cfg, TrainConfig)
    if cfg.model.source == "pretrained":  # a curriculum stage reads the previous stage's export: give it one
        monkeypatch.chdir(tmp_path)
        (tmp_path / cfg.model.path).mkdir(parents=True, exist_ok=True)
    plan = validate(cfg, world_size=_declared_world_size(path))
    assert plan.cp * plan.dp == plan.world_size
    assert plan.micro_batch_size * plan.dp * plan.grad_accum == plan.global_batch_size


def test_the_briefed_experiments_exist():
    names = {p.stem for p in EXPERIMENTS}
    assert {
        "cpu_demo",
        "cpu_cp4",
        "llama1b_1gpu_128k",
        "llama1b_1gpu_1m",
        "llama8b_8gpu_cp8_256k",
        "qwen3_8b_4gpu_cp4_64k",
    } <= names


@pytest.mark.parametrize("group, name", GROUP_PRESETS, ids=lambda x: str(x))
def test_group_preset_composes_and_validates(group, name):
    overrides = [f"{group}={name}", "trainer.global_batch_size=8"]  # 8 ranks: every cp preset divides 8
    if (group, name) == ("data", "jsonl"):  # the user must give its paths
        overrides += ["data.path=train.jsonl", "data.tokenizer_path=tok"]
    if group == "moe":  # moe settings apply to a model with MoE layers (a dense model refuses them)
        overrides += ["model=tiny_moe"]
    validate(compose_config(overrides), world_size=8)


def test_default_is_the_two_rank_cpu_demo():
    cfg = compose_config([])
    assert (cfg.model.name, cfg.data.source, cfg.precision) == ("tiny", "demo", "fp32")
    assert validate(cfg, world_size=2) == Plan(
        world_size=2,
        cp=2,
        dp=1,
        ep=1,
        grad_accum=4,
        micro_batch_size=1,
        global_batch_size=4,
        seq_len=256,
        zero_stage=3,
        precision="fp32",
    )


# --- derived values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, cp, global_batch, micro, dp, grad_accum",
    [
        (4, 2, 8, 1, 2, 4),
        (8, 4, 16, 2, 2, 4),
        (8, 1, 8, 1, 8, 1),
        (8, 8, 3, 1, 1, 3),
        (1, 1, 6, 2, 1, 3),
    ],
)
def test_plan_arithmetic(world_size, cp, global_batch, micro, dp, grad_accum):
    overrides = [f"parallelism.cp={cp}", f"trainer.global_batch_size={global_batch}"]
    cfg = compose_config(overrides + [f"trainer.micro_batch_size={micro}"])
    plan = validate(cfg, world_size=world_size)
    assert (plan.cp, plan.dp, plan.grad_accum) == (cp, dp, grad_accum)


def test_hydra_overrides_reach_the_dataclass():
    cfg = compose_config(["parallelism.cp=4", "data.seq_len=1000", "trainer.global_batch_size=8"])
    assert (cfg.parallelism.cp, cfg.data.seq_len, cfg.trainer.global_batch_size) == (4, 1000, 8)
    plan = validate(cfg, world_size=8)
    assert (plan.dp, plan.grad_accum, plan.seq_len) == (2, 4, 1000)


def test_seq_len_not_divisible_by_cp_is_allowed():
    # It gets right-padded up to a multiple of cp by the batch sharding; nothing to refuse here.
    plan = validate(compose_config(["parallelism.cp=4", "data.seq_len=1001"]), world_size=4)
    assert plan.seq_len == 1001


def test_group_choice_and_experiment_compose_with_key_overrides():
    cfg = compose_config(["experiment=cpu_cp4", "memory=long_context", "run.seed=7"])
    assert (cfg.parallelism.cp, cfg.memory.recompute, cfg.memory.tiled_mlp, cfg.run.seed) == (4, "full", True, 7)
    assert cfg.run.out_dir == "outputs/cpu_cp4"  # ${run.name} interpolation resolved


def test_to_dataclass_fills_schema_defaults():
    cfg = to_dataclass({"parallelism": {"cp": 2}})
    assert cfg.parallelism.cp == 2
    assert cfg.trainer == TrainConfig().trainer


def test_register_configs_is_idempotent():
    register_configs()
    register_configs()
    assert compose_config([]).parallelism.cp == 2


# --- refused at compose time by the schema, or by a preset ----------------------------------------------------


def test_misspelt_key_is_refused():
    with pytest.raises(ConfigCompositionException, match="max_step"):
        compose_config(["trainer.max_step=5"])


def test_wrong_type_is_refused():
    with pytest.raises(ConfigCompositionException, match="max_steps"):
        compose_config(["trainer.max_steps=ten"])


def test_jsonl_preset_without_paths_is_refused():
    cfg = compose_config(["data=jsonl"])
    with pytest.raises(ConfigError, match=r"data\.source=jsonl needs data\.path; set data\.path="):
        validate(cfg, world_size=2)


# --- refused by validate: one case per rule -----------------------------------------------------------------
# (id, overrides on top of the default demo config, world size, regex: the field and the fix)

REFUSALS = [
    ("world_size", [], 0, r"world_size=0 must be >= 1"),
    ("cp_below_1", ["parallelism.cp=0"], 2, r"parallelism\.cp=0 must be >= 1; use parallelism\.cp=1"),
    (
        "cp_not_dividing_world",
        ["parallelism.cp=3"],
        4,
        r"parallelism\.cp=3 does not divide the world size 4; choose parallelism\.cp in \{1, 2, 4\}",
    ),
    (
        "tp_with_cp",
        ["parallelism.tp=2"],
        2,
        r"TP\+CP is not supported: parallelism\.tp=2 with parallelism\.cp=2; set parallelism\.tp=1",
    ),
    (
        "tp_alone",
        ["parallelism.tp=2", "parallelism.cp=1"],
        2,
        r"parallelism\.tp=2: tensor parallelism is not supported yet; set parallelism\.tp=1",
    ),
    ("ep_below_1", ["parallelism.ep=0"], 2, r"parallelism\.ep=0 must be >= 1; use parallelism\.ep=1"),
    (
        "ep_not_dividing_world",
        ["parallelism.cp=1", "parallelism.ep=3"],
        4,
        r"parallelism\.ep=3 does not divide the world size 4; choose parallelism\.ep in \{1, 2, 4\}",
    ),
    (
        "ep_on_dense_model",
        ["parallelism.ep=2"],
        2,
        r"parallelism\.ep=2 but model\.family=llama has no experts; set parallelism\.ep=1",
    ),
    (
        "ep_not_dividing_experts",
        ["model.family=qwen3_moe", "+model.arch.num_experts=6", "parallelism.cp=1", "parallelism.ep=4"],
        8,
        r"parallelism\.ep=4 does not divide model\.arch\.num_experts=6; choose parallelism\.ep in \{1, 2\}",
    ),
    (
        "query_heads",
        ["model.arch.num_attention_heads=12", "model.arch.num_key_value_heads=4", "parallelism.cp=8", "parallelism.ring=1"],
        8,
        r"parallelism\.cp=8 cannot split the heads of model\.arch\.num_attention_heads=12, "
        r"model\.arch\.num_key_value_heads=4.*choose parallelism\.cp in \{1, 2, 4\}",
    ),
    (
        "kv_heads",
        ["model.arch.num_attention_heads=24", "model.arch.num_key_value_heads=6", "parallelism.cp=4", "parallelism.ring=1"],
        8,
        r"parallelism\.cp=4 cannot split .*num_key_value_heads=6.*choose parallelism\.cp in \{1, 2\}",
    ),
    (
        "latent_size",
        ["+model.arch.latent_size=700"],
        2,
        r"model\.arch\.latent_size=700 is not a multiple of 512.*use model\.arch\.latent_size=512 or 1024$",
    ),
    (
        "moe_latent_size_below_512",
        ["+model.arch.moe_latent_size=300"],
        2,
        r"model\.arch\.moe_latent_size=300 is not a multiple of 512.*use model\.arch\.moe_latent_size=512$",
    ),
    (
        "global_batch_not_multiple",
        ["parallelism.cp=1", "trainer.global_batch_size=6"],
        4,
        r"trainer\.global_batch_size=6 is not a multiple of trainer\.micro_batch_size \* dp = 1 \* 4 = 4; "
        r"use trainer\.global_batch_size=4 or 8",
    ),
    (
        "global_batch_below_one_pass",
        ["parallelism.cp=1", "trainer.global_batch_size=2"],
        4,
        r"trainer\.global_batch_size=2 .*use trainer\.global_batch_size=4 ",
    ),
    ("fp16", ["precision=fp16"], 2, r"precision=fp16 is not supported .*use precision=bf16 .*precision=fp32"),
    ("precision", ["precision=fp8"], 2, r"precision=fp8 is not one of \{fp32, bf16\}; set precision"),
    ("device", ["device=tpu"], 2, r"device=tpu is not one of \{auto, cuda, cpu\}; set device"),
    ("zero0", ["deepspeed.zero_stage=0"], 2, r"deepspeed\.zero_stage=0 is not supported.*use deepspeed=zero2 or "),
    ("zero1", ["deepspeed.zero_stage=1"], 2, r"deepspeed\.zero_stage=1 is not supported.*use deepspeed=zero2 or "),
    (
        "offload_param_without_zero3",
        ["deepspeed=zero2", "deepspeed.offload_param=true"],
        2,
        r"deepspeed\.offload_param=true needs deepspeed\.zero_stage=3.*use deepspeed=zero3_offload",
    ),
    (
        "master_weights",
        ["precision=bf16", "deepspeed.master_weights=fp16"],
        2,
        r"deepspeed\.master_weights=fp16 is not one of \{fp32, bf16\}; set deepspeed\.master_weights",
    ),
    (
        "bf16_master_weights_with_fp32_precision",
        ["deepspeed.master_weights=bf16"],
        2,
        r"deepspeed\.master_weights=bf16 needs precision=bf16 \(got precision=fp32.*; set precision=bf16 or "
        r"deepspeed\.master_weights=fp32$",
    ),
    (
        "on_nonfinite",
        ["trainer.on_nonfinite=ignore"],
        2,
        r"trainer\.on_nonfinite=ignore is not one of \{abort, skip\}",
    ),
    ("lr_decay", ["trainer.lr_decay=step"], 2, r"trainer\.lr_decay=step is not one of \{cosine, linear, constant\}"),
    (
        "offload_cap_without_offload",
        ["memory.offload_max_gib=40"],
        2,
        r"memory\.offload_max_gib=40\.0 must be >= 0 and only caps memory\.offload_activations=true \(got "
        r"offload_activations=False\); set memory\.offload_activations=true or memory\.offload_max_gib=0$",
    ),
    (
        "held_out_but_never_scored",
        ["data.eval_samples=8"],
        2,
        r"data\.eval_samples=8, data\.eval_path=None and trainer\.eval_every=0: evaluation needs samples .* Set "
        r"both, or neither$",
    ),
    (
        "eval_path_and_eval_samples",
        ["data.eval_samples=8", "data.eval_path=val.jsonl", "trainer.eval_every=5"],
        2,
        r"data\.eval_samples=8 and data\.eval_path=val\.jsonl: evaluate either .*set data\.eval_samples=0 or drop "
        r"data\.eval_path$",
    ),
    (
        "eval_path_of_demo_data",
        ["data.eval_path=val.jsonl", "trainer.eval_every=5"],
        2,
        r"data\.eval_path=val\.jsonl needs data\.source=jsonl \(got demo\)",
    ),
    (
        "left_padding",
        ["data.padding_side=left"],
        2,
        r"data\.padding_side=left: left padding is not supported under cp.*set data\.padding_side=right",
    ),
    (
        "jsonl_without_path",
        ["data.source=jsonl", "data.tokenizer_path=tok"],
        2,
        r"data\.source=jsonl needs data\.path; set data\.path=",
    ),
    (
        "jsonl_without_tokenizer",
        ["data.source=jsonl", "data.path=train.jsonl"],
        2,
        r"data\.source=jsonl needs data\.tokenizer_path; set data\.tokenizer_path=",
    ),
    ("data_source", ["data.source=hf"], 2, r"data\.source=hf is not one of \{synthetic, jsonl, demo, passkey\}; set data\."),
    ("data_format", ["data.format=parquet"], 2, r"data\.format=parquet is not one of \{text, chat\}; set data\."),
    ("overlong", ["data.overlong=wrap"], 2, r"data\.overlong=wrap is not one of \{truncate, drop\}; set data\."),
    ("on_bad_line", ["data.on_bad_line=warn"], 2, r"data\.on_bad_line=warn is not one of \{skip, fail\}"),
    ("seq_len", ["data.seq_len=0"], 2, r"data\.seq_len=0 must be >= 1"),
    (
        "seq_len_below_cp",
        ["parallelism.cp=4", "data.seq_len=3"],
        4,
        r"data\.seq_len=3 is shorter than parallelism\.cp=4; raise data\.seq_len to at least 4",
    ),
    ("masked_fraction", ["data.masked_fraction=1.0"], 2, r"data\.masked_fraction=1\.0 must be in \[0, 1\)"),
    ("num_samples", ["data.num_samples=0"], 2, r"data\.num_samples=0 must be >= 1"),
    (
        "recompute",
        ["memory.recompute=some"],
        2,
        r"memory\.recompute=some is not one of \{none, full, block, selective, budget, except_attention\}; set memory\.recompute",
    ),
    ("recompute_method", ["memory.recompute_method=random"], 2, r"memory\.recompute_method=random is not one of"),
    (
        "block_recompute_zero_layers",
        ["memory=block_recompute", "memory.recompute_num_layers=0"],
        2,
        r"memory\.recompute=block needs memory\.recompute_num_layers >= 1 and <= "
        r"model\.arch\.num_hidden_layers=4, got 0; set memory\.recompute_num_layers",
    ),
    (
        "block_recompute_too_many_layers",
        ["memory=block_recompute", "memory.recompute_num_layers=5"],
        2,
        r"memory\.recompute_num_layers >= 1 and <= model\.arch\.num_hidden_layers=4, got 5",
    ),
    (
        "budget_without_target",
        ["memory=budget", "memory.budget_gib=0"],
        2,
        r"memory\.recompute=budget needs memory\.budget_gib > 0, got 0\.0; set memory\.budget_gib=",
    ),
    ("mlp_tile_tokens", ["memory=tiled", "memory.mlp_tile_tokens=0"], 2, r"memory\.mlp_tile_tokens >= 1, got 0"),
    (
        "wandb_mode",
        ["logging.wandb.mode=cloud"],
        2,
        r"logging\.wandb\.mode=cloud is not one of \{disabled, offline, online\}; set logging\.wandb\.mode",
    ),
    ("log_every", ["logging.log_every=0"], 2, r"logging\.log_every=0 must be >= 1"),
    ("profile_step_after_the_run", ["trainer.max_steps=5", "logging.profile_step=6"], 2,
     r"logging\.profile_step=6 must be a step of this run, 1\.\.trainer\.max_steps=5"),
    ("profile_step_negative", ["logging.profile_step=-1"], 2, r"logging\.profile_step=-1 must be a step"),
    ("max_steps", ["trainer.max_steps=0"], 2, r"trainer\.max_steps=0 must be >= 1"),
    # profile_step (default 0) depends on max_steps: the message must blame the key the user set
    ("max_steps_negative", ["trainer.max_steps=-1"], 2, r"^trainer\.max_steps=-1 must be >= 1$"),
    (
        "warmup_longer_than_run",
        ["trainer.warmup_steps=30"],
        2,
        r"trainer\.warmup_steps=30 must be in \[0, trainer\.max_steps=20\]; lower trainer\.warmup_steps",
    ),
    (
        "stop_after_not_before_end",
        ["trainer.stop_after_steps=20"],
        2,
        r"trainer\.stop_after_steps=20 must be 0 \(off\) or less than trainer\.max_steps=20; "
        r"set trainer\.stop_after_steps=0",
    ),
    ("micro_batch", ["trainer.micro_batch_size=0"], 2, r"trainer\.micro_batch_size=0 must be >= 1"),
    ("global_batch", ["trainer.global_batch_size=0"], 2, r"trainer\.global_batch_size=0 must be >= 1"),
    ("lr", ["trainer.lr=0"], 2, r"trainer\.lr=0\.0 must be > 0"),
    ("min_lr_ratio", ["trainer.min_lr_ratio=1.5"], 2, r"trainer\.min_lr_ratio=1\.5 must be in \[0, 1\]"),
    ("grad_clip", ["trainer.grad_clip=-1"], 2, r"trainer\.grad_clip=-1\.0 must be >= 0 \(0 disables clipping\)"),
    ("gc_every", ["trainer.gc_every=-1"], 2, r"trainer\.gc_every=-1 must be >= 0"),
    ("save_every", ["trainer.save_every=-1"], 2, r"trainer\.save_every=-1 must be >= 0"),
    ("keep_checkpoints", ["trainer.keep_checkpoints=-1"], 2, r"trainer\.keep_checkpoints=-1 must be >= 0"),
    ("save_every_minutes", ["trainer.save_every_minutes=-5"], 2, r"trainer\.save_every_minutes=-5\.0 must be >= 0"),
    ("loss_chunk_size", ["trainer.loss_chunk_size=-1"], 2, r"trainer\.loss_chunk_size=-1 must be >= 1"),
    (
        "pretrained_without_path",
        ["model.source=pretrained"],
        2,
        r"model\.source=pretrained needs model\.path; set model\.path=",
    ),
    (
        "unsupported_family",
        ["model.family=gemma"],
        2,
        r"model\.family=gemma is not supported under cp; "
        r"supported families: llama, qwen2, qwen3, mistral, qwen3_moe\b",
    ),
    ("model_source", ["model.source=hub"], 2, r"model\.source=hub is not one of \{config, pretrained\}"),
    ("attn_backend", ["model.attn_backend=xformers"], 2, r"model\.attn_backend=xformers is not one of"),
]


@pytest.mark.parametrize("overrides, world_size, message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal_names_field_and_fix(overrides, world_size, message):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=world_size)


def test_random_init_without_arch_is_refused():
    cfg = compose_config([])
    cfg.model.arch = {}  # would otherwise build the HF default shape (a 7B Llama)
    with pytest.raises(ConfigError, match=r"model\.source=config needs model\.arch .*use a preset such as model="):
        validate(cfg, world_size=2)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_selective_kept_needs_block_or_budget():
    with pytest.raises(ConfigError, match=r"memory.selective_kept=true only applies to memory.recompute=block or budget"):
        validate(compose_config(["memory=selective", "memory.selective_kept=true"]), 2)
    plan = validate(compose_config(["memory=selective_block"]), 2)
    assert plan.cp == 2


def test_budget_probe_numbers_come_in_pairs():
    with pytest.raises(ConfigError, match=r"memory.probe_none_gib=50.0 and memory.probe_full_gib=0.0: give both"):
        validate(compose_config(["memory=budget", "memory.probe_none_gib=50"]), 2)
    validate(compose_config(["memory=budget", "memory.probe_none_gib=50", "memory.probe_full_gib=10"]), 2)


def test_seq_len_beyond_the_position_table_is_refused():
    with pytest.raises(ConfigError, match=r"data.seq_len=5000 .padded to 5000 for cp. exceeds "
                                          r"model.arch.max_position_embeddings=4096; shorten data.seq_len"):
        validate(compose_config(["data.seq_len=5000"]), 2)


def test_except_attention_budget_needs_the_probe_and_no_fixed_layer_count():
    base = ["memory=except_attention", "memory.budget_gib=100"]
    with pytest.raises(ConfigError, match="chooses recompute_num_layers from the probe"):
        validate(compose_config(base), 2)
    with pytest.raises(ConfigError, match="chooses recompute_num_layers from the probe"):
        validate(compose_config(base + ["memory.probe_none_gib=150", "memory.probe_full_gib=60",
                                        "memory.recompute_num_layers=2"]), 2)
    validate(compose_config(base + ["memory.probe_none_gib=150", "memory.probe_full_gib=60"]), 2)
    with pytest.raises(ConfigError, match=r"memory.budget_gib=100.0 only applies to memory.recompute=budget or "):
        validate(compose_config(["memory=selective", "memory.budget_gib=100"]), 2)


@pytest.mark.parametrize("preset", ["zero2", "zero3", "zero3_offload"])
def test_bf16_master_weights_validate_with_bf16_precision(preset):
    # offload included: DeepSpeed 0.19.8 builds its CPU Adam with bf16 moments for it (engine/ds/config.py)
    cfg = compose_config([f"deepspeed={preset}", "precision=bf16", "deepspeed.master_weights=bf16"])
    assert validate(cfg, world_size=2).precision == "bf16"


# --- one registry: validate reads the library's list of families -------------------------------------------


def test_validate_lists_exactly_the_library_registry():
    from configs.model import MOE_FAMILIES, SUPPORTED_FAMILIES
    from ds_ulysses_ext.models import SUPPORTED
    assert SUPPORTED_FAMILIES == tuple(SUPPORTED)
    assert MOE_FAMILIES == tuple(name for name, family in SUPPORTED.items() if family.moe)
    assert SUPPORTED_FAMILIES[:5] == ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
    assert "qwen3_moe" in MOE_FAMILIES and not {"llama", "qwen2", "qwen3", "mistral"} & set(MOE_FAMILIES)


@pytest.mark.parametrize("family", ["gemma", "phi3"])  # HF families the library does not split
def test_family_outside_the_registry_is_refused_before_any_model_is_built(family, monkeypatch):
    import transformers

    def no_build(*args, **kwargs):
        raise AssertionError("validate built a model or an HF config")
    for name in ("AutoModelForCausalLM", "AutoConfig"):
        monkeypatch.setattr(transformers, name, type(name, (), {"from_config": no_build, "for_model": no_build,
                                                                 "from_pretrained": no_build}))
    with pytest.raises(ConfigError, match=rf"model\.family={family} is not supported under cp; supported families: "
                                          r"llama, qwen2, qwen3, mistral, qwen3_moe\b"):
        validate(compose_config([f"model.family={family}"]), world_size=2)


# --- RoPE types under cp, as model.arch spells them -----------------------------------------------------------

ROPE_ACCEPTED = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                 "original_max_position_embeddings": 2048},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope_type", sorted(ROPE_ACCEPTED))
def test_every_rope_type_checked_under_cp_validates(rope_type, key):
    cfg = compose_config(["parallelism.cp=4"])
    cfg.model.arch[key] = ROPE_ACCEPTED[rope_type]
    assert validate(cfg, world_size=4).cp == 4


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("spelling", ["rope_type", "type"])  # `type`: the pre-transformers-5 key
@pytest.mark.parametrize("rope_type", ["axial", "my_custom_rope"])
def test_unchecked_rope_type_is_refused_under_cp_only(rope_type, spelling, key):
    cfg = compose_config([])
    cfg.model.arch[key] = {spelling: rope_type, "factor": 2.0}
    with pytest.raises(ConfigError, match=rf"^model\.arch\.{key}\.rope_type={rope_type} is not one of the RoPE types "
                                          r"checked under cp \{default, linear, yarn, llama3, proportional, dynamic, "
                                          rf"longrope\}}; set model\.arch\.{key}\.rope_type to one of them or run "
                                          r"with parallelism\.cp=1$"):
        validate(cfg, world_size=2)
    cfg.parallelism.cp = 1
    assert validate(cfg, world_size=2).cp == 1  # no split, nothing to break: stock HF


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_takes_a_seq_len_that_cp_does_not_divide(rope_type):
    # the cp pads never enter the length these types read (ds_ulysses_ext/rope.py; exact: tests/test_rope.py)
    cfg = compose_config(["parallelism.cp=4", "data.seq_len=254"])
    cfg.model.arch["rope_scaling"] = ROPE_ACCEPTED[rope_type]
    assert validate(cfg, world_size=4).seq_len == 254


def test_the_gpu_passkey_curriculum_is_a_chain():
    # each stage of the 4-stage curriculum (docs/retrieval.md, scripts/bench_gpu.sh passkey) starts from the stage
    # before's HF export, the first from random init; a stage pointing elsewhere would train on without a word
    stages = ["256", "1k", "32k", "128k"]
    cfgs = [compose_config([f"experiment=llama1b_1gpu_passkey_{s}"]) for s in stages]
    assert cfgs[0].model.source != "pretrained"
    for before, cfg in zip(cfgs, cfgs[1:]):
        assert cfg.model.source == "pretrained"
        assert Path(cfg.model.path) == Path(before.run.out_dir or f"outputs/{before.run.name}") / "hf_export", (
            cfg.run.name, cfg.model.path)
    assert all(c.trainer.export_hf for c in cfgs[:-1])  # what the next stage reads
    lengths = [max(c.data.passkey.lengths) for c in cfgs]
    assert lengths == sorted(lengths) and all(c.data.passkey.key_length == 2 for c in cfgs)
