"""Topology: the one object that knows how ranks are arranged into CP, DP and EP groups.

Context-parallel (CP) groups are runs of `cp_size` consecutive ranks, so a CP group stays inside one
node whenever cp divides the GPUs per node (all-to-all traffic is the heaviest we make). The
data-parallel (DP) group of a rank holds the ranks with the same CP index in the other CP groups.

    world = 8, cp = 4:  CP groups {0,1,2,3} {4,5,6,7};  DP groups {0,4} {1,5} {2,6} {3,7}

Expert-parallel (EP) groups are runs of `ep_size` consecutive ranks folded onto the same world (they do not
change dp = world / cp): each holds every MoE layer's experts once, E / ep per rank. The expert-data-parallel
(EDP) group of a rank holds the ranks with the same EP index, i.e. the replicas of this rank's expert shard,
which sync its gradients.

    world = 8, ep = 4:  EP groups {0,1,2,3} {4,5,6,7};  EDP groups {0,4} {1,5} {2,6} {3,7}

With `ring_size` > 1 a CP group is a Ulysses group of u = cp / ring_size consecutive ranks (all-to-all inside a
node) times a ring of ring_size ranks across those groups (point-to-point, the traffic that tolerates a slower
link). CP rank c is Ulysses rank c % u of ring rank c // u. The CP group itself stays all cp ranks: DeepSpeed's
sequence-parallel group and the gradient reduction do not change.

    cp = 4, ring = 2:  Ulysses groups {0,1} {2,3};  ring groups {0,2} {1,3}

The object is built once after `torch.distributed` is initialised and passed explicitly; nothing is
stored in module globals, so two topologies can coexist in one process (tests do this).

DeepSpeed finds parallel groups through a duck-typed `mpu`. It calls context parallelism
"sequence parallel"; the methods in `_DeepSpeedMpuMethods` are the only place that name appears.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from .errors import UnsupportedError


class _DeepSpeedMpuMethods:
    """The `mpu` protocol DeepSpeed 0.19 reads (`deepspeed/utils/groups.py`, `runtime/engine.py`).

    DeepSpeed treats an mpu that has `initialize_sequence_parallel` as a sequence-parallel mpu: it
    then uses `get_sequence_data_parallel_group()` (all ranks of one replica set, dp x cp) for ZeRO
    partitioning and gradient reduction, and model-parallel size 1. We mirror the methods of
    DeepSpeed's own `parallel_state_sp` module so the engine takes its tested path.
    """

    def initialize_sequence_parallel(self, *args, **kwargs):  # marker only, groups exist already
        raise RuntimeError("Topology groups are built by init_topology(); DeepSpeed must not rebuild them")

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_data_parallel_group(self):
        return self.cp_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.cp_size * self.dp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # DeepSpeed's own SP mpu aliases model parallel to SP; it only reads these for checkpoint names
    # and never as a tensor-parallel degree because of the marker method above.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    # Deliberately NO get_data_parallel_group/world_size/rank: DeepSpeed 0.19's ZeRO-3 converts the
    # model with `Init(data_parallel_group=mpu.get_data_parallel_group())` when that method exists
    # (runtime/zero/parameter_offload.py), which partitions and reduces gradients over the DP group
    # only and silently drops the sum over CP ranks (measured: each rank kept its local gradient).
    # Without it, ZeRO uses the sequence-data-parallel group, i.e. all dp x cp ranks.
    # tests/test_topology.py guards this.


@dataclass
class Topology(_DeepSpeedMpuMethods):
    """Degrees, this rank's coordinates, and the process groups (None when there is no process group)."""

    world_size: int
    rank: int
    cp_size: int
    dp_size: int
    ep_size: int = 1
    cp_group: Optional[object] = field(default=None, repr=False)
    dp_group: Optional[object] = field(default=None, repr=False)
    cp_dp_group: Optional[object] = field(default=None, repr=False)  # all ranks (dp x cp)
    ep_group: Optional[object] = field(default=None, repr=False)
    edp_group: Optional[object] = field(default=None, repr=False)  # same EP index: replicas of one expert shard
    ring_size: int = 1
    ulysses_group: Optional[object] = field(default=None, repr=False)  # u consecutive ranks of the CP group
    ring_group: Optional[object] = field(default=None, repr=False)  # same Ulysses rank across the CP group

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def ulysses_size(self) -> int:
        return self.cp_size // self.ring_size

    @property
    def ulysses_rank(self) -> int:
        return self.cp_rank % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.cp_rank // self.ulysses_size

    def ring_ranks(self) -> list[int]:
        """Global ranks of this rank's ring, in ring order."""
        return ring_group_ranks(self.world_size, self.cp_size, self.ring_size)[
            self.dp_rank * self.ulysses_size + self.ulysses_rank]

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep_size

    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group (consecutive)."""
        return cp_group_ranks(self.world_size, self.cp_size)[self.dp_rank]


def cp_group_ranks(world_size: int, cp_size: int) -> list[list[int]]:
    """CP groups as rank lists: runs of consecutive ranks."""
    return [list(range(start, start + cp_size)) for start in range(0, world_size, cp_size)]


def ulysses_group_ranks(world_size: int, cp_size: int, ring_size: int) -> list[list[int]]:
    """Ulysses groups as rank lists: runs of cp / ring_size consecutive ranks inside each CP group."""
    return cp_group_ranks(world_size, cp_size // ring_size)


def ring_group_ranks(world_size: int, cp_size: int, ring_size: int) -> list[list[int]]:
    """Ring groups as rank lists: inside each CP group, the ranks with the same Ulysses rank, in ring order.

    Ordered by CP group, then Ulysses rank (the index ring_ranks() reads).
    """
    u = cp_size // ring_size
    return [[start + j + r * u for r in range(ring_size)] for start in range(0, world_size, cp_size) for j in range(u)]


def dp_group_ranks(world_size: int, cp_size: int) -> list[list[int]]:
    """DP groups as rank lists: same CP index across CP groups."""
    return [list(range(i, world_size, cp_size)) for i in range(cp_size)]


def ep_group_ranks(world_size: int, ep_size: int) -> list[list[int]]:
    """EP groups as rank lists: runs of consecutive ranks (experts stay node-local when possible)."""
    return [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]


def edp_group_ranks(world_size: int, ep_size: int) -> list[list[int]]:
    """EDP groups as rank lists: same EP index across EP groups (the replicas of one expert shard)."""
    return dp_group_ranks(world_size, ep_size)


def check_degrees(world_size: int, cp_size: int, ep_size: int = 1, ring_size: int = 1) -> None:
    if ring_size < 1 or cp_size % ring_size:
        valid = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
        raise UnsupportedError(
            f"ring={ring_size} does not divide cp={cp_size}; choose the ring in {valid} (parallelism.ring)")
    if cp_size < 1 or world_size % cp_size:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UnsupportedError(
            f"cp={cp_size} does not divide the world size {world_size}; choose cp in {valid} "
            "(parallelism.cp)")
    if ep_size < 1 or world_size % ep_size:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UnsupportedError(
            f"ep={ep_size} does not divide the world size {world_size}; choose ep in {valid} "
            "(parallelism.ep)")


def init_topology(cp_size: int, ep_size: int = 1, ring_size: int = 1) -> Topology:
    """Build the CP/DP(/EP) groups, and with ring_size > 1 the Ulysses and ring groups, from the default group.

    Must be called on every rank (new_group is collective), after `torch.distributed` is initialised.
    Without a process group it returns the single-process topology (cp=dp=1), the reference path.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if cp_size != 1 or ep_size != 1 or ring_size != 1:
            raise UnsupportedError(
                f"cp={cp_size}, ep={ep_size}, ring={ring_size} need torch.distributed to be initialised first "
                "(launch with deepspeed/torchrun and call deepspeed.init_distributed())")
        return Topology(world_size=1, rank=0, cp_size=1, dp_size=1)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_degrees(world_size, cp_size, ep_size, ring_size)

    def mine(rank_lists):
        # new_group must be entered by every rank for every group, in the same order
        found = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                found = group
        return found

    cp_group = mine(cp_group_ranks(world_size, cp_size))
    dp_group = mine(dp_group_ranks(world_size, cp_size))
    ep_group = mine(ep_group_ranks(world_size, ep_size))
    edp_group = mine(edp_group_ranks(world_size, ep_size))
    ulysses_group = ring_group = None
    if ring_size > 1:  # pure Ulysses keeps exactly the groups it always had (new_group is collective: all or none)
        ulysses_group = mine(ulysses_group_ranks(world_size, cp_size, ring_size))
        ring_group = mine(ring_group_ranks(world_size, cp_size, ring_size))
    return Topology(world_size=world_size, rank=rank, cp_size=cp_size, dp_size=world_size // cp_size,
                    ep_size=ep_size, cp_group=cp_group, dp_group=dp_group,
                    cp_dp_group=dist.group.WORLD, ep_group=ep_group, edp_group=edp_group,
                    ring_size=ring_size, ulysses_group=ulysses_group, ring_group=ring_group)
