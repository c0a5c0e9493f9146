"""scripts/train.py with issue 40's tiny presets (fp32, CPU, ZeRO-3; 5 steps at 30 tokens, every layout equal world 1
at rel 1e-5 on every step's metrics):
- tiny_qwen3_vl: world 1's first step against stock HF + AdamW (tests/hf_reference.py: the loss, the gradient norm),
  w2 cp2 equal to world 1, and the export: the whole VL checkpoint, which stock HF's AutoModelForImageTextToText loads
  without this package, its vision tower the run's initial one (frozen), its language model trained;
- tiny_cohere2_moe at w2 cp2 ep2 (logit_scale in the loss head, windows in the CP attention, the averaged shared expert
  of our block over the EP all-to-all) equal to world 1, balance loss and imbalance included.
"""
import torch

from test_engine import ANCHOR, _rel, assert_same_trajectory
from test_moe_engine import BASE as MOE_BASE
from test_moe_engine import assert_same, train

DENSE_BASE = [o for o in MOE_BASE if not o.startswith("moe.")]  # validate refuses moe.* keys for a dense family


def _train_dense(tmp_path, name, world, extra):
    import json
    from dist_harness import run_ranks
    from test_engine import _run
    out = tmp_path / name
    run_ranks(_run, world, DENSE_BASE + [f"run.out_dir={out}"] + extra)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_qwen3_vl_trains_on_text_as_stock_hf_and_exports_the_vl_checkpoint(tmp_path):
    from transformers import AutoModelForImageTextToText
    from hf_reference import first_step
    # weight decay on: an optimizer that held the vision tower would decay it though it never gets a gradient
    extra = ["model=tiny_qwen3_vl", "trainer.export_hf=true", "trainer.weight_decay=0.1"]
    ref = _train_dense(tmp_path, "w1", 1, extra + ["parallelism.cp=1"])
    assert len({r["loss"] for r in ref}) == 5  # the language model trains
    anchor = first_step(DENSE_BASE + [f"run.out_dir={tmp_path / 'anchor'}"] + extra)
    for key in ("loss", "grad_norm"):
        assert _rel(ref[0][key], anchor[key]) < ANCHOR[key], (key, ref[0][key], anchor[key])
    assert_same_trajectory(_train_dense(tmp_path, "w2", 2, extra + ["parallelism.cp=2"]), ref, "qwen3_vl w2 cp2")

    exports = [AutoModelForImageTextToText.from_pretrained(str(tmp_path / n / "hf_export"), dtype=torch.float32)
               for n in ("w1", "w2")]
    assert type(exports[0]).__name__ == "Qwen3VLForConditionalGeneration"
    state = exports[1].state_dict()
    vision = [n for n in anchor["init"] if n.startswith("model.visual.")]
    assert vision and all(torch.equal(state[n], anchor["init"][n]) for n in vision)  # frozen: as initialised
    text = [n for n in anchor["init"] if n.startswith("model.language_model.layers.")]
    assert all(not torch.equal(state[n], anchor["init"][n]) for n in text)  # trained
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in exports]
    assert ((logits[1] - logits[0]).norm() / logits[0].norm()).item() < 1e-5


def test_cohere2_moe_cp_ep_matches_world_1(tmp_path):
    ref = train(tmp_path, "w1", 1, ["model=tiny_cohere2_moe", "parallelism.cp=1"])
    assert all(r["moe_aux_loss"] > 0 and r["moe_imbalance"] >= 1.0 for r in ref)
    got = train(tmp_path, "w2", 2, ["model=tiny_cohere2_moe", "parallelism.cp=2", "parallelism.ep=2"])
    assert_same(got, ref, "cohere2_moe w2 cp2 ep2")
