"""Ring and hybrid (Ulysses x ring) attention against full attention on one process (fp64 reference, rel 1e-5).

Each rank takes its zigzag share (zigzag.rank_positions) of one full q/k/v; its output and q/k/v gradients must
equal the reference's rows at those positions. The length (13) is padded by the layout (to a multiple of
2 * cp); GQA (4 query heads, 2 or 1 KV heads); a query block of 3 rows so the kernel walks several blocks.
"""
import pytest
import torch
import torch.nn.functional as F

import ds_ulysses_ext.attention.ring as ring_mod
import ds_ulysses_ext.attention.ring_blocks as blocks_mod
from cp_check import assert_share_matches_unsplit
from dist_harness import run_ranks
from ds_ulysses_ext import init_topology
from ds_ulysses_ext.attention.ring import ring_attention
from ds_ulysses_ext.attention.zigzag import padded_seq_len, rank_positions, zigzag_order

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
    blocks_mod.QUERY_BLOCK = 3
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


def _force_fused_on_cpu() -> dict:
    """In this rank's process: the ring takes CPU's flash kernel for the blocks it can; counts its calls."""
    calls = {"forward": 0, "backward": 0}

    def count(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return staticmethod(call)

    blocks_mod.FUSED_ON_CPU = True
    flash = blocks_mod._CpuFlash
    flash.forward, flash.backward = count("forward", flash.forward), count("backward", flash.backward)
    return calls


def _check_fused(rank, world, ring, causal, hkv):
    # the fused path (CPU's flash kernel standing in for CUDA's): every block of a plain ring is one whose visibility
    # the kernel's is_causal flag says, so every block runs fused, forward and backward, and stays exact
    calls = _force_fused_on_cpu()
    _check(rank, world, ring, causal, hkv)
    # causal: step 0 is the diagonal, every later step one all-visible half block; not causal: R full blocks
    assert calls == {"forward": ring, "backward": ring}, calls


@pytest.mark.parametrize("world,ring,hkv", [(2, 2, 2), (4, 4, 1), (4, 2, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_kernel_ring_matches_full_attention(world, ring, hkv, causal):
    run_ranks(_check_fused, world, ring, causal, hkv)


def test_fused_flag_names_only_the_blocks_a_kernel_flag_can_say():
    BM = blocks_mod.BlockMask
    pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])  # a zigzag share: chunks 0 and 3 of 4
    assert blocks_mod._fused_flag(BM(True, pos, pos)) is True                       # step 0: the causal diagonal
    assert blocks_mod._fused_flag(BM(True, pos, torch.tensor([0, 1]))) is None      # partly visible: masked kernel
    assert blocks_mod._fused_flag(BM(True, pos[4:], torch.arange(4, 12))) is False  # a later rank's share, seen whole
    assert blocks_mod._fused_flag(BM(True, torch.arange(4, 8), torch.arange(4))) is False
    assert blocks_mod._fused_flag(BM(False, pos, torch.arange(16))) is False
    assert blocks_mod._fused_flag(BM(True, pos, pos, window=4)) is None
    assert blocks_mod._fused_flag(BM(True, pos, pos, doc=torch.zeros(1, 16, dtype=torch.long))) is None


def test_a_fused_kernel_that_disagrees_is_refused_and_one_that_cannot_run_is_left_out(caplog):
    class Wrong(blocks_mod._CpuFlash):
        @staticmethod
        def forward(q, k, v, scale, is_causal):
            out, lse = blocks_mod._CpuFlash.forward(q, k, v, scale, is_causal)
            return out, lse + 0.1

    class Broken(blocks_mod._CpuFlash):
        @staticmethod
        def forward(q, k, v, scale, is_causal):
            raise RuntimeError("no kernel image for this device")

    class Padded(blocks_mod._CpuFlash):  # a log-sum-exp padded past the query rows, as some kernels return it
        @staticmethod
        def forward(q, k, v, scale, is_causal):
            out, lse = blocks_mod._CpuFlash.forward(q, k, v, scale, is_causal)
            return out, F.pad(lse, (0, 64))

    device = torch.device("cpu")
    assert blocks_mod._checked(blocks_mod._CpuFlash, device, torch.float32, 8) is True
    assert blocks_mod._checked(Padded, device, torch.float32, 8) is False
    assert "the fused Padded kernel returns out (1, 2, 192, 8) / lse (1, 2, 256)" in caplog.text
    with pytest.raises(RuntimeError, match=r"fused Wrong kernel disagrees with the exact torch block kernel on cpu .*\(lse: error 1.0"):
        blocks_mod._checked(Wrong, device, torch.float32, 8)
    assert blocks_mod._checked(Broken, device, torch.float32, 8) is False
    assert "the fused Broken kernel cannot run on cpu" in caplog.text


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


# --- the model path: enable_context_parallel + CPCausalLM + shard_batch against the unsplit HF model -------

def _model_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9] = -100
    return ids, labels


def _model_reference(family, overrides):
    from tiny_models import tiny_model
    model = tiny_model(family, **overrides)
    ids, labels = _model_batch()
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_check(rank, world, family, ring, overrides):
    from ds_ulysses_ext import CPCausalLM, enable_context_parallel, shard_batch
    from tiny_models import tiny_model
    blocks_mod.QUERY_BLOCK = 5
    ref_loss, ref_grads = _model_reference(family, overrides)
    topo = init_topology(world, ring_size=ring)
    model = enable_context_parallel(tiny_model(family, **overrides), topo, backend="sdpa")
    lm = CPCausalLM(model, loss_chunk_size=3)
    ids, labels = _model_batch()
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)
    loss_sum, count = lm(**local)
    assert_share_matches_unsplit(model, loss_sum, count, topo, ref_loss, ref_grads, (family, ring))


@pytest.mark.parametrize("family,world,ring", [("llama", 2, 2), ("llama", 4, 4), ("llama", 4, 2),
                                               ("qwen3", 4, 2),  # (4, 2): hybrid 2 x 2
                                               # families the ring is open to with no ring test of their own before
                                               # (qwen2's q/k/v biases; qwen3_moe's experts, HF's own block here)
                                               ("qwen2", 2, 2), ("qwen3_moe", 4, 2)])
def test_ring_model_matches_unsplit(family, world, ring):
    run_ranks(_model_check, world, family, ring, {})


def _two_heads(rank, world):
    from ds_ulysses_ext import UnsupportedError, enable_context_parallel
    from ds_ulysses_ext.attention.zigzag import auto_ring_size
    from tiny_models import tiny_model
    with pytest.raises(UnsupportedError, match="cp=4 does not divide the 2 query heads"):
        enable_context_parallel(tiny_model("llama", num_attention_heads=2, num_key_value_heads=1), init_topology(4))
    assert auto_ring_size(2, 1, 4)[0] == 2


def test_heads_cp_cannot_split_train_with_auto_ring():
    # 2 query heads, 1 KV head at cp=4: Ulysses alone refuses; the auto ring (2: u=2 x ring 2) is exact
    run_ranks(_two_heads, 4)
    run_ranks(_model_check, 4, "llama", 2, dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16))


def test_auto_ring_size_by_hand():
    from ds_ulysses_ext.attention.zigzag import auto_ring_size, valid_ring_sizes
    assert auto_ring_size(8, 2, 4)[0] == 1          # Ulysses splits 8 / 2 heads over 4
    assert auto_ring_size(2, 1, 4)[0] == 2          # u = 2 splits them
    assert auto_ring_size(3, 3, 4)[0] == 4          # only u = 1: pure ring
    assert auto_ring_size(4, 4, 8)[0] == 2
    assert valid_ring_sizes(2, 1, 4) == [2, 4]


def test_zigzag_shard_batch_by_hand():
    from ds_ulysses_ext import Topology, shard_batch
    # 6 tokens at cp=2, ring=2: padded to 8 (a multiple of 2 * cp), chunks of 2: rank 0 holds [0, 3], rank 1 [1, 2]
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[-100, 21, 22, -100, 24, 25]])
    shards = [shard_batch({"input_ids": ids, "labels": labels}, Topology(2, r, 2, 1, ring_size=2), pad_token_id=0)
              for r in (0, 1)]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert shards[1]["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 0, 0]]
    assert shards[1]["input_ids"].tolist() == [[12, 13, 14, 15]]
    # shifted on the full sequence: position i predicts label i+1; the last real token and the pads predict nothing
    assert shards[0]["labels"].tolist() == [[21, 22, -100, -100]]
    assert shards[1]["labels"].tolist() == [[-100, 24, 25, -100]]


def test_ring_refusals():
    from ds_ulysses_ext import UnsupportedError
    with pytest.raises(UnsupportedError, match="backend 'fa4' is not available inside ring attention"):
        ring_attention(*(torch.zeros(1, 4, 2, 8) for _ in range(3)), ring_group=None, backend="fa4")


def _wrong_layout(rank, world):
    from ds_ulysses_ext import CPCausalLM, Topology, UnsupportedError, enable_context_parallel, shard_batch
    from tiny_models import tiny_model
    topo = init_topology(2, ring_size=2)
    lm = CPCausalLM(enable_context_parallel(tiny_model("llama"), topo, backend="sdpa"))
    ids, labels = _model_batch()
    contiguous = shard_batch({"input_ids": ids, "labels": labels}, Topology(2, rank, 2, 1))  # Ulysses' layout
    with pytest.raises(UnsupportedError, match=r"zigzag positions \(ring=2\)"):
        lm(**contiguous)
    zigzag = shard_batch({"input_ids": ids, "labels": labels}, topo)
    mask = torch.ones_like(zigzag["input_ids"])
    mask[:, -1] = 0  # rank 0's last token is a pad of the padded row: trailing in sequence order, not in rank order
    with pytest.raises(UnsupportedError, match=r"2D attention_mask with pads is not accepted under ring attention"):
        lm(**zigzag, attention_mask=mask)


def test_ring_model_refuses_a_contiguous_shard_and_a_padded_mask():
    run_ranks(_wrong_layout, 2)


# --- packed documents and sliding windows under the ring -----------------------------------------------------

def _masked_reference(q, k, v, dout, cu, window, sinks):
    from ds_ulysses_ext.attention.masks import masked_attention
    q, k, v, sinks = (t.double().requires_grad_() for t in (q, k, v, sinks))
    out = masked_attention(q, k, v, causal=True, cu_seqlens=cu, window=window, sinks=sinks)
    (out * dout.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def _check_masked(rank, world, ring, window, with_sinks, documents=True):
    from ds_ulysses_ext.attention.masks import cu_seqlens_of
    blocks_mod.QUERY_BLOCK = 3
    topo = init_topology(world, ring_size=ring)
    Sp = 16
    q, k, v, dout = _inputs(Sp, 2, Sp)
    # row 0: documents of 5, 8 and 3 tokens (the 8 crosses zigzag chunks); row 1: one document
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(8), torch.arange(3)]), torch.arange(16)])
    cu = cu_seqlens_of(pos) if documents else None
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9)) * 2
    ref = _masked_reference(q, k, v, dout, cu, window, sinks if with_sinks else torch.full((4,), -torch.inf))
    idx = rank_positions(Sp, world, ring, topo.cp_rank)
    local = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_() if with_sinks else None
    out = ring_attention(*local, ring_group=topo.ring_group, ulysses_group=topo.ulysses_group, cu_seqlens=cu,
                         window=window, sinks=my_sinks)
    (out * dout[:, idx]).sum().backward()
    assert _rel(out, ref[0][:, idx]) < RTOL, _rel(out, ref[0][:, idx])
    for name, mine, full in zip("qkv", local, ref[1:4]):
        assert _rel(mine.grad, full[:, idx]) < RTOL, (name, _rel(mine.grad, full[:, idx]))
    if with_sinks:  # each rank's share of the sinks' gradient (its rows, its heads); the CP sum is the whole
        import torch.distributed as dist
        dist.all_reduce(my_sinks.grad)
        assert _rel(my_sinks.grad, ref[4]) < RTOL, _rel(my_sinks.grad, ref[4])


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (3, False), (3, True)])
def test_ring_documents_window_sinks_match_the_torch_path(world, ring, window, with_sinks):
    # window 3: many blocks hold rows that see none of their keys (their partial lse is -inf)
    run_ranks(_check_masked, world, ring, window, with_sinks)


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 2)])
def test_packed_rows_under_the_ring_match_each_document_alone(world, ring):
    from test_packing import _check_packed
    run_ranks(_check_packed, world, "llama", {}, ring)


def test_packed_rows_with_a_window_under_the_hybrid():
    from test_packing import _check_packed
    run_ranks(_check_packed, 4, "qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}, 2)


def _windowed_model_check(rank, world, family, ring):
    from cp_reference import cp_loss_and_grads, rel
    from ds_ulysses_ext import enable_context_parallel
    from test_sliding_sinks import WINDOWED, _batch, _reference, build
    ref_loss, ref_grads = _reference(family, WINDOWED[family])
    topo = init_topology(world, ring_size=ring)
    model = enable_context_parallel(build(family, **WINDOWED[family]), topo, backend="sdpa")
    loss, grads = cp_loss_and_grads(model, topo, _batch())
    assert rel(loss, ref_loss) < RTOL, (loss, ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < RTOL, (name, rel(g, ref_grads[name]))
    assert any("sinks" in n for n in grads) == (family == "gpt_oss")


# gpt_oss: a sliding and a full layer, learned sinks (against its eager HF reference)
@pytest.mark.parametrize("family,world,ring", [("qwen3", 4, 4), ("mistral", 4, 2), ("gpt_oss", 4, 2),
                                               ("gpt_oss", 2, 2)])
def test_window_and_sink_models_under_the_ring_match_unsplit(family, world, ring):
    run_ranks(_windowed_model_check, world, family, ring)


@pytest.mark.parametrize("window", [3, 8, 20])
def test_the_torch_kernel_reads_only_the_keys_a_window_reaches(window, monkeypatch):
    # rank 1's own block (step 0) of a 4-rank zigzag ring over 64 tokens: its share is chunks 1 and 6 (positions
    # 8..15 and 48..55), query blocks of 4 rows. Each block must read only the keys its window reaches, never across
    # the gap between the chunks, and give the dense fp64 answer (out, lse, dq, dk, dv) on the full block.
    monkeypatch.setattr(blocks_mod, "QUERY_BLOCK", 4)
    pos = ring_mod.share_positions(torch.arange(64), 4, 1)
    mask = blocks_mod.BlockMask(True, pos, pos, None, window)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(2))  # fp32, the kernel's precision
    k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(2))
    widths, real = [], blocks_mod._logits
    monkeypatch.setattr(blocks_mod, "_logits", lambda qb, kb, *a: widths.append(kb.shape[2]) or real(qb, kb, *a))
    out, lse = blocks_mod._torch_block_forward(q, blocks_mod._expand(k, 4), blocks_mod._expand(v, 4), 8 ** -0.5, mask)
    delta = (dout * out).sum(-1)
    dq, dk, dv = blocks_mod._torch_block_backward(q, k, v, dout, lse, delta, 8 ** -0.5, mask)
    assert widths and max(widths) <= min(16, window + 3), widths  # a block of 4 rows reaches window + 3 keys
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))  # the reference in fp64
    ke, ve = (t.repeat_interleave(2, dim=1) for t in (kr, vr))
    logits = (qr @ ke.transpose(-1, -2)) * 8 ** -0.5
    logits = logits.masked_fill(~((pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window)), float("-inf"))
    ref = logits.softmax(-1) @ ve
    ref.backward(dout.double())
    for name, got, want in (("out", out, ref), ("lse", lse, logits.logsumexp(-1)), ("dq", dq, qr.grad),
                            ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_window_narrowing_refuses_keys_out_of_order():
    # _query_blocks finds each block's keys by binary search over k_pos: keys out of order would drop visible keys
    # silently (the masked kernel itself takes any order). Every caller in ring.py passes increasing positions
    pos = ring_mod.share_positions(torch.arange(32), 2, 0)  # 0..7 and 24..31
    keys = pos[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with pytest.raises(ValueError, match="key positions .* increase"):
        blocks_mod._torch_block_forward(q, k, v, 8 ** -0.5, blocks_mod.BlockMask(True, pos, keys, None, 4))
    blocks_mod._torch_block_forward(q, k, v, 8 ** -0.5, blocks_mod.BlockMask(True, pos, keys, None, None))  # no window


def _count_skipped_blocks(rank, world, window, expected):
    # ring 4 over 32 tokens: 8 zigzag chunks of 4; rank r holds chunks r and 7 - r. With a window of at most a chunk,
    # a query sees keys of its own chunk and the one before only, so every step whose share holds neither is skipped;
    # the outputs and all gradients still equal the fp64 torch path
    from ds_ulysses_ext.attention.masks import masked_attention
    blocks_mod.QUERY_BLOCK = 3
    calls = {"forward": 0, "backward": 0}
    forward, backward = blocks_mod.block_forward, blocks_mod.block_backward

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    blocks_mod.block_forward, blocks_mod.block_backward = counted("forward", forward), counted("backward", backward)
    topo = init_topology(world, ring_size=world)
    Sp = 32
    q, k, v, dout = _inputs(Sp, 2, Sp)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = masked_attention(*ref, causal=True, window=window)  # fp64, the torch path the test above trusts
    (ref_out * dout.double()).sum().backward()
    idx = rank_positions(Sp, world, world, topo.cp_rank)
    local = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, ring_group=topo.ring_group, causal=True, window=window)
    (out * dout[:, idx]).sum().backward()
    assert _rel(out, ref_out.detach()[:, idx]) < RTOL, _rel(out, ref_out.detach()[:, idx])
    for name, mine, full in zip("qkv", local, ref):
        assert _rel(mine.grad, full.grad[:, idx]) < RTOL, (name, _rel(mine.grad, full.grad[:, idx]))
    assert calls == {"forward": expected[rank], "backward": expected[rank]}, (rank, calls)


@pytest.mark.parametrize("window,expected", [
    (None, [4, 4, 4, 4]),  # no window: every step computes (the causal halves are already cut by _step_slices)
    (2, [2, 3, 3, 2]),     # rank 0 needs chunk 6 (step 3), rank 1 chunks 0 and 5, rank 2 chunks 1 and 4, rank 3 chunk 2
    (6, [3, 4, 4, 3]),     # a chunk's first two queries reach two chunks back: rank 0 needs 5 too, rank 3 chunk 1
])
def test_ring_skips_the_blocks_a_window_hides(window, expected):
    run_ranks(_count_skipped_blocks, 4, window, expected)


def _check_fused_sinks(rank, world, ring):
    # sinks without documents or a window (GPT-OSS's full layers): every block runs fused, forward and backward;
    # the fused kernel derives the softmax row term from the output it is handed, so the backward hands it one
    # lowered by the sinks' log-sum-exp gradient (ring._lowered), or that gradient would be dropped
    import torch.distributed as dist
    calls = _force_fused_on_cpu()
    topo = init_topology(world, ring_size=ring)
    q, k, v, dout = _inputs(16, 2, 16)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9)) * 2
    ref = _masked_reference(q, k, v, dout, None, None, sinks)
    idx = rank_positions(16, world, ring, topo.cp_rank)
    local = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_()
    out = ring_attention(*local, ring_group=topo.ring_group, ulysses_group=topo.ulysses_group, sinks=my_sinks)
    (out * dout[:, idx]).sum().backward()
    assert _rel(out, ref[0][:, idx]) < RTOL
    for name, mine, full in zip("qkv", local, ref[1:4]):
        assert _rel(mine.grad, full[:, idx]) < RTOL, (name, _rel(mine.grad, full[:, idx]))
    dist.all_reduce(my_sinks.grad)
    assert _rel(my_sinks.grad, ref[4]) < RTOL
    assert calls == {"forward": ring, "backward": ring}, calls


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 2)])
def test_fused_ring_with_sinks_keeps_the_exact_backward(world, ring):
    run_ranks(_check_fused_sinks, world, ring)


def _check_fused_documents(rank, world, ring):
    # packed documents cut the blocks: the fused path makes one call per (batch row, document) part of a block
    calls = _force_fused_on_cpu()
    _check_masked(rank, world, ring, None, False)
    # the same parts forward and backward; at least one per ring step and batch row that sees keys
    assert calls["forward"] >= ring and calls["backward"] == calls["forward"], calls


@pytest.mark.parametrize("world,ring", [(2, 2), (4, 4), (4, 2)])
def test_fused_ring_with_documents_matches_the_torch_path(world, ring):
    run_ranks(_check_fused_documents, world, ring)
