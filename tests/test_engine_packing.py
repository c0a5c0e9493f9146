"""scripts/train.py with data.pack=true: equal loss and grad_norm at world 1, w2 cp2 and w4 cp2 dp2 (fp32, rel 1e-5).

The documents are short lines of the shipped tokenizer's text (3 to 29 words), packed into 48-token rows, so
every row holds several documents and document boundaries fall inside and across the cp chunks.
"""
import json
import random

from test_engine import ROOT, assert_same_trajectory, train


def _docs(path):
    words = "the grass is green and the sky is blue while a small river runs past the old mill".split()
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 29)))}) + "\n")


def packed_overrides(tmp_path) -> list:
    """The documents written to tmp_path, and the overrides that pack them into 48-token rows for 3 steps."""
    _docs(tmp_path / "docs.jsonl")
    return ["data=jsonl", f"data.path={tmp_path / 'docs.jsonl'}",
            f"data.tokenizer_path={ROOT / 'engine' / 'demo_data' / 'tokenizer'}", "data.seq_len=48", "data.pack=true",
            "trainer.max_steps=3"]


def test_packed_runs_match_across_layouts(tmp_path):
    extra = packed_overrides(tmp_path)
    ref = train(tmp_path, "w1", 1, extra + ["parallelism.cp=1"])
    assert len({r["loss"] for r in ref}) == 3
    assert_same_trajectory(train(tmp_path, "w2_cp2", 2, extra + ["parallelism.cp=2"]), ref, "packed, w2 cp2")
    # two dp ranks of two cp ranks each: the rows do not depend on the layout; each dp rank takes half of a step's
    # 4 rows (2 micro-batches of 1) and splits each row's documents over its cp pair
    assert_same_trajectory(train(tmp_path, "w4_cp2_dp2", 4, extra + ["parallelism.cp=2"]), ref, "packed, w4 cp2 dp2")
