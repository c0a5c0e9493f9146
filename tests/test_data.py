"""Data layer: layout-independent sampling, synthetic/JSONL/demo datasets, chat masking, batching."""

from __future__ import annotations

import json
import math
import shutil
import types
from pathlib import Path

import pytest
import torch

from engine.data import (
    DEMO_CORPUS,
    DEMO_TOKENIZER,
    IGNORE_INDEX,
    DataError,
    GlobalBatchSampler,
    build_dataset,
    collate,
    count_target_tokens,
)

EOS = "<|endoftext|>"


def data_cfg(**overrides):
    base = dict(
        source="synthetic", path=None, format="text", tokenizer_path=None, seq_len=64, masked_fraction=0.25,
        num_samples=32, overlong="truncate", on_bad_line="skip", padding_side="right",
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


def jsonl_cfg(path, **overrides):
    fields = {"source": "jsonl", "path": str(path), "tokenizer_path": str(DEMO_TOKENIZER), "seq_len": 4096}
    return data_cfg(**{**fields, **overrides})


def write_jsonl(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER), local_files_only=True)


# ---------------------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("n,g", [(37, 8), (64, 16), (20, 8)])
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro", [1, 2])
def test_local_micro_batches_reassemble_the_global_step(n, g, dp, micro):
    sampler = GlobalBatchSampler(n, g, seed=3)
    accum = g // (dp * micro)
    for step in range(3 * n // g + 2):  # several epochs, so boundary-straddling steps are included
        parts = [sampler.local_indices(step, r, dp, micro) for r in range(dp)]
        assert all(len(p) == accum and all(len(mb) == micro for mb in p) for p in parts)
        flat = [i for p in parts for mb in p for i in mb]
        assert flat == sampler.indices_for_step(step)
        # the global list must not depend on dp or micro: a dp=1/micro=g sampler sees the same samples
        assert flat == GlobalBatchSampler(n, g, seed=3).local_indices(step, 0, 1, g)[0]


@pytest.mark.parametrize("n,g", [(10, 7), (10, 4), (37, 8), (64, 16), (5, 5), (9, 1), (11, 10), (13, 9)])
def test_steps_never_repeat_a_sample_and_each_epoch_covers_the_dataset_once(n, g):
    sampler = GlobalBatchSampler(n, g, seed=11)
    epochs = 6
    steps = math.ceil(epochs * n / g)
    stream = []
    for step in range(steps):
        idx = sampler.indices_for_step(step)
        assert len(idx) == g and len(set(idx)) == g, f"duplicate inside step {step}: {idx}"
        assert all(0 <= i < n for i in idx)
        stream += idx
    for e in range(epochs):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n)), f"epoch {e} is not a permutation"


def test_steps_inside_an_epoch_are_slices_of_the_seeded_permutation():
    n, g, seed = 12, 4, 5
    sampler = GlobalBatchSampler(n, g, seed=seed)
    for step in range(9):
        epoch, offset = divmod(step * g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        assert sampler.indices_for_step(step) == perm[offset : offset + g].tolist()


@pytest.mark.parametrize("n,g", [(10, 7), (37, 8), (13, 9)])
def test_step_indices_do_not_depend_on_query_order(n, g):
    sequential = GlobalBatchSampler(n, g, seed=2)
    expected = [sequential.indices_for_step(s) for s in range(60)]
    shuffled = GlobalBatchSampler(n, g, seed=2)
    for s in torch.randperm(60, generator=torch.Generator().manual_seed(0)).tolist():
        assert shuffled.indices_for_step(s) == expected[s]
    assert GlobalBatchSampler(n, g, seed=2).indices_for_step(59) == expected[59]  # a resume far into the run
    assert GlobalBatchSampler(n, g, seed=3).indices_for_step(0) != expected[0]


def test_sampler_rejects_layouts_that_do_not_divide():
    sampler = GlobalBatchSampler(100, 12, seed=0)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size dp=5"):
        sampler.local_indices(0, 0, 5, 1)
    with pytest.raises(ValueError, match="micro_batch_size=4 does not divide"):
        sampler.local_indices(0, 0, 2, 4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        sampler.local_indices(0, 2, 2, 1)
    with pytest.raises(ValueError, match="larger than the dataset"):
        GlobalBatchSampler(5, 6, seed=0)


# -------------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_in_the_seed_and_shaped_right():
    cfg = data_cfg(seq_len=48, num_samples=12)
    a, stats, tokenizer = build_dataset(cfg, seed=7, vocab_size=100)
    b, _, _ = build_dataset(cfg, seed=7, vocab_size=100)
    c, _, _ = build_dataset(cfg, seed=8, vocab_size=100)
    assert tokenizer is None and len(a) == 12 and stats.num_samples == 12
    for i in range(12):
        x = a[i]
        assert x["input_ids"].shape == x["labels"].shape == (48,)
        assert x["input_ids"].dtype == x["labels"].dtype == torch.long
        assert 0 <= int(x["input_ids"].min()) and int(x["input_ids"].max()) < 100
        kept = x["labels"] != IGNORE_INDEX
        assert torch.equal(x["labels"][kept], x["input_ids"][kept])
        assert torch.equal(x["input_ids"], b[i]["input_ids"]) and torch.equal(x["labels"], b[i]["labels"])
        assert not torch.equal(x["input_ids"], c[i]["input_ids"])
    assert torch.equal(a[-1]["input_ids"], a[11]["input_ids"])
    with pytest.raises(IndexError):
        a[12]


def test_synthetic_leaves_the_global_rng_alone():
    ds, _, _ = build_dataset(data_cfg(), seed=0, vocab_size=50)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ds[5]
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_masked_fraction_and_a_fully_masked_first_cp_chunk():
    seq_len, frac = 200, 0.25
    ds, _, _ = build_dataset(data_cfg(seq_len=seq_len, masked_fraction=frac, num_samples=16), seed=1, vocab_size=64)
    for i in range(16):
        masked = ds[i]["labels"] == IGNORE_INDEX
        if i % 4:
            assert int(masked.sum()) == 50  # 25% of 200
        else:
            # every 4th sample: more than half masked at the front, so after the shift the first cp=2 chunk
            # (shifted positions 0..99 = labels[1:101]) holds no target; the random 25% lands on top
            assert bool(masked[: seq_len // 2 + 1].all())
            assert 120 <= int(masked.sum()) <= 120 + 50
            assert count_target_tokens(ds[i]["labels"][None, : seq_len // 2 + 1]) == 0
    unmasked, _, _ = build_dataset(data_cfg(seq_len=32, masked_fraction=0.0, num_samples=8), seed=1, vocab_size=64)
    assert all(bool((unmasked[i]["labels"] != IGNORE_INDEX).all()) for i in range(8))


# ---------------------------------------------------------------------------------------------- JSONL


def test_jsonl_text_trains_on_every_token_plus_eos(tmp_path, tok):
    texts = ["The ferry left the harbour at dawn.", "Mara baked bread."]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t, "id": k} for k, t in enumerate(texts)])
    ds, stats, tokenizer = build_dataset(jsonl_cfg(path), seed=0, vocab_size=512)
    assert tokenizer is not None and len(ds) == 2 and stats.num_lines == 2 and stats.num_bad_lines == 0
    for sample, text in zip(ds, texts):
        assert tok.decode(sample["input_ids"].tolist()) == text + EOS
        assert sample["input_ids"][-1].item() == tok.eos_token_id
        assert torch.equal(sample["labels"], sample["input_ids"])
    assert stats.num_tokens == sum(len(s["input_ids"]) for s in ds)
    assert stats.num_target_tokens == stats.num_tokens - 2  # position 0 of each sample is never a target


def test_jsonl_folder_reads_its_files_in_name_order(tmp_path, tok):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [{"text": "Second file."}, '{"text": broken'])
    write_jsonl(folder / "a.jsonl", [{"text": "First file."}])
    (folder / "notes.txt").write_text("not data")
    ds, stats, _ = build_dataset(jsonl_cfg(folder), seed=0, vocab_size=512)
    assert [tok.decode(s["input_ids"].tolist()) for s in ds] == ["First file." + EOS, "Second file." + EOS]
    assert (stats.num_lines, stats.num_bad_lines) == (3, 1)
    with pytest.raises(DataError, match=r"b\.jsonl:2:"):
        build_dataset(jsonl_cfg(folder, on_bad_line="fail"), seed=0, vocab_size=512)


CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where is the lighthouse?"},
    {"role": "assistant", "content": "On the hill above the village."},
    {"role": "user", "content": "When is it lit?"},
    {"role": "assistant", "content": "Every night at dusk."},
]


def _target_runs(sample, tok) -> list[str]:
    """The decoded maximal runs of unmasked labels."""
    runs, cur = [], []
    for t in sample["labels"].tolist() + [IGNORE_INDEX]:
        if t == IGNORE_INDEX:
            if cur:
                runs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return runs


def test_jsonl_chat_trains_only_on_assistant_turns(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    ds, stats, _ = build_dataset(jsonl_cfg(path, format="chat"), seed=0, vocab_size=512)
    (sample,) = ds
    assert _target_runs(sample, tok) == [CHAT[2]["content"] + EOS, CHAT[4]["content"] + EOS]
    assert tok.decode(sample["input_ids"].tolist()) == tok.apply_chat_template(CHAT, tokenize=False)
    masked_text = tok.decode(sample["input_ids"][sample["labels"] == IGNORE_INDEX].tolist())
    for m in CHAT[:2] + CHAT[3:4]:
        assert m["content"] in masked_text
    assert stats.num_chat_boundary_mismatches == 0


def test_chat_without_a_template_uses_the_builtin_one_and_says_so(tmp_path, tok, caplog):
    bare = tmp_path / "bare_tokenizer"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # no chat_template.jinja
        shutil.copy(DEMO_TOKENIZER / name, bare / name)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    cfg = jsonl_cfg(path, format="chat")
    cfg.tokenizer_path = str(bare)
    with caplog.at_level("WARNING"):
        ds, _, tokenizer = build_dataset(cfg, seed=0, vocab_size=512)
    assert not tokenizer.chat_template
    assert "no chat_template" in caplog.text and "built-in template" in caplog.text
    assert _target_runs(ds[0], tok) == [CHAT[2]["content"] + EOS, CHAT[4]["content"] + EOS]


def test_chat_without_assistant_turns_is_kept_and_counted_all_masked(tmp_path):
    lines = [{"messages": CHAT[:2]}, {"messages": CHAT}]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    ds, stats, _ = build_dataset(jsonl_cfg(path, format="chat"), seed=0, vocab_size=512)
    assert len(ds) == 2 and stats.num_all_masked == 1
    assert bool((ds[0]["labels"] == IGNORE_INDEX).all())
    # truncating the full chat inside the first user turn also leaves no target: kept and counted
    ds, stats, _ = build_dataset(jsonl_cfg(path, format="chat", seq_len=10), seed=0, vocab_size=512)
    assert len(ds) == 2 and stats.num_all_masked == 2 and stats.num_truncated == 2


def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path, tok):
    short, long_a, long_b = "Mara.", "The ferry left the harbour at dawn. " * 3, "Geese flew south over the bay. " * 4
    assert len(tok(short)["input_ids"]) + 1 <= 8 < len(tok(long_a)["input_ids"])
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": short}, {"text": long_a}, {"text": long_b}])

    ds, stats, _ = build_dataset(jsonl_cfg(path, seq_len=8), seed=0, vocab_size=512)
    assert (len(ds), stats.num_truncated, stats.num_dropped) == (3, 2, 0)
    assert [len(s["input_ids"]) for s in ds][1:] == [8, 8]
    assert ds[1]["input_ids"].tolist() == tok(long_a)["input_ids"][:8]  # the first seq_len tokens are kept

    ds, stats, _ = build_dataset(jsonl_cfg(path, seq_len=8, overlong="drop"), seed=0, vocab_size=512)
    assert (len(ds), stats.num_truncated, stats.num_dropped) == (1, 0, 2)
    assert tok.decode(ds[0]["input_ids"].tolist()) == short + EOS


BAD_FILE_LINES = [
    {"text": "A good line."},  # 1
    '{"text": "unterminated',  # 2: bad JSON
    {"body": "no text key"},  # 3: missing key
    {"text": 42},  # 4: wrong type
    "",  # 5: empty
    {"messages": [{"role": "user", "content": "hi"}]},  # 6: chat line in a text file
    {"text": "Another good line."},  # 7
]


def test_malformed_lines_are_skipped_with_their_line_numbers(tmp_path, caplog):
    path = write_jsonl(tmp_path / "mixed.jsonl", BAD_FILE_LINES)
    with caplog.at_level("WARNING"):
        ds, stats, _ = build_dataset(jsonl_cfg(path), seed=0, vocab_size=512)
    assert len(ds) == 2 and stats.num_bad_lines == 5 and stats.num_lines == 7
    for lineno in (2, 3, 4, 5, 6):
        assert f"mixed.jsonl:{lineno}:" in caplog.text
    assert "mixed.jsonl:1:" not in caplog.text and "mixed.jsonl:7:" not in caplog.text
    assert "data.format=chat" in caplog.text  # line 6 gets a hint


def test_malformed_line_fails_with_its_line_number_when_asked(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", BAD_FILE_LINES)
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: malformed line.*on_bad_line=skip"):
        build_dataset(jsonl_cfg(path, on_bad_line="fail"), seed=0, vocab_size=512)
    assert issubclass(DataError, ValueError)


def test_chat_lines_with_bad_messages_are_skipped(tmp_path, caplog):
    lines = [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "beep"}]},
        {"messages": [{"role": "user", "content": ["not", "a", "string"]}]},
        {"messages": "hello"},
        {"messages": CHAT},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    with caplog.at_level("WARNING"):
        ds, stats, _ = build_dataset(jsonl_cfg(path, format="chat"), seed=0, vocab_size=512)
    assert len(ds) == 1 and stats.num_bad_lines == 4
    assert all(f"chat.jsonl:{n}:" in caplog.text for n in (1, 2, 3, 4))
    assert "'messages' is empty" in caplog.text and "role must be one of" in caplog.text


def _tokenizer_with_template(directory: Path, template: str) -> Path:
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / name, directory / name)
    (directory / "chat_template.jinja").write_text(template)
    return directory


# Marks the last message, so a prefix rendering is not a token prefix of the full rendering.
UNSTABLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if loop.last %} (last){% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REFUSING_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first turn must not be the assistant') }}"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
)


def test_chat_template_that_is_not_prefix_stable_is_masked_by_common_prefix_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    tokenizer_dir = _tokenizer_with_template(tmp_path / "tk", UNSTABLE_TEMPLATE)
    cfg = jsonl_cfg(path, format="chat", tokenizer_path=str(tokenizer_dir))
    ds, stats, _ = build_dataset(cfg, seed=0, vocab_size=512)
    assert stats.num_chat_boundary_mismatches == 1
    targets = "".join(_target_runs(ds[0], tok))
    masked = tok.decode(ds[0]["input_ids"][ds[0]["labels"] == IGNORE_INDEX].tolist())
    assert CHAT[2]["content"] in targets and CHAT[4]["content"] + " (last)" + EOS in targets
    assert all(m["content"] in masked and m["content"] not in targets for m in CHAT if m["role"] != "assistant")


def test_chat_that_the_template_refuses_is_a_bad_line(tmp_path, caplog):
    lines = [{"messages": CHAT[2:]}, {"messages": CHAT}]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    tokenizer_dir = _tokenizer_with_template(tmp_path / "tk", REFUSING_TEMPLATE)
    cfg = jsonl_cfg(path, format="chat", tokenizer_path=str(tokenizer_dir))
    with caplog.at_level("WARNING"):
        ds, stats, _ = build_dataset(cfg, seed=0, vocab_size=512)
    assert len(ds) == 1 and stats.num_bad_lines == 1
    assert "c.jsonl:1:" in caplog.text and "must not be the assistant" in caplog.text


# ----------------------------------------------------------------------------------------------- demo


def test_demo_builds_offline_and_fits_the_tiny_model():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    assert len(tokenizer) <= 512
    assert tokenizer.eos_token == tokenizer.pad_token == EOS and tokenizer.chat_template
    ds, stats, tok = build_dataset(data_cfg(source="demo", seq_len=256), seed=0, vocab_size=512)
    assert len(ds) == stats.num_samples >= 300 and stats.num_bad_lines == 0
    assert max(int(s["input_ids"].max()) for s in ds) < 512
    assert all(1 <= len(s["input_ids"]) <= 256 for s in ds)
    assert tok.decode(ds[0]["input_ids"].tolist()) == json.loads(DEMO_CORPUS.open().readline())["text"] + EOS


def test_demo_refuses_a_model_vocab_smaller_than_its_tokenizer():
    with pytest.raises(DataError, match=r"tokenizer has 512 entries but model\.arch\.vocab_size=256"):
        build_dataset(data_cfg(source="demo"), seed=0, vocab_size=256)


def test_demo_refuses_a_user_path_it_would_ignore(tmp_path):
    with pytest.raises(DataError, match=r"data\.source=jsonl"):
        build_dataset(data_cfg(source="demo", path=str(tmp_path / "x.jsonl")), seed=0, vocab_size=512)


def test_shipped_demo_files_stay_small():
    total = sum(p.stat().st_size for p in DEMO_CORPUS.parent.rglob("*") if p.is_file() and "__pycache__" not in str(p))
    assert total < 1 << 20


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override,field",
    [({"padding_side": "left"}, "padding_side"), ({"source": "hf"}, "source"), ({"overlong": "wrap"}, "overlong")],
)
def test_bad_data_config_names_the_field(override, field):
    with pytest.raises(DataError, match=rf"data\.{field}="):
        build_dataset(data_cfg(**override), seed=0, vocab_size=10)


def test_jsonl_needs_a_tokenizer_and_an_existing_file(tmp_path):
    with pytest.raises(DataError, match="needs data.tokenizer_path"):
        build_dataset(data_cfg(source="jsonl", path=str(tmp_path / "a.jsonl")), seed=0, vocab_size=512)
    with pytest.raises(DataError, match="does not exist"):
        build_dataset(jsonl_cfg(tmp_path / "missing.jsonl"), seed=0, vocab_size=512)
    with pytest.raises(DataError, match="without \\*\\.jsonl files"):
        build_dataset(jsonl_cfg(tmp_path), seed=0, vocab_size=512)
    with pytest.raises(DataError, match="offline"):
        build_dataset(jsonl_cfg(tmp_path / "a.jsonl", tokenizer_path=str(tmp_path / "nope")), seed=0, vocab_size=512)


# ---------------------------------------------------------------------------------------------- batch


def test_collate_right_pads_to_seq_len():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
        {"input_ids": torch.tensor([1, 2, 3, 4, 5]), "labels": torch.tensor([1, 2, -100, 4, 5])},
    ]
    batch = collate(samples, seq_len=6, pad_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 9, 9], [1, 2, 3, 4, 5, 9]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, -100], [1, 2, -100, 4, 5, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    # targets after the shift: row 0 -> [6, 7] = 2, row 1 -> [2, 4, 5] = 3 (row 1's first label 1 never counts)
    assert count_target_tokens(batch["labels"]) == 5
    with pytest.raises(DataError, match="data.seq_len=4"):
        collate(samples, seq_len=4, pad_id=0)


def test_count_target_tokens_ignores_the_first_position():
    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, 8, 9]])
    assert count_target_tokens(labels) == 4
    assert count_target_tokens(torch.tensor([3, 4, 5])) == 2
    assert count_target_tokens(torch.tensor([[1, -100, -100]])) == 0
