"""Held-out evaluation (data.eval_samples, trainer.eval_every): the same eval_loss on every layout, equal to stock
HF's loss on the held-out samples with the trained weights, and no effect on the training trajectory."""
import dataclasses

import torch
import torch.nn.functional as F

from test_engine import BASE, RTOL, _rel, assert_same_trajectory, base_for, train

from engine.run.evaluate import local_eval_batches

EVAL = ["data.eval_samples=3", "trainer.max_steps=3"]  # 3 held-out samples: not a multiple of dp=2


def _evals(rows):
    return [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in rows if "eval_loss" in r]


def test_local_eval_batches_fill_every_rank_to_the_same_count():
    # 5 held-out samples, dp=2, micro 2: rank 0 takes 0, 2, 4; rank 1 takes 1, 3; None pads to 2 micro-batches
    assert local_eval_batches([10, 11, 12, 13, 14], 0, 2, 2) == [[10, 12], [14, None]]
    assert local_eval_batches([10, 11, 12, 13, 14], 1, 2, 2) == [[11, 13], [None, None]]
    assert local_eval_batches([10, 11, 12], 0, 1, 1) == [[10], [11], [12]]


def test_eval_loss_is_the_same_on_every_layout(tmp_path):
    ref = _evals(train(tmp_path, "w1", 1, EVAL + ["parallelism.cp=1", "trainer.eval_every=2"]))
    assert [s for s, _, _ in ref] == [2, 3]  # every 2 steps, and at the last step
    # the memory policies run their no_grad paths in evaluation: one layout goes through all of them
    policies = ["memory=except_attention", "memory.recompute_num_layers=1", "memory.tiled_mlp=true",
                "memory.mlp_tile_tokens=4", "memory.offload_activations=true"]
    for name, world, extra in (("w2_cp2", 2, ["parallelism.cp=2"]), ("w4_cp2_dp2", 4, ["parallelism.cp=2"]),
                               ("w2_cp2_policies", 2, ["parallelism.cp=2"] + policies)):
        got = _evals(train(tmp_path, name, world, EVAL + extra + ["trainer.eval_every=2"]))
        assert [(s, n) for s, _, n in got] == [(s, n) for s, _, n in ref], name
        for (_, g, _), (_, r, _) in zip(got, ref):
            assert _rel(g, r) < RTOL, (name, g, r)


def test_eval_does_not_change_training_and_matches_stock_hf_on_the_held_out_samples(tmp_path):
    often = train(tmp_path, "often", 2, EVAL + ["parallelism.cp=2", "trainer.eval_every=1", "trainer.export_hf=true"])
    once = train(tmp_path, "once", 2, EVAL + ["parallelism.cp=2", "trainer.eval_every=3"])
    assert_same_trajectory(once, often, "eval every step vs only at the end")
    assert _rel(_evals(once)[-1][1], _evals(often)[-1][1]) < RTOL

    # the reference: stock HF with the exported weights, on the last 3 samples of the same dataset
    from configs import compose_config
    from engine.data import build_dataset
    from transformers import AutoModelForCausalLM
    cfg = compose_config(BASE + EVAL + ["parallelism.cp=2", "trainer.eval_every=1"])
    dataset, _, _ = build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=cfg.model.arch["vocab_size"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "often" / "hf_export", attn_implementation="sdpa").eval()
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset) - 3, len(dataset)):
            ids, labels = dataset[i]["input_ids"][None], dataset[i]["labels"][None]
            logits = model(input_ids=ids).logits[0, :-1]
            loss_sum += float(F.cross_entropy(logits.double(), labels[0, 1:], ignore_index=-100, reduction="sum"))
            count += int((labels[0, 1:] != -100).sum())
    step, got, tokens = _evals(often)[-1]
    assert step == 3 and tokens == count
    assert _rel(got, loss_sum / count) < RTOL, (got, loss_sum / count)


def test_eval_path_scores_every_sample_of_a_validation_file(tmp_path):
    from configs import compose_config
    from engine.data import DEMO_CORPUS, DEMO_TOKENIZER, build_dataset, count_target_tokens
    val = tmp_path / "val.jsonl"
    val.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:5]))  # 5 samples: odd over dp=2
    data = ["data.source=jsonl", f"data.path={DEMO_CORPUS}", f"data.tokenizer_path={DEMO_TOKENIZER}",
            f"data.eval_path={val}", "trainer.eval_every=2", "trainer.max_steps=2"]
    ref = _evals(train(tmp_path, "w1", 1, data + ["parallelism.cp=1"]))
    got = _evals(train(tmp_path, "w2_cp2", 2, data + ["parallelism.cp=2"]))
    cfg = compose_config(base_for(data) + data)
    held, _, _ = build_dataset(dataclasses.replace(cfg.data, path=str(val)), seed=0,
                               vocab_size=cfg.model.arch["vocab_size"])
    assert len(held) == 5
    assert ref[0][2] == got[0][2] == sum(count_target_tokens(s["labels"]) for s in held)
    assert _rel(got[0][1], ref[0][1]) < RTOL


def test_loss_plot_shows_the_held_out_points(tmp_path, monkeypatch):
    import json
    import matplotlib.pyplot as plt
    from engine.observe.plot import plot_loss
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "eval_loss": 2.7}, {"step": 3, "loss": 2.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn, real_plot = [], plt.Axes.plot

    def spy(self, x, y, **kw):
        drawn.append((list(x), list(y), kw.get("label")))
        return real_plot(self, x, y, **kw)

    monkeypatch.setattr(plt.Axes, "plot", spy)
    png = plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert png.exists() and ([2], [2.7], "held-out") in drawn
