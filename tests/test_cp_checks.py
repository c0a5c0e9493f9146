"""The CP input check runs on every forward and every row; masks and kwargs the CP attention would ignore are refused."""
import pytest
import torch

from dist_harness import run_ranks
from ds_ulysses_ext import CPCausalLM, Topology, UnsupportedError, enable_context_parallel, init_topology, shard_batch
from tiny_models import tiny_model

ONE = Topology(world_size=1, rank=0, cp_size=1, dp_size=1)


def _later_batch_in_wrong_order(rank, world):
    topo = init_topology(world)
    lm = CPCausalLM(enable_context_parallel(tiny_model("llama"), topo, backend="sdpa"))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    lm(**shard_batch({"input_ids": ids}, topo))  # the first batch is right
    swapped = shard_batch({"input_ids": ids}, Topology(world, world - 1 - rank, world, 1))
    with pytest.raises(UnsupportedError, match="CP rank 0 row 0 has position_ids starting at 4.*Use shard_batch"):
        lm(**swapped)
    # only the second row is another rank's: the check reads every row, not row 0
    mixed = shard_batch({"input_ids": ids}, topo)
    mixed["position_ids"] = torch.stack([mixed["position_ids"][0], swapped["position_ids"][1]])
    with pytest.raises(UnsupportedError, match="CP rank 0 row 1 has position_ids starting at 4"):
        lm(**mixed)
    # packed rows: positions that do not follow the boundaries this batch carries
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    packed = shard_batch({"input_ids": ids, "position_ids": pos}, topo)
    lm(**packed)
    packed["position_ids"] = shard_batch({"input_ids": ids, "position_ids": pos.roll(1, 1)}, topo)["position_ids"]
    with pytest.raises(UnsupportedError, match=r"CP rank \d row 0 .*document positions from cp_cu_seqlens"):
        lm(**packed)


def test_a_later_batch_in_the_wrong_chunk_order_is_refused():
    run_ranks(_later_batch_in_wrong_order, 2)


def _model():
    return enable_context_parallel(tiny_model("llama"), ONE, backend="sdpa")


def test_a_mask_that_is_not_plain_causal_is_refused():
    model, ids, pos = _model(), torch.randint(0, 96, (1, 6)), torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    model(input_ids=ids, position_ids=pos, attention_mask=causal)  # a plain causal mask is what CP runs
    additive = torch.zeros(1, 1, 6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    model(input_ids=ids, position_ids=pos, attention_mask=additive)
    block = causal.clone()
    block[..., 3:, :3] = False  # two documents as a 4D mask: the CP attention would attend across them
    with pytest.raises(UnsupportedError, match="attention mask .* not plain causal.*position_ids restarting at 0"):
        model(input_ids=ids, position_ids=pos, attention_mask=block)
    with pytest.raises(UnsupportedError, match="not plain causal"):  # a bias that only dampens changes the softmax
        model(input_ids=ids, position_ids=pos, attention_mask=torch.zeros(1, 1, 6, 6).masked_fill(~causal, -1.0))


def test_a_left_padded_2d_mask_is_refused():
    model, ids, pos = _model(), torch.randint(0, 96, (1, 6)), torch.arange(6)[None]
    model(input_ids=ids, position_ids=pos, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]))  # right padding
    with pytest.raises(UnsupportedError, match="pad before a real token.*padding_side=right"):
        model(input_ids=ids, position_ids=pos, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]))


def test_kwargs_the_cp_attention_would_ignore_are_refused():
    model, ids, pos = _model(), torch.randint(0, 96, (1, 6)), torch.arange(6)[None]
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match=r"handed \['cu_seq_lens_k', 'cu_seq_lens_q'\].*shard_batch"):
        model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
