"""The ring's varlen block calls (ds_ulysses_ext/attention/ring_varlen.py) on CPU: many packed documents as one call per block,
a sliding window as one call per (query run, key run) pair with the kernel's own reach. The kernel is torch's
varlen flash kernel, CUDA-only, so a CPU stand-in of its contract runs here (tests/test_flash_varlen.py's
DenseStandIn, which applies flash's own argument rules); the whole ring at world 2 and 4 against masks.py's exact
torch path in fp64 (test_ring._check_masked, relative 1e-5). The real kernel's runs: tests/test_gpu_paths.py.
"""
import pytest
import torch

import ds_ulysses_ext.attention.ring_varlen as varlen_mod
from dist_harness import run_ranks
from test_ring import _check_masked, blocks_mod


def _check_varlen_documents(rank, world, ring, with_sinks):
    # many packed documents: each block takes ONE varlen call (ring_varlen._VarlenBlock) instead of one call per
    # document part; a CPU stand-in of the varlen kernel's contract (tests/test_flash_varlen.py) runs it here.
    # With sinks the backward's call gets the output lowered by their log-sum-exp gradient
    import ds_ulysses_ext.attention.flash_varlen as flash_varlen
    from test_flash_varlen import DenseStandIn
    calls = {"forward": 0, "backward": 0}

    class Counting(DenseStandIn):
        @staticmethod
        def forward(*a):
            calls["forward"] += 1
            return DenseStandIn.forward(*a)

        @staticmethod
        def backward(*a):
            calls["backward"] += 1
            return DenseStandIn.backward(*a)
    flash_varlen.KERNEL = Counting
    varlen_mod.VARLEN_ON_CPU, varlen_mod.VARLEN_PARTS = True, 0
    _check_masked(rank, world, ring, None, with_sinks)
    # every ring step of every rank: one call forward, one backward (each step's block touches some document)
    assert calls == {"forward": ring, "backward": ring}, calls


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_varlen_ring_blocks_with_documents_match_the_torch_path(world, ring, with_sinks):
    run_ranks(_check_varlen_documents, world, ring, with_sinks)


def test_varlen_plan_segments_the_documents_a_block_touches():
    # rows of the flat query / key axes per document, zero on a side that has none; the rows and keys to blank
    BM = blocks_mod.BlockMask
    doc = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4]])
    q_pos, k_pos = torch.arange(2, 6), torch.arange(0, 2)  # later queries, earlier keys: all visible
    plan = varlen_mod._varlen_plan(BM(True, q_pos, k_pos, doc), 0)
    # queries: row 0 documents 1,1,1,2 | row 1: 3,3,4,4; keys: row 0 0,0 | row 1 3,3
    assert plan.causal is False
    assert plan.cu_q.tolist() == [0, 0, 3, 4, 6, 8] and plan.cu_k.tolist() == [0, 2, 2, 2, 4, 4]
    assert (plan.max_q, plan.max_k) == (3, 2)
    assert plan.empty_q.tolist() == [True, True, True, True, False, False, True, True]
    assert plan.empty_k.tolist() == [True, True, False, False]
    assert varlen_mod._varlen_plan(BM(True, q_pos, k_pos, doc), 1) is None  # one part: the per-part calls
    diagonal = varlen_mod._varlen_plan(BM(True, torch.arange(8), torch.arange(8), doc), 0)
    assert diagonal.causal is True and diagonal.cu_q.tolist() == diagonal.cu_k.tolist() == [0, 2, 5, 8, 12, 16]


def _check_varlen_window(rank, world, ring, window, with_sinks):
    # a window without documents: each block's (query run, key run) pairs that the window connects are one varlen
    # call each, with the kernel's own reach (ring_varlen._WindowBlock), through the CPU stand-in
    import ds_ulysses_ext.attention.flash_varlen as flash_varlen
    from test_flash_varlen import DenseStandIn
    calls = []

    class Counting(DenseStandIn):
        @staticmethod
        def forward(*a):
            calls.append(a[-2:])  # (left, right)
            return DenseStandIn.forward(*a)
    flash_varlen.KERNEL = Counting
    varlen_mod.VARLEN_ON_CPU = True
    _check_masked(rank, world, ring, window, with_sinks, documents=False)
    assert calls and all(left + right == window - 1 and right >= 0 for left, right in calls), calls


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("window,with_sinks", [(3, False), (6, True), (2, False)])
def test_varlen_ring_blocks_with_a_window_match_the_torch_path(world, ring, window, with_sinks):
    run_ranks(_check_varlen_window, world, ring, window, with_sinks)


def test_window_plan_pairs_runs_within_reach():
    # a share of chunks 0 and 3 of 4 (positions 0-3, 12-15) against the keys 4-11 (chunks 1, 2), window 3: only the
    # second run reaches them, its queries 12 and 13 the keys 10 and 11: rows 4:6 against keys 6:8 (left 0, right 2
    # around the bottom-right aligned diagonal: query 12 sees keys 10 and 11, query 13 key 11)

    BM = blocks_mod.BlockMask
    share = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    plan = varlen_mod._window_plan(BM(True, share, torch.arange(4, 12), window=3))
    assert plan.pairs == [(4, 6, 6, 8, 0, 2)]
    diagonal = varlen_mod._window_plan(BM(True, share, share, window=3))
    assert diagonal.pairs == [(0, 4, 0, 4, 2, 0), (4, 8, 4, 8, 2, 0)]  # chunks 3 and 0 are 9 apart: no pair


def test_the_varlen_first_use_check_covers_a_window_longer_than_a_key_run(monkeypatch):
    # the GPU's first-use check must catch what the H200 showed (ring 4, window 1000, chunks of 512: a pair with
    # more queries than keys, whose right reach flash reads as unbounded past max_seqlen_k); through the stand-in,
    # which takes the reaches as flash does, it passes as shipped and fails without _max_k
    import ds_ulysses_ext.attention.flash_varlen as flash_varlen
    from test_flash_varlen import DenseStandIn
    monkeypatch.setattr(flash_varlen, "KERNEL", DenseStandIn)
    cpu = torch.device("cpu")
    assert varlen_mod._check_varlen(cpu, torch.float32, 16) is True
    monkeypatch.setattr(varlen_mod, "_max_k", lambda Lk, left, right: Lk)
    with pytest.raises(RuntimeError, match="disagrees with the exact torch block kernel"):
        varlen_mod._check_varlen(cpu, torch.float32, 16)


def _count_plans(rank, world, ring):
    # the ring keeps each step's mask from the forward for the backward, so a block's varlen plan (its host copies)
    # is built once per step, not once in each direction
    import ds_ulysses_ext.attention.flash_varlen as flash_varlen
    from test_flash_varlen import DenseStandIn
    flash_varlen.KERNEL = DenseStandIn
    varlen_mod.VARLEN_ON_CPU, varlen_mod.VARLEN_PARTS = True, 0
    built, real = [], varlen_mod._varlen_plan
    varlen_mod._varlen_plan = lambda *a: built.append(1) or real(*a)
    _check_masked(rank, world, ring, None, False)
    assert len(built) == ring, built


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 2)])
def test_a_blocks_varlen_plan_is_built_once_for_forward_and_backward(world, ring):
    run_ranks(_count_plans, world, ring)
