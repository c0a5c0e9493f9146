"""data.pack=true: greedy best-fit rows, deterministic and layout-independent, one target count per document."""
import torch

from engine.data import GlobalBatchSampler, build_dataset, collate, count_target_tokens
from engine.data.packing import PackedDataset, pack_rows
from test_data import data_cfg


def _doc(n, start):
    ids = torch.arange(start, start + n)
    return {"input_ids": ids, "labels": ids.clone()}


def test_best_fit_rows_by_hand():
    # 5 opens row 0 (room 3); 3 fills it; 4 opens row 1 (room 4); 2 goes there (room 2); 6 opens row 2
    # (room 2); 1 takes the best fit, the older of the two rooms of 2: row 1
    assert pack_rows([5, 3, 4, 2, 6, 1], 8) == [[0, 1], [2, 3, 5], [4]]
    # best fit, not first fit: 2 goes to the row with room 2 (row 1), not the older one with room 3
    assert pack_rows([5, 6, 2], 8) == [[0], [1, 2]]


def test_a_packed_row_restarts_positions_and_counts_each_documents_targets():
    docs = [_doc(3, 10), _doc(4, 20), _doc(2, 30)]
    docs[1]["labels"][2] = -100
    ds = PackedDataset(docs, 8)
    assert ds.rows == [[0, 1], [2]]
    row = ds[0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert row["labels"].tolist() == [-100, 11, 12, -100, 21, -100, 23]  # each document's first label is no target
    assert count_target_tokens(row["labels"]) == count_target_tokens(docs[0]["labels"]) + count_target_tokens(docs[1]["labels"])
    assert abs(ds.efficiency - 9 / 16) < 1e-12
    batch = collate([row, ds[1]], 8, pad_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]  # pads continue


def test_packing_is_deterministic_and_layout_independent():
    cfg = data_cfg(source="demo", seq_len=256, pack=True)
    a, stats, _ = build_dataset(cfg, seed=0, vocab_size=512)
    b, _, _ = build_dataset(cfg, seed=1, vocab_size=512)
    assert a.rows == b.rows and len(a) < stats.num_samples  # several documents share rows
    assert "packing efficiency" in stats.summary() and f"{len(a):,} rows of 256" in stats.summary()
    sampler = GlobalBatchSampler(len(a), 8, seed=0)
    for step in range(3):  # the rows of a step, whether 1 or 2 dp ranks draw them
        one = sum(sampler.local_indices(step, 0, 1, 2), [])
        two = sum(sampler.local_indices(step, 0, 2, 2) + sampler.local_indices(step, 1, 2, 2), [])
        assert one == two == sampler.indices_for_step(step)
