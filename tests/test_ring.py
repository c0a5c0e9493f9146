"""Ring and hybrid (Ulysses x ring) attention against full attention on one process (fp64 reference, rel 1e-5).

Each rank takes its zigzag share (zigzag.rank_positions) of one full q/k/v; its output and q/k/v gradients must
equal the reference's rows at those positions. The length (13) is padded by the layout (to a multiple of
2 * cp); GQA (4 query heads, 2 or 1 KV heads); a query block of 3 rows so the kernel walks several blocks.
"""
import pytest
import torch
import torch.nn.functional as F

import ds_ulysses_ext.ring as ring_mod
from dist_harness import run_ranks
from ds_ulysses_ext import init_topology
from ds_ulysses_ext.ring import ring_attention
from ds_ulysses_ext.zigzag import padded_seq_len, rank_positions, zigzag_order

RTOL = 1e-5


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(Sp, hkv, real):
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, Sp, h, 8, generator=g) for h in (4, hkv, hkv, 4))
    dout[:, real:] = 0  # pad rows carry no loss, as in training
    return q, k, v, dout


def _reference(q, k, v, dout, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    (out * dout.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _check(rank, world, ring, causal, hkv):
    ring_mod.QUERY_BLOCK = 3
    topo = init_topology(world, ring_size=ring)
    assert topo.ring_size == ring and topo.ulysses_size == world // ring
    S = 13
    Sp = padded_seq_len(S, world, ring)
    assert Sp == 16 and Sp > S
    q, k, v, dout = _inputs(Sp, hkv, S)
    ref = _reference(q, k, v, dout, causal)
    idx = rank_positions(Sp, world, ring, topo.cp_rank)
    local = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, ring_group=topo.ring_group, ulysses_group=topo.ulysses_group, causal=causal)
    (out * dout[:, idx]).sum().backward()
    assert _rel(out, ref[0][:, idx]) < RTOL, _rel(out, ref[0][:, idx])
    for name, mine, full in zip("qkv", local, ref[1:]):
        assert _rel(mine.grad, full[:, idx]) < RTOL, (name, _rel(mine.grad, full[:, idx]))


@pytest.mark.parametrize("world,ring,hkv", [(2, 2, 2), (4, 4, 2), (4, 2, 2), (4, 2, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_matches_full_attention(world, ring, hkv, causal):
    # (4, 2, *): hybrid, Ulysses groups of 2 x a ring of 2; hkv=1 there replicates the KV head over the Ulysses pair
    run_ranks(_check, world, ring, causal, hkv)


def test_zigzag_order_by_hand():
    # 16 tokens, cp=4, ring=2 (u=2): chunks of 4; ring rank 0 holds chunks 0 and 3, ring rank 1 chunks 1 and 2
    order = zigzag_order(16, 4, 2).tolist()
    assert order == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert rank_positions(16, 4, 4, 3).tolist() == [6, 7, 8, 9]  # pure ring: chunks 3 and 4 of 8
    assert rank_positions(16, 4, 1, 1).tolist() == [4, 5, 6, 7]  # Ulysses: contiguous


def test_ring_and_ulysses_groups_by_hand():
    from ds_ulysses_ext.topology import ring_group_ranks, ulysses_group_ranks
    # world 8, cp 4 = u 2 x ring 2: Ulysses pairs of consecutive ranks, rings across them inside each CP group
    assert ulysses_group_ranks(8, 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ring_group_ranks(8, 4, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ring_group_ranks(4, 4, 4) == [[0, 1, 2, 3]]


def _topology_fields(rank, world):
    topo = init_topology(4, ring_size=2)
    assert (topo.ulysses_rank, topo.ring_rank) == (rank % 2, rank // 2)
    assert topo.ring_ranks() == [rank % 2, rank % 2 + 2]
    assert torch.distributed.get_world_size(topo.ring_group) == 2
    assert torch.distributed.get_world_size(topo.ulysses_group) == 2
    # DeepSpeed still sees the whole CP group as its sequence-parallel group
    assert topo.get_sequence_parallel_world_size() == 4 and topo.get_sequence_parallel_rank() == rank
    plain = init_topology(4)
    assert plain.ring_size == 1 and plain.ring_group is None and plain.ulysses_size == 4


def test_topology_ring_fields():
    run_ranks(_topology_fields, 4)


def test_ring_must_divide_cp():
    from ds_ulysses_ext import UnsupportedError
    from ds_ulysses_ext.topology import check_degrees
    with pytest.raises(UnsupportedError, match=r"ring=3 does not divide cp=4.*\[1, 2, 4\].*parallelism.ring"):
        check_degrees(4, 4, 1, 3)
