"""HF `save_pretrained` folders (safetensors) of the trained model: from the live engine at the end of a run,
or from any saved checkpoint of a run afterwards, in one CPU process.

The second is for what the first cannot serve: a mid-run checkpoint to evaluate, and a run that must go on
where its optimizer state cannot follow (e.g. onto one rank, engine/checkpoints/reshard.py): a new run from the export,
`model.source=pretrained model.path=<export>`, with a fresh optimizer state.

Each export holds training.json: the step it is the model of, the checkpoint it came from (if any) and the resolved
config of the run that trained it. So an export says what it is wherever it is copied, and scripts/eval_retrieval.py
scores it on the task it was trained on. It is written into <folder>.tmp and moved into place whole: a run killed
mid-export leaves the previous export or none, never a mix of two.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from configs import to_dataclass

from ..data.tokenizer import tokenizer_of
from ..ds.build import hf_attn, model_dtype, no_init_weights
from ..ds.hf_config import hf_config_of
from . import checkpoint, manifest
from .buffers import MODEL_STATES

log = logging.getLogger(__name__)

_PREFIX = "hf."  # CPCausalLM holds the HF model as `.hf`
RECORD = "training.json"


def read_record(export_dir: Path) -> dict | None:
    """An export's training.json ({"step", "checkpoint", "config"}); None for an export written before it existed."""
    path = Path(export_dir) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def _save_folder(hf_model, state: dict, export_dir: Path, tokenizer=None, record: dict | None = None) -> None:
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # an export a crash cut short
    _write_folder(hf_model, state, tmp, tokenizer)
    if record is not None:
        (tmp / RECORD).write_text(json.dumps(record, indent=2))
    shutil.rmtree(export_dir, ignore_errors=True)
    os.replace(tmp, export_dir)


def _write_folder(hf_model, state: dict, export_dir: Path, tokenizer=None) -> None:
    state = {k.removeprefix(_PREFIX): v.detach().cpu() for k, v in state.items()}
    unread = _stock_unread(hf_model)
    if unread:
        note = (f"holds {len(unread)} tensor(s) stock HF {type(hf_model).__name__} has no place for ({unread[0]}, "
                "...): the routers' expert_bias of moe.balance=bias, which takes part in choosing each token's "
                "experts and cannot be folded into the weights. Stock HF from_pretrained reports them as UNEXPECTED "
                "and routes without them, which is another model; ds_ulysses_ext reads them "
                "(scripts/train.py or scripts/eval_retrieval.py with model.source=pretrained model.path=<this "
                "folder>), and routes as trained")
        hf_model.config.ds_ulysses_ext_note = f"This export {note}"
        log.warning("the HF export %s %s", export_dir, note)
    elif hasattr(hf_model.config, "ds_ulysses_ext_note"):  # a note read in with the weights this run started from
        del hf_model.config.ds_ulysses_ext_note
    if hasattr(hf_model.config, "router_expert_bias"):  # LatentMoE's own class builds and reads the buffer
        hf_model.config.router_expert_bias = any(k.endswith(".expert_bias") for k in state)
    impl = hf_model.config._attn_implementation
    hf_model.config._attn_implementation = "sdpa"  # the export must load without this package
    try:
        hf_model.save_pretrained(str(export_dir), state_dict=state, safe_serialization=True)
    finally:
        hf_model.config._attn_implementation = impl
    if tokenizer is not None:
        tokenizer.save_pretrained(str(export_dir))


def _stock_unread(hf_model) -> list[str]:
    """State-dict keys of the buffers our routers add under a name of ours (`expert_bias`), which the stock HF
    class does not have; none for our own LatentMoE class, nor for a bias under HF's name (DeepSeek-V3's)."""
    from ds_ulysses_ext.moe import TopKRouter
    from ds_ulysses_ext.moe.latent_model import LatentMoeForCausalLM
    if isinstance(hf_model, LatentMoeForCausalLM):
        return []
    return [f"{name}.expert_bias" for name, mod in hf_model.named_modules()
            if isinstance(mod, TopKRouter) and "expert_bias" in mod._buffers]


def export_hf(engine, hf_model, export_dir: Path, rank: int, tokenizer=None, record: dict | None = None) -> Path:
    """The live model, at the end of a run. Collective under ZeRO-3 (it gathers every shard to rank 0). `record`:
    training.json's content."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # full dict on rank 0
    else:
        state = engine.module.state_dict()
    state = _with_all_experts(engine.module, state, rank)
    if rank == 0:
        _save_folder(hf_model, state, export_dir, tokenizer, record)
    dist.barrier()
    return export_dir


def _with_all_experts(module, state: dict, rank: int) -> dict:
    """With ep > 1 each rank holds E / ep experts: rank 0's state gets every EP rank's shard, in expert order.
    Collective over each block's EP group (every rank walks the blocks in the same order)."""
    import torch
    from ds_ulysses_ext.moe import moe_blocks
    blocks = moe_blocks(module)
    if not blocks or blocks[0].ep_size == 1:
        return state
    group = blocks[0].context.dispatcher.group
    names = {id(p): n for n, p in module.named_parameters()}
    for block in blocks:
        for param in block.experts.parameters():
            gathered = contextlib.nullcontext()
            if hasattr(param, "ds_id"):
                import deepspeed
                gathered = deepspeed.zero.GatheredParameters([param])  # over the shard's EDP replicas
            with gathered:
                local = param.detach().clone()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            if rank == 0:
                state[names[id(param)]] = torch.cat(parts)
    return state


def export_hf_from_checkpoint(out_dir: Path, tag: str | None = None, export_dir: Path | None = None) -> Path:
    """A saved checkpoint of the run in `out_dir` (default: `latest`): DeepSpeed's fp32 master weights,
    gathered from every rank's shard file by its zero_to_fp32 (deepspeed=zero0: the module state DeepSpeed saved
    whole), cast to the run's model dtype."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tag = tag or checkpoint.latest_tag(out_dir)
    folder = checkpoint.ckpt_root(out_dir) / str(tag)
    if tag is None or not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint {tag or '(latest)'} under {checkpoint.ckpt_root(out_dir)}")
    problems = manifest.verify(folder, 0)  # before torch reads a file cut short and fails without naming it
    if problems:
        older = sorted((p.name for p in folder.parent.glob("step_*") if p.is_dir() and p.name < tag), reverse=True)
        raise checkpoint.DamagedCheckpoint(
            f"checkpoint {folder} is damaged: {'; '.join(problems)}. Restore it from a copy, or export an older "
            f"checkpoint ({'--tag ' + older[0] if older else 'there is none'})")
    # the config of the run that wrote this checkpoint; a checkpoint from before they carried one: the run folder's
    saved = folder / checkpoint.CONFIG_FILE
    meta = json.loads((saved if saved.exists() else out_dir / "config.json").read_text())
    cfg = to_dataclass(meta["config"])
    if cfg.parallelism.ep > 1:
        # zero_to_fp32 assumes every parameter is partitioned over all ranks; expert shards are not
        raise NotImplementedError(
            f"{out_dir} is an MoE run with parallelism.ep={cfg.parallelism.ep}: exporting from its checkpoint files "
            "is not supported (expert shards are partitioned per EP rank). Use the run's own export "
            "(trainer.export_hf=true writes <run.out_dir>/hf_export), or resume it and let it export at the end")
    export_dir = Path(export_dir or out_dir / f"hf_export_{tag}")
    if cfg.deepspeed.zero_stage == 0:
        # deepspeed=zero0 keeps no master partition: the weights are the module state DeepSpeed saved whole
        state = torch.load(checkpoint.ckpt_root(out_dir) / tag / MODEL_STATES[0], map_location="cpu",
                           weights_only=False)["module"]
    else:
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.ckpt_root(out_dir)), tag=tag)
    state = {k.removeprefix(_PREFIX): v for k, v in state.items()}
    expert_bias = any(k.endswith(".expert_bias") for k in state)  # zero_to_fp32 returns the buffers too
    hf_config = hf_config_of(cfg.model)
    if hasattr(hf_config, "router_expert_bias"):
        hf_config.router_expert_bias = expert_bias
    # every weight is overwritten from the checkpoint, so HF's random init would be wasted time
    with no_init_weights() if no_init_weights is not None else contextlib.nullcontext():
        # the attention HF accepts for the family (GPT-OSS refuses sdpa); nothing here runs it
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=model_dtype(cfg),
                                                    attn_implementation=hf_attn(cfg.model))
    if expert_bias:  # our blocks hold the routers' bias; the stock Qwen3-MoE / GPT-OSS blocks have no place for it
        from ds_ulysses_ext.moe.parallel import replace_hf_blocks
        replace_hf_blocks(hf_model, expert_bias=True)
    hf_model.load_state_dict(state, strict=True)  # zero_to_fp32 names a tied lm_head too
    record = {"step": int(tag.removeprefix("step_")) if tag.startswith("step_") else None, "checkpoint": tag, **meta}
    _save_folder(hf_model, hf_model.state_dict(), export_dir, tokenizer_of(cfg.data), record)
    return export_dir
