"""The real loading paths, offline: model.source=pretrained from a local save_pretrained folder, and
data=jsonl with a local tokenizer, through scripts/train.py at cp=2."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from configs import compose_config, validate
from dist_harness import run_ranks
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def _run(rank, world, overrides):
    from configs import compose_config
    import train as entry
    entry.run(compose_config(overrides))


def test_pretrained_model_and_jsonl_data_train_at_cp2(tmp_path):
    model_dir = tmp_path / "saved_model"
    saved = tiny_model("llama", vocab_size=512)
    saved.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i} about the harbour"},
                                      {"role": "assistant", "content": f"answer {i}: the boats come back at dusk"}]})
             for i in range(12)]
    lines.insert(5, "{not json")  # a malformed line is reported and skipped (on_bad_line=skip)
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    overrides = ["model.source=pretrained", f"model.path={model_dir}", "model.family=llama",
                 "data=jsonl", f"data.path={data}", f"data.tokenizer_path={ROOT / 'engine' / 'demo_data' / 'tokenizer'}",
                 "data.format=chat", "data.seq_len=64", "parallelism.cp=2", "precision=fp32", "device=cpu",
                 "trainer.max_steps=2", "trainer.global_batch_size=2", "trainer.export_hf=false",
                 "trainer.save_at_end=false", "logging.progress_bar=false", "logging.phase_times=true",
                 f"run.out_dir={out}"]
    run_ranks(_run, 2, overrides)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    phases = sum(rows[1][f"time_{p}_s"] for p in ("forward", "backward", "optimizer"))
    assert 0 < phases <= rows[1]["step_time_s"]
    # loss only on assistant tokens: fewer targets than real tokens
    assert 0 < rows[0]["tokens"] < rows[0]["input_tokens"]
    # the run started from the saved weights: its first loss equals stock HF's loss of the saved model on
    # step 0's samples (a random init would differ)
    from configs import compose_config
    from engine.data import GlobalBatchSampler, build_dataset, collate, pad_id_of
    cfg = compose_config(overrides)
    dataset, stats, tok = build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=512)
    assert stats.num_bad_lines == 1
    batch = collate([dataset[i] for i in GlobalBatchSampler(len(dataset), 2, cfg.run.seed).indices_for_step(0)],
                    64, pad_id_of(tok))
    with torch.no_grad():
        logits = saved(input_ids=batch["input_ids"]).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                          ignore_index=-100).item()
    assert abs(rows[0]["loss"] - ref) / ref < 1e-5, (rows[0]["loss"], ref)


def _saved_config(tmp_path, **over):
    """A local checkpoint folder with only its config.json: a 2-layer Llama of 64k positions (nothing to load here;
    validate reads the file as JSON)."""
    from transformers import AutoConfig
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=65536)
    AutoConfig.for_model("llama", **{**kw, **over}).save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_local_checkpoints_own_shape_is_checked_and_planned_not_the_presets(tmp_path):
    """model=tiny (4 layers, 4,096 positions) with a 2-layer checkpoint of 64k positions: the rules and memory=auto read
    the checkpoint's config.json, which is what gets built."""
    from configs.errors import ConfigError
    from engine.run.auto_memory import model_shape
    base = ["model=tiny", "model.source=pretrained", f"model.path={_saved_config(tmp_path)}", "data=synthetic",
            "parallelism.cp=2"]
    # a length past the preset's positions but within the checkpoint's: the preset's arch refused it
    assert validate(compose_config(base + ["data.seq_len=8192"]), world_size=2).seq_len == 8192
    # recompute of more layers than the checkpoint has (the preset has 4): refused, naming the checkpoint's count
    with pytest.raises(ConfigError, match=r"num_hidden_layers=2, got 3"):
        validate(compose_config(base + ["memory=block_recompute", "memory.recompute_num_layers=3"]), world_size=2)
    assert model_shape(compose_config(base)).layers == 2


def test_a_checkpoint_of_another_family_is_refused_before_the_build(tmp_path):
    from configs.errors import ConfigError
    cfg = compose_config(["model=tiny_qwen3", "model.source=pretrained", f"model.path={_saved_config(tmp_path)}",
                          "data=synthetic", "parallelism.cp=2"])
    with pytest.raises(ConfigError, match=r"holds a 'llama' checkpoint .* but model.family=qwen3; set model.family=llama"):
        validate(cfg, world_size=2)


def test_a_checkpoint_missing_weights_is_refused_not_started_at_random(tmp_path):
    """HF only logs a parameter it found no weights for and leaves it random: the load must stop instead."""
    from safetensors.torch import load_file, save_file
    from engine.ds.build import build_hf_model
    model_dir = tmp_path / "saved_model"
    tiny_model("llama", vocab_size=512).save_pretrained(model_dir)
    cfg = compose_config(["model=tiny", "model.source=pretrained", f"model.path={model_dir}", "model.family=llama",
                          "data=synthetic", "parallelism.cp=1", "device=cpu", "precision=fp32"])
    assert build_hf_model(cfg, {"zero_optimization": {"stage": 0}}) is not None  # the whole save loads
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"1 parameters of the model have no weights in the checkpoint \(e\.g\. "
                                           r"model\.layers\.1\.mlp\.down_proj\.weight\)"):
        build_hf_model(cfg, {"zero_optimization": {"stage": 0}})


def test_a_qwen3_5_checkpoint_with_its_vision_tower_loads_its_text_model_whole(tmp_path):
    """Qwen3.5 / 3.6 checkpoints are saved as the vision-language model (model_type qwen3_5, the decoder under
    text_config): model.family=qwen3_5_text takes its language model, every weight from the file."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from engine.ds.build import build_hf_model
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * 2)
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    saved = AutoModelForImageTextToText.from_config(AutoConfig.for_model("qwen3_5", text_config=text,
                                                                         vision_config=vision))
    saved.save_pretrained(tmp_path)
    cfg = compose_config(["model=tiny_qwen3_5", "model.source=pretrained", f"model.path={tmp_path}", "data=synthetic",
                          "parallelism.cp=1", "device=cpu", "precision=fp32"])
    validate(cfg, world_size=1)  # the family is read off text_config
    loaded = build_hf_model(cfg, {"zero_optimization": {"stage": 0}})
    mine = dict(loaded.named_parameters())
    theirs = dict(saved.model.language_model.named_parameters())
    assert len(mine) == len(theirs) + 1  # + lm_head
    for name, p in theirs.items():
        assert torch.equal(mine[f"model.{name}"], p), name
    assert torch.equal(mine["lm_head.weight"], saved.lm_head.weight)
