#!/usr/bin/env python3
"""Passkey retrieval of a trained model on a length x depth grid, under CP. Hydra app over hydra_conf/.

    # a run of data=passkey: scores its hf_export/ on the task it was trained on
    torchrun --standalone --nproc_per_node 2 scripts/eval_retrieval.py outputs/cpu_passkey parallelism.cp=2 \
        lengths=[1024,1536,2048] depths=[0.0,0.5,1.0]
    # any HF folder (its tokenizer if it ships one), on GPUs with a memory preset
    deepspeed --num_gpus 1 --no_local_rank scripts/eval_retrieval.py <hf folder> precision=bf16 \
        memory=long_context lengths=[131072] data.passkey.key_length=5

Teacher-forced exact match of the whole answer per cell (engine/run/retrieval.py), written to
<out_dir>/retrieval.json ({"cells": [{"length", "depth", "accuracy"}...], "mean_accuracy", "task", "step"}) and
retrieval.png. out_dir defaults to <target>/eval_retrieval: a run's own retrieval.json (its training-time score)
stays. The task is the one the model was trained on when its export says (training.json, which every export of this
project holds), else data.passkey as configured; retrieval.json and the printout name it either way. Launched like
scripts/train.py (torchrun, deepspeed, plain python).
"""
import dataclasses
import json
import random
import sys
import warnings
from pathlib import Path

# plain `deepspeed` appends --local_rank=N, and the target is positional: neither is a Hydra override
sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
sys.argv = sys.argv[:1] + [a if "=" in a or a.startswith("-") else f"target={a}" for a in sys.argv[1:]]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from configs import HYDRA_CONF_DIR, ConfigError, register_configs, to_dataclass  # noqa: E402
from configs.compose import check_overrides  # noqa: E402
from configs.precision import ALIGN_TOKENS  # noqa: E402
from configs.retrieval import RetrievalEvalConfig  # noqa: E402
from configs.train import TrainConfig  # noqa: E402
from ds_ulysses_ext.attention.layout import padded_length  # noqa: E402
from engine.checkpoints.export import RECORD, read_record  # noqa: E402
from engine.run.refusal import hush_other_ranks, hydra_started, reported  # noqa: E402

register_configs()
ConfigStore.instance().store(name="eval_retrieval_schema", node=RetrievalEvalConfig)
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
                        category=FutureWarning)

# the HF config keys validate() reads to check cp, heads and positions before the model loads
_ARCH_KEYS = ("vocab_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
              "num_hidden_layers", "hidden_size", "head_dim")
# the run's task: the grid must ask the question the model was trained on
_TASK_FIELDS = ("key", "key_length", "num_needles", "num_distractors", "filler")


@hydra.main(version_base="1.3", config_path="../hydra_conf", config_name="eval_retrieval")
def main(dict_cfg: DictConfig) -> None:
    hydra_started()
    from engine.ds.distributed import exit_after_success
    with reported():
        run(to_eval_config(dict_cfg))
    exit_after_success()  # reached only when the evaluation ended normally: groups destroyed, no finalisation


def to_eval_config(dict_cfg) -> RetrievalEvalConfig:
    return to_dataclass(dict_cfg, RetrievalEvalConfig)  # every key checked, also one given with +


def compose(overrides=()) -> RetrievalEvalConfig:
    """hydra_conf/eval_retrieval.yaml with command-line style overrides, without a command line (tests)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(HYDRA_CONF_DIR), version_base="1.3"):
        return to_eval_config(hydra_compose(config_name="eval_retrieval", overrides=list(overrides)))


def resolve(cfg: RetrievalEvalConfig, world_size: int):
    """(the training config that builds the model for scoring, the task, the grid's lengths and depths, where
    results go, what retrieval.json says was scored: the task, where it came from, the model's step); every refusal
    happens here, before any process group or model exists."""
    from engine.data.passkey import PasskeyTask
    from engine.data.tokenizer import tokenizer_of
    if not cfg.target:
        raise ConfigError("no model to score: give a run.out_dir or an HF folder as the first argument, "
                          "e.g. scripts/eval_retrieval.py outputs/cpu_passkey")
    target = Path(cfg.target)
    meta = json.loads((target / "config.json").read_text()) if (target / "config.json").exists() else None
    if meta is None:
        raise ConfigError(f"{target} holds no config.json: give a run.out_dir (written by scripts/train.py) or an "
                          "HF model folder")
    data = cfg.data
    lengths = list(cfg.lengths)
    if "plan" in meta:  # a run dir: its export, its task, its tokenizer and filler
        hf_dir = target / "hf_export"
        if not (hf_dir / "config.json").exists():
            raise ConfigError(f"{target} has no hf_export/; write one with `python scripts/export_hf.py {target}`, "
                              f"then score <that folder>")
        record = read_record(hf_dir) or meta  # the export's own; one written before exports carried it: the run's
        run_data = record["config"]["data"]
        if run_data["source"] != "passkey":
            raise ConfigError(f"{target} was trained on data.source={run_data['source']}, not passkey; score its "
                              f"hf_export folder with the task set by data.passkey.* overrides")
        hf_cfg = json.loads((hf_dir / "config.json").read_text())
    else:  # an HF folder: its export record says the task it learned, if it was one of ours and passkey
        hf_dir, hf_cfg, record = target, meta, read_record(target)
        run_data = record["config"]["data"] if record else None
        if run_data is not None and run_data["source"] != "passkey":
            run_data = None
    if run_data is not None:
        passkey = dataclasses.replace(data.passkey, **{k: run_data["passkey"][k] for k in _TASK_FIELDS})
        data = dataclasses.replace(data, passkey=passkey, path=run_data["path"])
        lengths = lengths or list(run_data["passkey"]["eval_lengths"]) or [run_data["seq_len"]]
    else:
        lengths = lengths or [data.seq_len]
    out_dir = Path(cfg.out_dir) if cfg.out_dir else target / "eval_retrieval"
    source = (f"the task {hf_dir / RECORD} records" if run_data is not None and record is not meta else
              f"the task {target / 'config.json'} records" if run_data is not None else
              "data.passkey as configured (the model's folder records no passkey task)")
    if (hf_dir / "tokenizer.json").exists():
        data = dataclasses.replace(data, tokenizer_path=str(hf_dir))
    depths = [float(d) for d in cfg.depths]
    if not depths:
        raise ConfigError("depths=[] is empty: the grid needs at least one depth; set e.g. depths=[0.0,0.5,1.0]")
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"depths={depths} must lie in [0, 1] (0 = start of the filler, 1 = its end)")
    if cfg.samples_per_cell < 1:
        raise ConfigError(f"samples_per_cell={cfg.samples_per_cell} must be >= 1")
    limit = hf_cfg.get("max_position_embeddings")
    if limit and max(lengths) > limit:
        raise ConfigError(f"lengths={lengths} holds {max(lengths)} tokens, above the model's max_position_embeddings="
                          f"{limit} ({hf_dir / 'config.json'}); score lengths <= {limit}, e.g. "
                          f"lengths=[{min(limit, min(lengths))}]")
    micro = cfg.trainer.micro_batch_size
    seq_len = max(lengths)
    if cfg.precision == "fp8":
        # data.seq_len only sizes the plan here: the scored rows keep their own lengths, and FP8's forward takes any.
        # Training rows must be multiples of 16 x cp (configs/precision.py check_fp8: the weight gradient's GEMM), so
        # the nominal length rounds up to one rather than refusing a length no backward will see
        seq_len = padded_length(seq_len, ALIGN_TOKENS * cfg.parallelism.cp)
    train_cfg = TrainConfig(
        run=dataclasses.replace(cfg.run, out_dir=str(out_dir)),
        model=dataclasses.replace(cfg.model, source="pretrained", path=str(hf_dir), family=hf_cfg["model_type"],
                                  arch={k: hf_cfg[k] for k in _ARCH_KEYS if hf_cfg.get(k) is not None}),
        data=dataclasses.replace(data, seq_len=seq_len, eval_samples=0, eval_path=None,
                                 passkey=dataclasses.replace(data.passkey, lengths=[], eval_lengths=[])),
        parallelism=cfg.parallelism, deepspeed=cfg.deepspeed,
        trainer=dataclasses.replace(cfg.trainer, max_steps=1, warmup_steps=0, eval_every=0, resume=False,
                                    global_batch_size=micro * (world_size // cfg.parallelism.cp),
                                    export_hf=False, save_at_end=False),
        memory=cfg.memory, logging=cfg.logging, precision=cfg.precision, device=cfg.device,
        dist_backend=cfg.dist_backend)
    tokenizer = tokenizer_of(train_cfg.data)  # the target's own when it ships one, else the shipped one
    task = PasskeyTask(train_cfg.data.passkey, tokenizer, train_cfg.data.path)
    task.make(random.Random(0), min(lengths))  # a key that does not fit the shortest length fails here
    scored = {"task": {k: getattr(train_cfg.data.passkey, k) for k in _TASK_FIELDS}, "task_from": source,
              "step": (record or {}).get("step")}
    return train_cfg, task, lengths, depths, out_dir, scored


def run(cfg: RetrievalEvalConfig) -> dict:
    """Everything after composition; tests call it on forked ranks."""
    from engine.ds.distributed import init_distributed, read_runtime
    from engine.run.startup import prepare
    rt = read_runtime(cfg.device, cfg.dist_backend)
    train_cfg, task, lengths, depths, out_dir, scored = resolve(cfg, rt.world_size)
    train_cfg, plan = prepare(train_cfg, rt)  # cp, heads, memory presets (memory=auto's choice): before the model loads
    init_distributed(rt)
    from ds_ulysses_ext import init_topology
    from engine.ds.build import build
    from engine.data import pad_id_of
    from engine.run.retrieval import score_retrieval, write_retrieval
    topo = init_topology(plan.cp, plan.ep, plan.ring)
    engine, _, _ = build(train_cfg, plan, topo, rt.device)
    result = score_retrieval(engine, task, cfg.run.seed, lengths, depths, cfg.samples_per_cell, topo, plan.dp,
                             plan.micro_batch_size, pad_id_of(task.tok), rt.device)
    result["model"] = train_cfg.model.path
    result.update(scored)
    if rt.is_main:
        json_path, png_path = write_retrieval(result, out_dir, f"{Path(cfg.target).resolve().name}: passkey "
                                              f"retrieval, mean {result['mean_accuracy']:.2f}")
        print(f"task: {scored['task']} ({source_line(scored)})\nmean_accuracy: {result['mean_accuracy']:.4f}\n"
              f"retrieval: {json_path}\nheatmap: {png_path}", flush=True)
    return result


def source_line(scored: dict) -> str:
    step = f", the model of step {scored['step']}" if scored["step"] is not None else ""
    return f"from {scored['task_from']}{step}"


if __name__ == "__main__":
    with reported():
        check_overrides(sys.argv[1:], RetrievalEvalConfig)
    hush_other_ranks()
    main()
