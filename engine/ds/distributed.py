"""Process start-up: ranks from the environment, the device, and the process group.

Works under `deepspeed --no_local_rank`, plain `deepspeed` (scripts/train.py drops the stray
--local_rank=N), `torchrun`, and a plain `python` (world 1). NCCL on GPUs, gloo on CPUs; gloo on GPUs where
dist_backend=gloo asks for it, and then the ranks of a host may share fewer GPUs (configs/train.py).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch

from configs.errors import require
from configs.device import runs_on_cuda
from ds_ulysses_ext.topology import cp_group_ranks


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str = "gloo"  # the default process group's: nccl | gloo
    shares_gpu: bool = False  # more ranks on this host than GPUs: rank i on GPU i mod count (gloo only)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_runtime(device_pref: str = "auto", backend: str = "auto") -> Runtime:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = runs_on_cuda(device_pref)
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but no CUDA device is visible; use device=cpu or auto")
    if not use_cuda:
        return Runtime(rank=rank, local_rank=local_rank, world_size=world, device=torch.device("cpu"))
    backend = "nccl" if backend == "auto" else backend
    count, local_world = torch.cuda.device_count(), _local_world()
    shares = local_rank >= count or local_world > count
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") only after the model is built; every rank says
    # it here, before anything is loaded
    require(not shares or backend == "gloo",
            f"{local_world} ranks on this host and {count} GPU(s) visible: launch at most {count} rank(s) per "
            "host, or set dist_backend=gloo to let ranks share a GPU (slow: for checking a layout's numbers, not "
            "for speed)")
    return Runtime(rank=rank, local_rank=local_rank, world_size=world, device=torch.device("cuda", local_rank % count),
                   backend=backend, shares_gpu=shares)


def check_gloo_on_cuda(rt: Runtime, memory_auto: bool) -> None:
    """gloo on CUDA: refuse memory=auto where ranks share a GPU (it sizes each rank's preset for a GPU of its own);
    say once that the run is slow by design."""
    if rt.device.type != "cuda" or rt.backend != "gloo":
        return
    require(not (memory_auto and rt.shares_gpu), "memory=auto sizes each rank's preset for a GPU of its own, and these "
            "ranks share one (dist_backend=gloo with more ranks than GPUs); pick a preset: memory=none, "
            "memory=full_recompute, ...")
    if rt.is_main:
        logging.getLogger(__name__).warning(
            "dist_backend=gloo on CUDA%s: every collective is staged through host memory; the numbers are the layout's, "
            "the speed is not", ", ranks sharing GPU(s)" if rt.shares_gpu else "")


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))


def init_distributed(rt: Runtime) -> None:
    """Create the default process group (also for world 1: DeepSpeed wants one)."""
    if rt.device.type == "cpu":
        # DeepSpeed picks its accelerator at import; make CPU explicit (and silence its warning)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # its CPU accelerator's device_count() runs `numactl --hardware` in a subprocess on every call unless
        # LOCAL_SIZE is set, and ZeRO-3 calls it on every gradient reduce-scatter: 560 forks in four steps of a
        # tiny model at world 4. DeepSpeed's own launcher sets LOCAL_SIZE to the local ranks; do as it does
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    else:
        torch.cuda.set_device(rt.device)
        if rt.shares_gpu:
            # DeepSpeed places the engine and ZeRO-3's partitions on cuda:$LOCAL_RANK (runtime/engine.py,
            # zero/partition_parameters.py); a rank that shares a GPU names the shared one
            os.environ["LOCAL_RANK"] = str(rt.device.index)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rt.rank))
    os.environ.setdefault("WORLD_SIZE", str(rt.world_size))
    os.environ.setdefault("LOCAL_RANK", str(rt.local_rank))
    import deepspeed
    from .patches import clip_inside_fused_adam, one_pass_zero2_grad_norm, skip_deepspeed_shm_build
    skip_deepspeed_shm_build()
    one_pass_zero2_grad_norm()
    clip_inside_fused_adam()
    if not torch.distributed.is_initialized():
        if rt.device.type == "cuda" and rt.backend == "gloo":
            # DeepSpeed binds the default group to cuda:LOCAL_RANK (device_id) on CUDA, and torch then builds every
            # later group by splitting the bound one, which only NCCL can ("ProcessGroupGloo has no
            # perform_nocolor_split"): an unbound gloo group first, which deepspeed.init_distributed adopts
            torch.distributed.init_process_group("gloo")
        deepspeed.init_distributed(dist_backend=rt.backend)


def shutdown_distributed() -> None:
    """Destroy the process groups at the end of a run that ended normally on this rank (torch's documented
    teardown; the groups DeepSpeed still references live on: scripts end through exit_after_success, which calls
    this). Only after success: a rank that raised must not wait in a collective teardown for ranks that may never
    reach it."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears its side of a group down while another still works on it
        torch.distributed.destroy_process_group()


def exit_after_success() -> None:
    """End a process whose run ended normally: shutdown_distributed, then no interpreter finalisation.

    destroy_process_group drops torch's registry only: a gloo group's threads live as long as any reference to it,
    and after a run some stay referenced where the garbage collector does not reach them (at world 2 with cp=2,
    5 groups and their 15 threads were alive after shutdown_distributed, held through the DeepSpeed engine, with no
    module-level root; `engine.destroy()` and deepspeed.comm's teardown did not free them). Finalisation then
    destroys them while it takes the interpreter apart, and a worker thread that needs the GIL then aborts the
    process (SIGABRT, "terminate called without an active exception"): a failed run to the launcher, after every
    output was written. Seen in tests/test_engine.py's torchrun smoke test, and in CI on 2026-12-06 in
    tests/test_passkey.py's eval_retrieval at world 2. Every file a run writes is closed before this point
    (metrics and W&B in the training loop's `finally`, checkpoints, exports, plots); logging's handlers and the
    standard streams are flushed here."""
    import sys
    shutdown_distributed()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cp_group_node_spans(world_size: int, cp: int) -> list[int]:
    """How many hosts each CP group spans. Collective: every rank contributes its hostname."""
    hosts = [None] * world_size
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    return [len({hosts[r] for r in ranks}) for ranks in cp_group_ranks(world_size, cp)]


def cp_placement_warning(spans: list[int], cp: int) -> str | None:
    """A CP group over several nodes runs every attention layer's all-to-alls over the inter-node network,
    several times slower than NVLink; it works, so it is a warning, but nothing else would say it."""
    crossing = sum(span > 1 for span in spans)
    if not crossing:
        return None
    return (f"{crossing} of {len(spans)} CP groups (parallelism.cp={cp}, runs of consecutive ranks) span more "
            f"than one node (up to {max(spans)}): each attention layer's Ulysses all-to-alls then cross the "
            "inter-node network. Keep cp within a node (a divisor of the GPUs per node) and let dp span the nodes, "
            "unless one sequence needs more GPU memory than a node has")
