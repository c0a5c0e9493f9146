"""Packed rows (position_ids restarting at 0 per document) under CP against two references (fp32, rel 1e-5).

References, both stock HF on one process: (1) the unsplit packed row (HF builds its own block-diagonal
mask from the restarting position_ids), and (2) every document run on its own, the independent one: the
objective is the sum of the documents' token cross-entropies over their counted targets. The rows hold
documents whose lengths cp does not divide, one cut by a chunk boundary at every cp, masked spans, and a
batch of two rows with different document layouts.
"""
import pytest
import torch
import torch.nn.functional as F

from cp_reference import cp_loss_and_grads, grads_of, rel
from dist_harness import run_ranks
from ds_ulysses_ext import Topology, enable_context_parallel, init_topology, shard_batch
from ds_ulysses_ext.attention.masks import cu_seqlens_of
from tiny_models import tiny_model

RTOL = 1e-5
DOCS = [[5, 4, 4], [3, 7, 3]]  # two rows of 13 tokens: 13 is a multiple of neither 2 nor 4


def packed_batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, 13), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100     # a masked span opening the first document
    labels[1, 4:6] = -100    # and one inside the second row's long document
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in DOCS])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _ce_sum(logits, labels):
    # token cross-entropy sum of ONE document: its own shift, nothing crosses its end
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"), int((labels[1:] != -100).sum())


def reference_per_document(family, **overrides):
    model = tiny_model(family, **overrides)
    b = packed_batch()
    total, count = 0.0, 0
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            ids, labels = b["input_ids"][row, start:start + n], b["labels"][row, start:start + n]
            s, c = _ce_sum(model(input_ids=ids[None]).logits[0], labels)
            total, count, start = total + s, count + c, start + n
    loss = total / count
    loss.backward()
    return loss.detach(), grads_of(model)


def reference_packed_row(family, **overrides):
    model = tiny_model(family, **overrides)
    b = packed_batch()
    # use_cache=False: with a cache HF skips its packed-sequence mask (masking_utils)
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    total, count = 0.0, 0
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            s, c = _ce_sum(logits[row, start:start + n], b["labels"][row, start:start + n])
            total, count, start = total + s, count + c, start + n
    loss = total / count
    loss.backward()
    return loss.detach(), grads_of(model)


def _check_packed(rank, world, family, overrides, ring=1):
    # ring > 1: the CP group is Ulysses groups of world / ring ranks times a ring (tests/test_ring.py)
    refs = [reference_per_document(family, **overrides), reference_packed_row(family, **overrides)]
    topo = init_topology(world, ring_size=ring)
    model = enable_context_parallel(tiny_model(family, **overrides), topo, backend="sdpa")
    loss, grads = cp_loss_and_grads(model, topo, packed_batch())
    for what, (ref_loss, ref_grads) in zip(("per document", "packed row"), refs):
        assert rel(loss, ref_loss) < RTOL, (what, loss, ref_loss)
        for name, g in grads.items():
            assert rel(g, ref_grads[name]) < RTOL, (what, name, rel(g, ref_grads[name]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_rows_match_each_document_alone(world, family):
    run_ranks(_check_packed, world, family, {})


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_rows_single_rank(family):
    _check_packed(0, 1, family, {})


def test_packed_rows_with_a_sliding_window():
    # window 3 is shorter than the 7-token document: window and document boundaries both bound a query's keys
    run_ranks(_check_packed, 2, "qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1})


def test_labels_never_cross_a_document_boundary():
    ids = torch.arange(10, 18)[None]                   # documents [10 11 12] [13 14] [15 16 17]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    shards = [shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos}, Topology(2, r, 2, 1)) for r in (0, 1)]
    assert torch.cat([s["labels"] for s in shards], 1).tolist() == [[11, 12, -100, 14, -100, 16, 17, -100]]
    assert torch.cat([s["position_ids"] for s in shards], 1).tolist() == pos.tolist()
    for s in shards:  # the global boundaries, on every rank
        assert s["cp_cu_seqlens"].tolist() == [0, 3, 5, 8]


def test_boundaries_span_rows_and_padding():
    # two rows of 5 padded to 6 at cp=2: pads continue the last document; each row starts one
    pos = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])
    out = shard_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "position_ids": pos}, Topology(2, 1, 2, 1))
    assert out["cp_cu_seqlens"].tolist() == [0, 2, 6, 12]
    assert out["position_ids"].tolist() == [[1, 2, 3], [3, 4, 5]]
    assert out["cp_rope_length"].tolist() == [5]  # max(position_ids) + 1 before the pad (rope.py)
    assert cu_seqlens_of(torch.arange(4)[None].expand(2, 4)).tolist() == [0, 4, 8]


def test_one_document_per_row_adds_no_boundaries():
    out = shard_batch({"input_ids": torch.ones(2, 6, dtype=torch.long), "position_ids": torch.arange(6)[None]},
                      Topology(2, 0, 2, 1))
    assert "cp_cu_seqlens" not in out and set(out) == {"input_ids", "labels", "position_ids", "cp_rope_length"}


@pytest.mark.parametrize("causal,block,bucket,calls", [
    # block 4: the 4-, 5- and 7-token documents get a call each; causal, the two 3-token ones share one padded to 4
    (True, 4, 128, [4, 4, 4, 5, 7]),
    # block 6, buckets of 2: the 7 alone; the 5 padded to 6; the 4, 4, 3, 3 padded to 4, in one batched call
    (True, 6, 2, [4, 6, 7]),
    # not causal: the short ones take the masked block walk (pads would be seen)
    (False, 4, 128, [4, 4, 5, 7]),
])
def test_long_documents_take_their_own_unmasked_call_and_stay_exact(causal, block, bucket, calls, monkeypatch):
    from ds_ulysses_ext.attention import masks
    monkeypatch.setattr(masks, "DOC_BUCKET", bucket)
    q, k, v = _attention_inputs(3)
    pos = packed_batch()["position_ids"]
    cu = cu_seqlens_of(pos)
    unmasked = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(masks.F, "scaled_dot_product_attention",
                        lambda *a, **kw: (unmasked.append(a[0].shape[2]) if kw.get("attn_mask") is None else None)
                        or real_sdpa(*a, **kw))
    out = masks.masked_attention(q, k, v, causal=causal, cu_seqlens=cu, block=block)
    assert sorted(unmasked) == calls
    _check_documents_one_by_one(out, q, k, v, DOCS, causal)


def _attention_inputs(seed):
    # [2 13 h 8] fp64 q (4 heads), k, v (2 KV heads)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 13, h, 8, dtype=torch.float64, generator=g).requires_grad_() for h in (4, 2, 2)]


def _check_documents_one_by_one(out, q, k, v, docs, causal):
    # the reference is every document's attention written out on its own; output and gradients at rel 1e-12
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = torch.zeros_like(out)
    for row, lengths in enumerate(docs):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            qd, kd, vd = q[row, sl].transpose(0, 1), k[row, sl].transpose(0, 1), v[row, sl].transpose(0, 1)
            kd, vd = kd.repeat_interleave(2, 0), vd.repeat_interleave(2, 0)  # 4 query heads over 2 KV heads
            logits = qd @ kd.transpose(-1, -2) * 8 ** -0.5
            if causal:
                logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            ref[row, sl] = (logits.softmax(-1) @ vd).transpose(0, 1)
            start += n
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    assert rel(out, ref) < 1e-12
    for got, want in zip(grads, ref_grads):
        assert rel(got, want) < 1e-12


def _positions(docs):
    return torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in docs])


@pytest.mark.parametrize("causal", [True, False])
def test_the_document_plan_is_built_once_per_batch_and_never_reused_for_other_documents(causal, monkeypatch):
    # every layer of a step (and its recompute) gets the same cu_seqlens object, so the plan (host copy of the
    # boundaries, index tensors) is built for the first layer only; a new batch's tensor gets a fresh one, and
    # a plan must never answer for other boundaries, whether in a new tensor or written into the same one
    from ds_ulysses_ext.attention import masks
    builds = []
    real_plan = masks._document_plan
    monkeypatch.setattr(masks, "_document_plan", lambda *a: builds.append(a[0].tolist()) or real_plan(*a))
    monkeypatch.setattr(masks, "DOC_BUCKET", 2)  # block 6: long documents, and causal, buckets of several sizes
    q, k, v = _attention_inputs(4)
    cu = cu_seqlens_of(packed_batch()["position_ids"])
    for layer in range(3):
        out = masks.masked_attention(q, k, v, causal=causal, cu_seqlens=cu, block=6)
        _check_documents_one_by_one(out, q, k, v, DOCS, causal)
    assert builds == [cu.tolist()]
    masks.masked_attention(q, k, v, causal=causal, cu_seqlens=cu.clone(), block=6)  # the next step: equal, new
    assert builds == [cu.tolist()] * 2
    other = [[2, 9, 2], [6, 1, 6]]  # the same number of documents, other boundaries
    fresh = cu_seqlens_of(_positions(other))
    _check_documents_one_by_one(masks.masked_attention(q, k, v, causal=causal, cu_seqlens=fresh, block=6),
                                q, k, v, other, causal)
    cu.copy_(fresh)  # the first tensor, rewritten in place
    _check_documents_one_by_one(masks.masked_attention(q, k, v, causal=causal, cu_seqlens=cu, block=6),
                                q, k, v, other, causal)
    assert builds[2:] == [fresh.tolist()] * 2


def test_the_blocked_layout_is_built_once_per_batch(monkeypatch):
    # a window takes the masked block walk: its document ids and first keys are cached the same way
    from ds_ulysses_ext.attention import masks
    builds = []
    real_layout = masks._block_layout
    monkeypatch.setattr(masks, "_block_layout", lambda *a: builds.append(1) or real_layout(*a))
    q, k, v = _attention_inputs(6)
    cu = cu_seqlens_of(packed_batch()["position_ids"])
    outs = [masks.masked_attention(q, k, v, cu_seqlens=cu, window=3, block=4) for layer in range(2)]
    assert len(builds) == 1 and torch.equal(outs[0], outs[1])
    other = cu_seqlens_of(_positions([[2, 9, 2], [6, 1, 6]]))
    got = masks.masked_attention(q, k, v, cu_seqlens=other, window=3, block=4)
    assert len(builds) == 2
    assert torch.equal(got, masks.masked_attention(q, k, v, cu_seqlens=other.clone(), window=3, block=4))
    assert not torch.allclose(got, outs[0])


def test_one_plan_serves_every_layer_of_a_step_and_its_recompute(monkeypatch):
    # the cache pays off only if HF hands every layer, and the checkpointed recompute, the very tensor that
    # shard_batch made; a copy on the way would rebuild the plan per layer without failing anything else
    from ds_ulysses_ext.attention import masks
    builds, calls = [], []
    real_plan, real_per_document = masks._document_plan, masks._per_document
    monkeypatch.setattr(masks, "_document_plan", lambda *a: builds.append(1) or real_plan(*a))
    monkeypatch.setattr(masks, "_per_document", lambda *a: calls.append(1) or real_per_document(*a))
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    topo = init_topology(1)
    model = enable_context_parallel(model, topo, backend="sdpa")
    cp_loss_and_grads(model, topo, packed_batch())
    assert len(calls) == 2 * model.config.num_hidden_layers >= 4 and len(builds) == 1


@pytest.mark.parametrize("rewrite", ["data", "numpy"])
@pytest.mark.parametrize("window", [None, 3])
def test_boundaries_rewritten_behind_torchs_back_get_a_fresh_plan(rewrite, window):
    # writes through .data or a numpy view change a tensor's values without bumping its version counter: the
    # same live object, same version, same storage. The plan cached on it must not answer for the new boundaries
    # (on CPU the cache compares the values, which costs no device sync there)
    from ds_ulysses_ext.attention import masks
    q, k, v = _attention_inputs(7)
    other = [[2, 9, 2], [6, 1, 6]]
    fresh = cu_seqlens_of(_positions(other))
    cu = cu_seqlens_of(packed_batch()["position_ids"])
    masks.masked_attention(q, k, v, cu_seqlens=cu, window=window, block=6)  # caches a plan on cu
    version = cu._version
    if rewrite == "data":
        cu.data.copy_(fresh)
    else:
        cu.numpy()[:] = fresh.numpy()
    assert cu._version == version and torch.equal(cu, fresh)  # the premise: torch saw no write
    got = masks.masked_attention(q, k, v, cu_seqlens=cu, window=window, block=6)
    want = masks.masked_attention(q, k, v, cu_seqlens=fresh.clone(), window=window, block=6)
    assert torch.equal(got, want)
    if window is None:
        _check_documents_one_by_one(got, q, k, v, other, True)


def test_on_a_gpu_boundaries_rewritten_behind_torchs_back_stop_the_run(monkeypatch):
    # a GPU compares on the device, without a host sync: a stale plan there is a device-side assertion. CPU stands
    # in for the GPU (its _assert_async raises at once); unchanged boundaries still hit the plan
    from ds_ulysses_ext.attention import masks
    monkeypatch.setattr(masks, "_COMPARE_ON_HOST", ())
    q, k, v = _attention_inputs(8)
    cu = cu_seqlens_of(packed_batch()["position_ids"])
    first = masks.masked_attention(q, k, v, cu_seqlens=cu, block=6)
    assert torch.equal(masks.masked_attention(q, k, v, cu_seqlens=cu, block=6), first)
    cu.data.copy_(cu_seqlens_of(_positions([[2, 9, 2], [6, 1, 6]])))
    with pytest.raises(RuntimeError, match="cu_seqlens was rewritten without torch seeing it"):
        masks.masked_attention(q, k, v, cu_seqlens=cu, block=6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [4, 6, 64])
def test_empty_documents_in_hand_made_boundaries_add_nothing(causal, block):
    # varlen boundaries may repeat (an empty document, as flash-attn accepts); cu_seqlens_of never makes them, a
    # user's own loop may. DOCS with empty documents at the start, between documents, at a row boundary and the end
    from ds_ulysses_ext.attention import masks
    q, k, v = _attention_inputs(9)
    cu = torch.tensor([0, 0, 5, 5, 9, 13, 13, 16, 23, 26, 26], dtype=torch.int32)
    out = masks.masked_attention(q, k, v, causal=causal, cu_seqlens=cu, block=block)
    _check_documents_one_by_one(out, q, k, v, DOCS, causal)
