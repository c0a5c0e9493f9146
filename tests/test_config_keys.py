"""No key is accepted and ignored (issue 24 item 5): every leaf of TrainConfig is either read by every run or listed in
configs/conditional.py with the condition under which it is read; set away from its default while that condition is
false, it is refused (or, where ignoring it changes nothing trained, warned about in Plan.unread)."""
import pytest

from configs import ConfigError, TrainConfig, compose_config, validate
from configs.conditional import CONDITIONAL, UNCONDITIONAL, leaves

# key: (overrides under which the run does not read it, a value away from its default, or {key: value} to set)
UNREAD = {
    "model.path": ([], "some/folder"),
    "data.path": (["data=synthetic"], "train.jsonl"),
    "data.format": (["data=synthetic"], "chat"),
    "data.tokenizer_path": (["data=synthetic"], "some/tokenizer"),
    "data.masked_fraction": ([], 0.5),
    "data.num_samples": ([], 10),
    "data.overlong": (["data=synthetic"], "drop"),
    "data.on_bad_line": (["data=synthetic"], "fail"),
    "data.passkey.lengths": ([], [64]), "data.passkey.depth_min": ([], 0.1), "data.passkey.depth_max": ([], 0.9),
    "data.passkey.key": ([], "letters"), "data.passkey.key_length": ([], 3), "data.passkey.num_needles": ([], 2),
    "data.passkey.num_distractors": ([], 1), "data.passkey.filler": ([], "repeat"),
    "data.passkey.eval_lengths": ([], [64]), "data.passkey.eval_depths": ([], [0.5]),
    "data.passkey.eval_samples_per_cell": ([], 2),
    "trainer.min_lr_ratio": (["trainer.lr_decay=constant"], 0.5),
    "model.loss_head": (["trainer.fused_loss=false"], "ours"),
    "trainer.loss_chunk_size": (["model.kernels=liger", "model.loss_head=liger"], 64),
    "model.projection_groups": (["model.kernels=none"], False),
    "model.linear_attn_kernel": ([], "torch"),  # model=tiny: a Llama, no linear-attention layers
    "trainer.on_corrupt_checkpoint": (["trainer.resume=false"], "abort"),
    "trainer.reshard_on_resume": (["trainer.resume=false"], False),
    "trainer.keep_checkpoints": (["trainer.save_at_end=false"], 2),
    "memory.recompute_num_layers": (["memory=full_recompute"], 1),
    "memory.recompute_method": (["memory=full_recompute"], "block"),
    "memory.budget_gib": ([], 10.0),
    # the probes come in pairs (configs/memory.py refuses one alone): both are set, the message names each
    "memory.probe_none_gib": ([], {"memory.probe_none_gib": 10.0, "memory.probe_full_gib": 5.0}),
    "memory.probe_full_gib": ([], {"memory.probe_none_gib": 10.0, "memory.probe_full_gib": 5.0}),
    "memory.selective_kept": ([], True),
    "memory.offload_max_gib": ([], 2.0),
    "memory.offload_inflight_gib": ([], 1.0),
    "memory.mlp_tile_tokens": ([], 1024),
    "memory.auto_gpu_gib": ([], 80.0),
    "memory.auto_host_gib": ([], 500.0),
    "memory.attention_offload": ([], True),
    "deepspeed.stage3_param_persistence_threshold": (["deepspeed=zero2"], 10),
    "deepspeed.stage3_prefetch_bucket_size": (["deepspeed=zero2"], 10),
    # deepspeed=zero0 runs on one rank only: the third item is the world size to validate at
    **{f"deepspeed.{k}": (["deepspeed=zero0", "parallelism.cp=1", "trainer.global_batch_size=1"], v, 1)
       for k, v in (("overlap_comm", False), ("contiguous_gradients", False), ("reduce_bucket_size", 1000))},
    "fp8.recipe": ([], "rowwise"), "fp8.linears": ([], "all"), "fp8.compile": ([], "false"),
    "fp8.emulate_on_cpu": ([], True), "fp8.amax_history": ([], 8),
    "moe.dispatcher": ([], "alltoall"),
    "moe.balance": ([], "bias"),
    "moe.aux_loss_coef": (["model=tiny_moe", "moe.balance=bias"], 0.01),
    "moe.bias_update_rate": (["model=tiny_moe"], 0.01),
    "moe.recompute": ([], "act"),
    "moe.recompute_group_size": (["model=tiny_moe"], 4),
    "moe.offload_inputs": (["model=tiny_moe"], True),
    "logging.wandb.project": ([], "elsewhere"),
    "logging.wandb.entity": ([], "someone"),
}
# the issue's own cases, on top of the generic ones: a balance key on a dense model
DENSE_MOE = {"moe.aux_loss_coef": 0.01, "moe.bias_update_rate": 0.01, "moe.recompute_group_size": 4}


def test_every_leaf_of_the_config_tree_is_classified():
    paths = set(leaves(TrainConfig()))
    conditional, unconditional = set(CONDITIONAL), set(UNCONDITIONAL)
    assert not conditional & unconditional, conditional & unconditional
    assert (conditional | unconditional) - paths == set(), "entries that are not keys"
    assert paths - conditional - unconditional == set(), (
        "new keys: list each in configs/conditional.py, CONDITIONAL (read only when ...) or UNCONDITIONAL")
    assert set(UNREAD) == conditional, "each conditional key needs a case here"


def _set(cfg, path, value):
    *parents, leaf = path.split(".")
    node = cfg
    for name in parents:
        node = getattr(node, name)
    setattr(node, leaf, value)


@pytest.mark.parametrize("path", sorted(UNREAD))
def test_a_key_its_run_never_reads_is_refused_or_warned(path):
    off, value, *world = UNREAD[path]
    world = world[0] if world else 2
    cfg = compose_config(off)
    assert not CONDITIONAL[path].read(cfg) or (CONDITIONAL[path].moe and cfg.model.family == "llama"), path
    assert validate(cfg, world_size=world).unread == ()  # the base config alone is clean
    for key, v in (value if isinstance(value, dict) else {path: value}).items():
        _set(cfg, key, v)
    value = value[path] if isinstance(value, dict) else value
    if CONDITIONAL[path].warn:
        unread = validate(cfg, world_size=world).unread
        assert len(unread) == 1 and unread[0].startswith(f"{path}={value} is read only with "), unread
    else:
        with pytest.raises(ConfigError, match=rf"\b{path.replace('.', '[.]')}\b"):
            validate(cfg, world_size=world)


@pytest.mark.parametrize("path,value", sorted(DENSE_MOE.items()))
def test_moe_keys_on_a_dense_model_are_refused(path, value):
    cfg = compose_config([])
    _set(cfg, path, value)
    with pytest.raises(ConfigError, match=rf"^{path}={value} is read only for a model with MoE layers \(model\.family "
                                          r"in \{.*\}\), and model\.family=llama has none, so it would be ignored; "
                                          rf"drop the override \({path}=\S+ is the default\)$"):
        validate(cfg, world_size=2)


@pytest.mark.parametrize("overrides", [
    ["model=tiny_moe", "moe.balance=bias", "moe.bias_update_rate=0.01"],
    ["model=tiny_moe", "moe.aux_loss_coef=0.01"],
    ["model=tiny_moe", "moe=expert_recompute", "moe.recompute_group_size=4"],
    ["memory=block_recompute", "memory.recompute_num_layers=2"],
    ["data=synthetic", "data.masked_fraction=0.5"],
])
def test_the_same_keys_are_accepted_where_they_are_read(overrides):
    assert validate(compose_config(overrides), world_size=2).unread == ()
