"""What a script does between its typed config and the process group: the same for training and for scoring.

scripts/train.py and scripts/eval_retrieval.py both build a model from a TrainConfig. Each kept its own copy of
these steps, and the copies drifted: the scorer never applied memory=auto (it built with the policy fields' defaults
and said nothing) nor the allocator setting. One function, so that a setting means the same in both.
"""
from __future__ import annotations

import logging
import os

from configs import Plan, TrainConfig, validate
from engine.ds.distributed import Runtime, check_gloo_on_cuda


def _drop_enum_constant_deprecation(record: logging.LogRecord) -> bool:
    return "register_constant() on Enum subclasses is deprecated" not in record.getMessage()


def prepare(cfg: TrainConfig, rt: Runtime) -> tuple[TrainConfig, Plan]:
    """Validate, set up logging and the CUDA allocator, resolve memory=auto; before init_distributed and any model.
    Returns the config the run uses (memory=auto's choice filled in) and its plan."""
    plan = validate(cfg, rt.world_size)  # every cross-field check, before any model is loaded
    logging.basicConfig(level=logging.INFO if rt.is_main else logging.WARNING,
                        format=f"[rank{rt.rank}] %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    check_gloo_on_cuda(rt, cfg.memory.auto)
    if cfg.precision != "fp8":
        # transformers imports torchao wherever it is installed (its quantizer registry), and torchao's import warns
        # about its CUDA-only extensions ("Failed to load ... _C_mxfp8" on CPU): noise to a run that does not use it
        logging.getLogger("torchao").setLevel(logging.ERROR)
    # the pinned torchao registers its Enums as pytree constants when imported (by transformers, wherever torchao is
    # installed), and torch 2.13 logs a deprecation for each, on every rank: nothing the user can act on, and the
    # first lines the README's demo printed. Only that message is dropped.
    logging.getLogger("torch.utils._pytree").addFilter(_drop_enum_constant_deprecation)
    if rt.device.type == "cuda" and cfg.memory.expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first allocation
    if cfg.memory.auto:  # before anything is built: predict every preset, run the fastest that fits (or refuse)
        from engine.observe.host_memory import local_ranks
        from engine.run.auto_memory import apply_auto_memory
        cfg = apply_auto_memory(cfg, rt.world_size, rt.device, local_ranks(), rt.is_main)
        plan = validate(cfg, rt.world_size)
    return cfg, plan
