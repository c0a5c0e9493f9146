"""Resuming on another number of ranks.

DeepSpeed's ZeRO optimizer state is saved as one shard file per rank, and `load_checkpoint` accepts it only on
as many ranks at the same ZeRO stage: a changed world size fails inside DeepSpeed after the model is built, a
changed stage with a bare AssertionError. Megatron's and DCP's checkpoints re-shard on load; users coming from
them expect a resume on fewer or more GPUs to work.

So each checkpoint records its layout (world size, the ZeRO stage that really ran: engine/ds/config.py runs
ZeRO-3 on one rank as ZeRO-2). At resume:
- same layout: DeepSpeed loads it as saved;
- another world size, this run on ZeRO-3 (the checkpoint on ZeRO-3, or on ZeRO-2, e.g. a 1-rank run): rank 0
  converts the checkpoint with DeepSpeed's own `ds_to_universal` (per-parameter fp32 weights and Adam moments,
  no partitioning) into checkpoints/universal/<tag> (a deepspeed=zero0 checkpoint, which has no ZeRO partition for
  it to read, by `_zero0_to_universal` into the same layout), every rank loads that with `checkpoint.load_universal`,
  `finish_reshard` repairs what the loader leaves wrong (Adam's step device; the module's buffers, which the
  universal format does not hold, from the checkpoint's model-states file), and the copy is deleted. Exact: the
  trajectory continues as the uninterrupted run's (tests/test_engine.py: 2 -> 4 and 1 -> 2 ranks; MoE with every
  moe.balance, tests/test_moe_engine.py; zero0 -> 2 ranks, tests/test_zero0.py);
- this run on ZeRO-2 (one rank, or deepspeed=zero2), or `trainer.reshard_on_resume=false`: refused before the
  model is built, with the fix (DeepSpeed 0.19.8's universal format did not load into ZeRO-2 when tried). One
  rank with deepspeed.offload_param=true runs ZeRO-3 and so can take a re-partitioned checkpoint.
`parallelism.cp` is not part of the layout: at the same world size, ZeRO partitions over the same ranks.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .buffers import MODEL_STATES, restore_from_checkpoint
from .checkpoint import LAYOUT_FILE, ResumeRefused, ckpt_root, read_json

log = logging.getLogger(__name__)

UNIVERSAL = "universal"  # checkpoints/universal/<tag>: a converted copy, deleted once loaded


def optimizer_layout(world_size: int, zero_stage: int, ep: int = 1) -> dict:
    layout = {"world_size": world_size, "zero_stage": zero_stage}
    if ep > 1:  # only then: layouts written before ep existed stay equal to today's ep=1 layouts
        layout["ep"] = ep
    return layout


def needs_reshard(out_dir: Path, tag: str, layout: dict, allowed: bool) -> dict | None:
    """The saved layout of checkpoint `tag` when it must be converted before this run's ranks can load it, else
    None; raises when it cannot be. A checkpoint written before layouts were recorded is loaded as saved
    (DeepSpeed then judges)."""
    path = ckpt_root(out_dir) / tag
    if not (path / LAYOUT_FILE).exists():
        return None
    saved = read_json(path / LAYOUT_FILE)
    if saved == layout:
        return None
    saved_ep, ep = saved.get("ep", 1), layout.get("ep", 1)
    if saved_ep > 1 or ep > 1:
        # an expert shard's optimizer state is partitioned over its EDP group and DeepSpeed's universal
        # conversion assumes every parameter is partitioned over all ranks: it would mix different experts
        raise ResumeRefused(
            f"checkpoint {path} was written with parallelism.ep={saved_ep} on {saved['world_size']} rank(s); this run "
            f"has parallelism.ep={ep} on {layout['world_size']} rank(s). An MoE run with ep > 1 resumes only on the "
            f"same ep and world size: resume with parallelism.ep={saved_ep} on {saved['world_size']} rank(s), or start "
            "a new run from the run's HF export (model.source=pretrained model.path=<run.out_dir>/hf_export)")
    if allowed and saved["zero_stage"] in (0, 2, 3) and layout["zero_stage"] == 3:
        return saved
    why = ("trainer.reshard_on_resume=false" if not allowed else
           "a checkpoint is re-partitioned only into ZeRO-3 (DeepSpeed's universal format did not load into ZeRO-2 "
           "in our tests)")
    held = (f"ZeRO-{saved['zero_stage']} optimizer state partitioned over {saved['world_size']} rank(s)"
            if saved["zero_stage"] else "deepspeed=zero0 optimizer state (one rank's, not partitioned: DeepSpeed's "
            "universal conversion reads ZeRO partitions only)")
    raise ResumeRefused(
        f"checkpoint {path} holds {held}; this run has {layout['world_size']} rank(s) at ZeRO-{layout['zero_stage']}, "
        f"and {why}. Resume on {saved['world_size']} rank(s) with the same deepspeed preset (parallelism.cp may "
        "change: the trajectory stays exact), or start a new run.out_dir from the weights alone (the optimizer "
        f"state starts fresh): `python scripts/export_hf.py {out_dir} --tag {tag}`, then model.source=pretrained "
        "model.path=<that export>. Note: deepspeed.zero_stage=3 on one rank runs as ZeRO-2 (engine/ds/config.py); "
        "deepspeed.offload_param=true keeps one rank on ZeRO-3, which this checkpoint can be re-partitioned into")


def to_universal(out_dir: Path, tag: str, rank: int, saved_stage: int) -> Path:
    """Rank 0 converts checkpoints/<tag> into checkpoints/universal/<tag>; every rank gets the root to load
    from, or the conversion's error."""
    root = ckpt_root(out_dir) / UNIVERSAL
    error = None
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # a conversion a crash cut short
        log.info("re-partitioning checkpoint %s for this run's ranks (DeepSpeed ds_to_universal)", tag)
        src, dst = ckpt_root(out_dir) / tag, root / tag
        if saved_stage == 0:
            try:
                _zero0_to_universal(src, dst)
            except Exception as err:  # raised on every rank below, not on this one alone
                error = f"converting the deepspeed=zero0 checkpoint {src} failed: {err!r}"
        else:
            # a ZeRO-2 checkpoint lacks the Megatron-style metadata ds_to_universal asks of it; it injects a default
            extra = ["--inject_missing_state"] if saved_stage == 2 else []
            done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                   str(src), "--output_folder", str(dst)] + extra, capture_output=True, text=True)
            if done.returncode != 0:
                error = f"ds_to_universal failed on {src}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
            elif saved_stage == 2:
                _zero2_universal_for_zero3(src, dst)
    message = [error]
    dist.broadcast_object_list(message, src=0)  # every rank raises, not only rank 0
    if message[0] is not None:
        raise RuntimeError(message[0])
    return root


def _zero0_to_universal(src: Path, dst: Path) -> None:
    """deepspeed=zero0 saves no ZeRO partition for ds_to_universal to read: its checkpoint is the module state and the
    torch optimizer's state dict (engine/ds/clipping_adamw.py). The universal folder ZeRO-3 loads is written from
    them, as ds_to_universal writes one from a ZeRO-2 checkpoint (then _zero2_universal_for_zero3): a folder per
    parameter with fp32.pt, exp_avg.pt and exp_avg_sq.pt ({'param': the whole tensor, 'cat_dim': 0}),
    zero/optimizer_state.pt with the step and the param groups, and the model-state file under both names.
    Values are copied, never recomputed: bf16 weights and moments widen to fp32 and round back exactly on load."""
    from collections import OrderedDict
    model = torch.load(src / MODEL_STATES[0], map_location="cpu", weights_only=False)
    optim = model["optimizer"]
    if len(optim["param_groups"]) != 1:
        raise RuntimeError(f"expected the one param group ClippingAdamW is built with, found "
                           f"{len(optim['param_groups'])}")
    group = optim["param_groups"][0]
    # the optimizer's parameters in order: the module state's keys less its buffers and less a tied weight's second
    # name (the same storage; named_parameters, which built the optimizer, yields the first name only)
    buffers, seen, names = set(model.get("buffer_names") or ()), set(), []
    for name, tensor in model["module"].items():
        if name not in buffers and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            names.append(name)
    if len(names) != len(group["params"]):
        raise RuntimeError(f"{len(names)} parameters in the module state, {len(group['params'])} in the optimizer's")
    step = None
    for index, name in zip(group["params"], names):
        state, weight = optim["state"].get(index, {}), model["module"][name].float()
        folder = dst / "zero" / name
        folder.mkdir(parents=True)
        torch.save({"param": weight, "cat_dim": 0}, folder / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):  # a parameter that never had a gradient has no moments yet: zeros
            value = state.get(key)
            torch.save({"param": torch.zeros_like(weight) if value is None else value.float(), "cat_dim": 0},
                       folder / f"{key}.pt")
        step = state.get("step", step)
    if step is None:
        raise RuntimeError("the checkpoint's optimizer has taken no step")
    hyper = {k: v for k, v in group.items() if k != "params"}
    torch.save({"dynamic_loss_scale": False, "overflow": False,
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": [dict(hyper, params=[])]}},
               dst / "zero" / "optimizer_state.pt")
    model.update(optimizer=None, param_shapes=[OrderedDict((n, model["module"][n].shape) for n in names)],
                 frozen_param_shapes={}, shared_params={}, frozen_param_fragments={})
    for name in MODEL_STATES:
        torch.save(model, dst / name)


def _zero2_universal_for_zero3(src: Path, dst: Path) -> None:
    """DeepSpeed 0.19.8 converts ZeRO-2 and ZeRO-3 checkpoints to universal folders that differ in two places
    its ZeRO-3 loader reads (the per-parameter fp32/exp_avg/exp_avg_sq files are the same): the common optimizer
    state lacks the torch optimizer's state dict (the step, the param groups), and the model-state file has its
    ZeRO-2 name. Both are filled in from the ZeRO-2 checkpoint."""
    optim = torch.load(src / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    base = optim["optimizer_state_dict"]["base_optimizer_state"]
    common_path = dst / "zero" / "optimizer_state.pt"
    common = torch.load(common_path, map_location="cpu", weights_only=False)
    common["optimizer_state_dict"] = {"state": {0: {"step": base["state"][0]["step"]}},
                                      "param_groups": base["param_groups"]}
    torch.save(common, common_path)
    shutil.copy(dst / "mp_rank_00_model_states.pt", dst / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def finish_reshard(engine, out_dir: Path, rank: int, tag: str) -> None:
    """After every rank has loaded the converted copy of checkpoint `tag`: repair what DeepSpeed's universal loader
    leaves wrong, then delete the copy."""
    # the universal loader restores parameters only: every persistent buffer (moe.balance=bias's router bias)
    # would keep its initial value (buffers.py)
    restore_from_checkpoint(engine.module, ckpt_root(out_dir) / tag)
    # DeepSpeed 0.19.8's ZeRO-3 universal loader sets Adam's `step` from a CPU-loaded file, on the CPU; torch's
    # fused AdamW then refuses the first step on a GPU ("state_steps is on cpu"). Found on two H200s
    # (scripts/bench/check_reshard.sh); a CPU run cannot show it.
    steps_to_param_device(engine.optimizer.optimizer)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt_root(out_dir) / UNIVERSAL, ignore_errors=True)


def steps_to_param_device(optimizer) -> int:
    """Move each parameter's tensor `step` in a torch optimizer's state to that parameter's device."""
    moved = 0
    for param, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != param.device:
            state["step"] = step.to(param.device)
            moved += 1
    return moved
