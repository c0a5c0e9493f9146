"""Topology: rank grids, groups, and the DeepSpeed mpu surface."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from ds_ulysses_ext import UnsupportedError, init_topology
from ds_ulysses_ext.topology import cp_group_ranks, dp_group_ranks


def test_rank_grids():
    assert cp_group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_group_ranks(8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cp_group_ranks(4, 1) == [[0], [1], [2], [3]]


def _groups(rank, world, cp):
    topo = init_topology(cp)
    assert (topo.cp_size, topo.dp_size) == (cp, world // cp)
    assert topo.cp_rank == rank % cp and topo.dp_rank == rank // cp
    # the CP group really holds consecutive ranks: gather global ranks through it
    mine = torch.tensor([rank])
    got = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(got, mine, group=topo.cp_group)
    assert [int(g) for g in got] == topo.cp_ranks()
    got = [torch.empty_like(mine) for _ in range(topo.dp_size)]
    dist.all_gather(got, mine, group=topo.dp_group)
    assert [int(g) for g in got] == dp_group_ranks(world, cp)[topo.cp_rank]
    # what DeepSpeed reads
    assert topo.get_sequence_parallel_world_size() == cp
    assert topo.get_sequence_parallel_rank() == rank % cp
    assert topo.get_sequence_data_parallel_world_size() == world


@pytest.mark.parametrize("world,cp", [(2, 2), (4, 2), (4, 4), (4, 1)])
def test_groups(world, cp):
    run_ranks(_groups, world, cp)


def _bad_cp(rank, world):
    with pytest.raises(UnsupportedError, match=r"cp=3 does not divide the world size 4; choose cp in \[1, 2, 4\]"):
        init_topology(3)


def test_cp_must_divide_world():
    run_ranks(_bad_cp, 4)


def test_mpu_has_no_data_parallel_getter():
    # DeepSpeed's ZeRO-3 partitions over mpu.get_data_parallel_group() when it exists, which drops the
    # gradient sum over CP ranks (see topology.py); this must never come back.
    from ds_ulysses_ext import Topology
    topo = Topology(world_size=1, rank=0, cp_size=1, dp_size=1)
    assert not hasattr(topo, "get_data_parallel_group")
    assert hasattr(topo, "initialize_sequence_parallel")  # DeepSpeed's marker for an SP mpu
