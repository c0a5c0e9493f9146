"""run_ranks(fn, world_size, *args): run fn(rank, world_size, *args) on `world_size` CPU processes with gloo.

Processes are forked (about 0.1 s instead of 2 s per spawn, which re-imports torch); set
DS_ULYSSES_TEST_START=spawn to fall back to spawn if a test misbehaves under fork. Each rank uses one
thread, a file-store rendezvous (no ports) and a 60 s collective timeout so a mismatched collective
fails instead of hanging. A failing rank's exception fails the test.

Gloo's TCP mesh set-up inside `new_group` failed once in CI ("connectFullMesh failed ... Connection
closed by peer", 1 run in ~280 on a 2-core machine; not reproduced in 40 local repeats). That is the
transport's rendezvous, before any code under test computes anything, so a run that dies with exactly
that message is started again once, with a note on stderr. Every other failure fails the test at once.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def patch_deepspeed_shm_build() -> None:
    """Skip DeepSpeed's CPU shm-comm JIT build (35-75 s, only used for inference all-reduce)."""
    from engine.ds.patches import skip_deepspeed_shm_build
    skip_deepspeed_shm_build()


def _entry(rank, fn, world_size, store, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


_TRANSPORT_SETUP_FLAKE = "Gloo connectFullMesh failed"


# what every training rank imports (DeepSpeed's engine, the HF modeling files of the families the tests build, the
# loss plot): imported once here before the fork, the ranks inherit them instead of each importing the same ~3 s of
# modules again (measured: a world-2 run 12.1 -> 8.8 s, world 4 28.5 -> 22.1 s on 2 cores; with DeepSpeed's Muon,
# superoffload and AutoEP modules and LatentMoE added, 593 modules fewer a rank, and a 5-step world-4 MoE run
# 24.3 -> 19.1 s). Only a speed-up: a module that is not there is skipped, and the ranks import what they need as
# before.
_PREIMPORT = ("deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
              # DeepSpeed's optimizer check imports its Muon optimizer, and that torch._inductor (~2 s a rank)
              "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.superoffload.superoffload_stage3",
              "deepspeed.module_inject.auto_ep_layer", "ds_ulysses_ext.moe.latent_model",
              "engine.run.train", "matplotlib.pyplot", "matplotlib.backends.backend_agg",
              *(f"transformers.models.{f}.modeling_{f}" for f in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                                                  "gpt_oss", "deepseek_v3", "glm4_moe", "glm4_moe_lite",
                                                                  "mistral4", "cohere2_moe", "qwen3_vl", "qwen3_vl_moe")))


@functools.lru_cache(maxsize=None)  # once per test process
def _preimport() -> None:
    import importlib
    import matplotlib
    matplotlib.use("Agg")  # as engine/observe/plot.py sets it, before pyplot picks a backend
    with warnings.catch_warnings():
        # torch.jit's deprecation of script_method, raised while torch._inductor imports: a rank importing it would
        # say it on its own stderr, here pytest would pin it on whichever test forked first
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in _PREIMPORT:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def run_ranks(fn, world_size: int, *args) -> None:
    start = os.environ.get("DS_ULYSSES_TEST_START", "fork")
    if start == "fork" and torch.cuda.is_initialized():
        # a GPU machine where this process already ran CUDA tests: a forked rank that touches CUDA (DeepSpeed's
        # accelerator probe does) dies with "Cannot re-initialize CUDA in forked subprocess"
        start = "spawn"
    if start == "fork":
        _preimport()
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.start_processes(_entry, args=(fn, world_size, os.path.join(tmp, "store"), args),
                                   nprocs=world_size, join=True, start_method=start)
                return
            except mp.ProcessRaisedException as err:
                if attempt == 2 or _TRANSPORT_SETUP_FLAKE not in str(err):
                    raise
                print(f"dist_harness: gloo mesh set-up failed at world {world_size}; starting the "
                      f"ranks again once:\n{err}", file=sys.stderr)
