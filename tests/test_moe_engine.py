"""MoE through scripts/train.py on CPU/gloo: every EP x CP x DP layout equals world 1 (fp32, rel 1e-5).

Layouts from the MoE issue, under ZeRO-3 (expert shards partitioned over their expert-data-parallel group) and
one under ZeRO-2, for the Qwen3-MoE preset and for LatentMoE. The per-sequence balance loss is on with a large
coefficient (0.1) so that a wrong aux gradient shows in grad_norm, and its value is compared too
(`moe_aux_loss`, with the load figure `moe_imbalance`). World 1 is anchored to stock HF in tests/test_moe_model.py
(the same model, loss and balance loss written out independently). Resume, export and the refusals follow.
"""
import json

import pytest
import torch

from dist_harness import run_ranks
from test_engine import _rel, _run

RTOL = 1e-5
BASE = ["data=synthetic", "data.seq_len=30", "data.masked_fraction=0.3", "data.num_samples=64",
        "precision=fp32", "device=cpu", "trainer.max_steps=5", "trainer.global_batch_size=4",
        "trainer.warmup_steps=1", "trainer.lr=3e-3", "trainer.save_at_end=false", "trainer.export_hf=false",
        "logging.progress_bar=false", "deepspeed.stage3_param_persistence_threshold=0",
        "deepspeed.reduce_bucket_size=2000", "trainer.loss_chunk_size=7", "moe.aux_loss_coef=0.1",
        "moe.dispatcher=alltoall"]


def train(tmp_path, name, world, extra):
    out = tmp_path / name
    run_ranks(_run, world, BASE + [f"run.out_dir={out}"] + extra)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same(got, ref, what, keys=("loss", "grad_norm", "moe_aux_loss", "moe_imbalance")):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in keys:
            assert _rel(g[key], r[key]) < RTOL, (what, g["step"], key, g[key], r[key])


# the multi-rank runs of the trajectory tests below (and tests/test_moe_deepseek_train.py's) take 3 steps, not BASE's
# 5: step 1 compares the forward, backward and balance loss, steps 2 and 3 the updates after them (Adam's first
# step, then one that reads its moments), so a layout that diverges anywhere shows by step 3. A world-4 step is 1-3 s
# on 2 cores. TRAJECTORY runs 3 steps of a 3-step schedule; STOP_AT_3 the first 3 of BASE's 5-step schedule, for a
# test whose world-1 reference must also show the loss falling (5 steps: over 3 it need not, the batches differ)
TRAJECTORY = ["trainer.max_steps=3"]
STOP_AT_3 = ["trainer.stop_after_steps=3"]

LAYOUTS = {  # name: (world, overrides)
    "w2_ep2_cp2": (2, ["parallelism.cp=2", "parallelism.ep=2"]),
    "w4_ep2_cp2_dp2": (4, ["parallelism.cp=2", "parallelism.ep=2"]),
    "w4_ep4_cp2_dp2": (4, ["parallelism.cp=2", "parallelism.ep=4"]),
    "w4_ep4_cp4": (4, ["parallelism.cp=4", "parallelism.ep=4"]),
    "w4_ep1_cp2_dp2_ga2": (4, ["parallelism.cp=2", "trainer.micro_batch_size=1"]),
    "w2_ep1_cp2_zero2": (2, ["parallelism.cp=2", "deepspeed=zero2"]),
    "w2_ep2_cp2_ring2": (2, ["parallelism.cp=2", "parallelism.ep=2", "parallelism.ring=2"]),  # the zigzag ring
}


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_latent_moe"])
def test_moe_layouts_match_single_process(tmp_path, model):
    lr = ["trainer.lr=5e-4"] if model == "tiny_latent_moe" else []  # hidden 1024: a smaller step trains it
    ref = train(tmp_path, "w1", 1, [f"model={model}", "parallelism.cp=1"] + lr)
    assert ref[-1]["loss"] < ref[0]["loss"], "the reference run must train"
    assert all(r["moe_aux_loss"] > 0 and r["moe_imbalance"] >= 1.0 for r in ref)
    for name, (world, extra) in LAYOUTS.items():
        if model == "tiny_latent_moe" and name not in ("w2_ep2_cp2", "w4_ep4_cp2_dp2", "w4_ep1_cp2_dp2_ga2",
                                                       "w2_ep2_cp2_ring2"):
            continue  # LatentMoE's path differs only inside the block: four layouts cover its EP, CP, GA and ring
        got = train(tmp_path, name, world, [f"model={model}"] + extra + lr + STOP_AT_3)
        assert len(got) == 3 and len(ref) == 5
        assert_same(got, ref[:3], f"{model} {name}")


def test_expert_recompute_and_offload_leave_the_trajectory_unchanged(tmp_path):
    common = ["model=tiny_moe", "parallelism.cp=2", "parallelism.ep=2"] + TRAJECTORY
    ref = train(tmp_path, "plain", 2, common)
    assert len(ref) == 3
    # world 1 too: there the whole-layer recompute is ZeRO-2's plain checkpoint, which checks that the recompute
    # saves as many tensors as the forward did (the balance statistics must be recomputed, not skipped)
    for name, world, extra in [("act", 2, ["moe.recompute=act"]),
                               ("experts_g1_offload", 2, ["moe.recompute=experts", "moe.offload_inputs=true"]),
                               ("experts_g2_full", 2, ["moe.recompute=experts", "moe.recompute_group_size=2",
                                                       "memory=full_recompute"]),
                               ("w1_experts_full", 1, ["moe.recompute=experts", "memory=full_recompute",
                                                       "parallelism.ep=1", "parallelism.cp=1"]),
                               # offload + tiled MLP: the tiling must leave MoE blocks whole
                               ("w2_long_context", 2, ["moe.recompute=experts", "memory=long_context",
                                                       "memory.mlp_tile_tokens=4"])]:
        assert_same(train(tmp_path, name, world, common + extra), ref, name)


def test_bias_balance_updates_the_bias_the_same_on_every_layout(tmp_path):
    extra = ["model=tiny_moe", "moe.balance=bias", "moe.bias_update_rate=0.01", "trainer.export_hf=true",
             "moe.aux_loss_coef=1e-3"]  # BASE's back to the default: balance=bias never reads it (configs/conditional.py)
    ref = train(tmp_path, "w1_bias", 1, extra + ["parallelism.cp=1"])
    got = train(tmp_path, "w2_bias", 2, extra + ["parallelism.cp=2", "parallelism.ep=2"])
    assert_same(got, ref, "bias", keys=("loss", "grad_norm", "moe_imbalance"))
    assert all(r["moe_aux_loss"] is None for r in ref + got)  # no balance loss under balance=bias
    from safetensors.torch import load_file
    biases = []
    for name in ("w1_bias", "w2_bias"):
        state = load_file(str(tmp_path / name / "hf_export" / "model.safetensors"))
        biases.append(torch.stack([state[f"model.layers.{i}.mlp.gate.expert_bias"] for i in range(4)]))
    assert biases[0].abs().sum() > 0, "the bias must have moved"
    assert torch.equal(biases[0], biases[1])


def test_moe_resume_is_exact_and_another_ep_is_refused(tmp_path):
    extra = ["model=tiny_moe", "parallelism.cp=2", "parallelism.ep=2", "trainer.max_steps=4"]
    full = train(tmp_path, "full", 2, extra)
    out = tmp_path / "resumed"
    run_ranks(_run, 2, BASE + [f"run.out_dir={out}"] + extra + ["trainer.stop_after_steps=2", "trainer.save_every=2"])
    run_ranks(_run, 2, BASE + [f"run.out_dir={out}"] + extra)
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_same([r for r in resumed if r["step"] > 2], [r for r in full if r["step"] > 2], "resume")
    with pytest.raises(Exception, match="parallelism.ep=2"):
        run_ranks(_run, 2, BASE + [f"run.out_dir={out}"] + ["model=tiny_moe", "parallelism.cp=2",
                                                           "parallelism.ep=1", "trainer.max_steps=6"])


def test_moe_export_gathers_every_expert(tmp_path):
    """The ep=4 export holds every EP rank's experts in order. One step at lr 1e-9: Adam's first step moves each
    weight by about lr whatever the gradient, so the exports differ by ~1e-9 unless an expert is missing or
    misplaced (after real steps Adam turns 1e-7 gradient rounding into larger weight differences)."""
    from transformers import AutoModelForCausalLM
    extra = ["model=tiny_moe", "trainer.max_steps=1", "trainer.export_hf=true", "trainer.lr=1e-9"]
    train(tmp_path, "w1_export", 1, extra + ["parallelism.cp=1"])
    train(tmp_path, "w4_export", 4, extra + ["parallelism.cp=2", "parallelism.ep=4"])
    models = [AutoModelForCausalLM.from_pretrained(str(tmp_path / n / "hf_export"), dtype=torch.float32)
              for n in ("w1_export", "w4_export")]
    assert type(models[0]).__name__ == "Qwen3MoeForCausalLM"  # stock HF reads the export
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = [m(ids).logits for m in models]
    assert ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item() < RTOL


def test_flops_count_the_active_experts_only():
    from engine.observe.flops import count_params
    from ds_ulysses_ext.moe.parallel import replace_hf_blocks
    from tiny_models import tiny_model
    model = tiny_model("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    replace_hf_blocks(model)
    assert count_params(model) == total - expert + expert * 2 // 8  # top-2 of 8 experts per token


@pytest.mark.parametrize("balance", ["aux", "bias", "none"])
def test_moe_resume_on_other_ranks_is_exact_for_every_balance_mode(tmp_path, balance):
    """World 1 saved at step 2, resumed on world 2 (re-partitioned through DeepSpeed's universal checkpoint,
    engine/checkpoints/reshard.py), equals the uninterrupted world-2 run at step 3. The universal checkpoint holds
    parameters only: balance=bias's router bias, a buffer, must come back too."""
    base = [o for o in BASE if balance == "aux" or not o.startswith("moe.aux_loss_coef")]  # read under aux only
    base += ["model=tiny_moe", "trainer.max_steps=3", f"moe.balance={balance}"]
    base += ["moe.bias_update_rate=0.05"] if balance == "bias" else []

    def run(name, world, extra):
        run_ranks(_run, world, base + [f"run.out_dir={tmp_path / name}"] + extra)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    ref = run("ref", 2, ["parallelism.cp=2"])
    run("resharded", 1, ["parallelism.cp=1", "trainer.save_every=2", "trainer.stop_after_steps=2"])
    got = run("resharded", 2, ["parallelism.cp=2"])
    keys = ("loss", "grad_norm", "moe_imbalance") + (("moe_aux_loss",) if balance == "aux" else ())
    assert_same([r for r in got if r["step"] == 3], [r for r in ref if r["step"] == 3], f"reshard {balance}", keys)


def test_lean_expert_pass_under_zero3_and_recompute_leaves_the_trajectory_unchanged(tmp_path, monkeypatch):
    """moe/lean_pass.py (what CUDA runs at ep=1) through scripts/train.py: ZeRO-3 must gather the expert weights
    around it (it reads them through the experts' forward), a checkpointed layer must recompute it saving the same
    tensors, and moe.recompute=experts must drop h. On CPU it runs with torch's formulas in the kernels' places: its
    CUDA-only conditions are waived, its ep=1 condition kept. Against the three-function path at the same layout."""
    from ds_ulysses_ext.moe import AllToAllDispatcher, lean_pass
    common = ["model=tiny_moe", "parallelism.cp=2"]
    ref = train(tmp_path, "three_functions", 2, common)

    def applies(dispatcher, experts, x):
        return type(dispatcher) is AllToAllDispatcher and dispatcher.ep == 1 and experts.layout == "qwen3"
    monkeypatch.setattr(lean_pass, "applies", applies)  # the ranks are forked from this process: they see it
    real = lean_pass.LeanExpertPass.forward
    ran = tmp_path / "lean_ran"

    def forward(*args):
        ran.touch()
        return real(*args)
    monkeypatch.setattr(lean_pass.LeanExpertPass, "forward", staticmethod(forward))
    for name, world, extra in [("lean_zero3", 2, []),
                               ("lean_full_recompute", 2, ["memory=full_recompute"]),
                               ("lean_h_recomputed_dp2", 4, ["moe.recompute=experts"])]:
        assert_same(train(tmp_path, name, world, common + extra), ref, name)
    assert ran.exists(), "the lean pass never ran"
