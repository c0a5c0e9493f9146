"""ulysses_attention at cp = 2 and 4 against full-sequence attention on one process (fp32, rel 1e-5)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import run_ranks
from ds_ulysses_ext import init_topology, ulysses_attention
from ds_ulysses_ext.attention import exchange
from ds_ulysses_ext.errors import UnsupportedError

RTOL = 1e-5  # fp32: the exchange moves data only, so the result differs from the reference by kernel rounding


def _reference(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check_attention(rank, world, hq, hkv, causal):
    topo = init_topology(world)
    g = torch.Generator().manual_seed(0)
    B, S, D = 2, 8 * world, 16
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64).float() for h in (hq, hkv, hkv))
    dout = torch.randn(B, S, hq, D, generator=g)
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(fq, fk, fv, causal)
    ref.backward(dout)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    lq, lk, lv = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
    out = ulysses_attention(lq, lk, lv, group=topo.cp_group, causal=causal, backend="sdpa")
    out.backward(dout[:, sl])
    assert out.shape == (B, s, hq, D)
    assert _rel(out, ref[:, sl]) < RTOL
    for local, full in ((lq, fq), (lk, fk), (lv, fv)):
        assert _rel(local.grad, full.grad[:, sl]) < RTOL, (rank, _rel(local.grad, full.grad[:, sl]))


CASES = [  # (hq, hkv): MHA, GQA with Hkv % cp == 0, GQA with Hkv < cp (replication), MQA
    (8, 8), (8, 4), (8, 2), (8, 1)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("heads", CASES, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_matches_full_attention(world, heads, causal):
    hq, hkv = heads
    if hkv % world and world % hkv:
        pytest.skip("invalid combination, covered by the refusal test")
    run_ranks(_check_attention, world, hq, hkv, causal)


def _check_roundtrip(rank, world):
    topo = init_topology(world)
    x = torch.randn(3, 5, 4 * world, 7, generator=torch.Generator().manual_seed(rank))
    y = exchange.seq_to_head(x, topo.cp_group)
    assert y.shape == (3, 5 * world, 4, 7)
    assert torch.equal(exchange.head_to_seq(y, topo.cp_group), x)
    # seq_to_head really moved data: rank r's heads of every chunk, chunks in rank order
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    full = torch.cat(gathered, dim=1)
    assert torch.equal(y, full[:, :, rank * 4:(rank + 1) * 4])


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_round_trip_is_identity(world):
    run_ranks(_check_roundtrip, world)


def _check_refusal(rank, world):
    topo = init_topology(world)
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 4, 6, 8)
    with pytest.raises(UnsupportedError, match=r"cp=4 does not divide the 6 query heads.*Choose cp in \[1, 2, 3, 6\]"):
        ulysses_attention(q, kv, kv, group=topo.cp_group)
    q = torch.randn(1, 4, 12, 8)
    kv = torch.randn(1, 4, 6, 8)
    with pytest.raises(UnsupportedError, match=r"KV heads: cp must divide the KV heads or be a multiple"):
        ulysses_attention(q, kv, kv, group=topo.cp_group)


def test_head_counts_that_cannot_split_are_refused():
    run_ranks(_check_refusal, 4)


def test_group_of_one_is_the_backend():
    q, k, v = (torch.randn(1, 16, h, 8) for h in (4, 2, 2))
    assert torch.equal(ulysses_attention(q, k, v, group=None, backend="sdpa"), _sdpa_direct(q, k, v))


def _sdpa_direct(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True, enable_gqa=True).transpose(1, 2)
