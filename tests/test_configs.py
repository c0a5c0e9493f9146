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
    world = 8
    if (group, name) == ("deepspeed", "zero0"):  # one rank only (tests/test_zero0.py checks the refusal at 2)
        overrides += ["parallelism.cp=1", "trainer.global_batch_size=4"]
        world = 1
    validate(compose_config(overrides), world_size=world)


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


def test_a_word_choice_spelt_like_a_boolean_reaches_its_str_field_as_typed():
    """Hydra reads `fp8.compile=false` as a boolean and the typed schema stored it as "False", which the check of
    fp8.compile's choices then refused; a bool field still takes the boolean."""
    cfg = compose_config(["precision=fp8", "fp8.compile=false", "fp8.emulate_on_cpu=true", "device=cpu"])
    assert cfg.fp8.compile == "false" and cfg.fp8.emulate_on_cpu is True
    validate(cfg, world_size=2)


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
    # each stage of the 4-stage curriculum (docs/retrieval.md, scripts/bench/bench_gpu.sh passkey) starts from the stage
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
