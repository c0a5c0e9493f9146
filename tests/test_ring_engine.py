"""scripts/train.py with a ring on CPU/gloo: ring and hybrid layouts give the single-process trajectory.

World 4 at parallelism.cp=4 with parallelism.ring=2 (Ulysses pairs x a ring of 2) and ring=4 (pure ring) must equal
world 1 (loss and grad_norm at each of 3 steps, fp32, rel 1e-5; ZeRO-3). The 30-token sequences are padded to 32
(a multiple of 2 * cp). A model whose heads cp cannot split (2 query / 1 KV head at cp=4) runs with
parallelism.ring=auto, which must pick ring 2 and say why in the log. Packed rows (data.pack=true) at cp=4 with a
ring of 2 equal world 1 too.
"""
import logging

from test_engine import assert_same_trajectory, train

ZERO3 = ["deepspeed=zero3", "deepspeed.stage3_param_persistence_threshold=0", "trainer.max_steps=3"]
WORLD_1 = ["parallelism.cp=1", "deepspeed.offload_param=true"]  # world 1 keeps ZeRO-3 only with offload
TWO_HEADS = ["model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=1", "model.arch.head_dim=32"]


def test_ring_and_hybrid_match_single_process(tmp_path):
    ref = train(tmp_path, "w1", 1, ZERO3 + WORLD_1)
    assert len({r["loss"] for r in ref}) == 3
    # the hybrid also under the long-context memory policy (the ring's saved tensors kept, one layer recomputed whole)
    for ring, memory in ((2, ["memory=except_attention", "memory.recompute_num_layers=1"]), (4, [])):
        got = train(tmp_path, f"w4_cp4_ring{ring}", 4, ZERO3 + ["parallelism.cp=4", f"parallelism.ring={ring}"] + memory)
        assert_same_trajectory(got, ref, f"ring={ring} {memory}")


def test_auto_ring_for_heads_cp_cannot_split(tmp_path, monkeypatch):
    ref = train(tmp_path, "w1", 1, ZERO3 + WORLD_1 + TWO_HEADS)
    log_file = tmp_path / "layout.log"
    handler = logging.FileHandler(log_file)  # forked ranks inherit it; rank 0 alone logs the layout
    logging.getLogger("engine.run.train").addHandler(handler)
    logging.getLogger("engine.run.train").setLevel(logging.INFO)
    try:
        got = train(tmp_path, "w4_cp4_auto", 4, ZERO3 + TWO_HEADS + ["parallelism.cp=4", "parallelism.ring=auto"])
    finally:
        logging.getLogger("engine.run.train").removeHandler(handler)
    assert_same_trajectory(got, ref, "ring=auto")
    text = log_file.read_text()
    assert "cp layout: ring=2 (Ulysses groups of 2)" in text, text
    assert "do not split over cp=4" in text, text


def _validate(overrides, world):
    from configs import compose_config, validate
    return validate(compose_config(overrides), world_size=world)


def test_ring_auto_and_given_by_config():
    assert _validate(["parallelism.cp=4"], 4).ring == 1  # the tiny model's 8 / 2 heads split over 4: Ulysses
    plan = _validate(["parallelism.cp=4"] + TWO_HEADS, 4)
    assert plan.ring == 2 and "Ulysses groups of 2" in plan.ring_reason
    assert _validate(["parallelism.cp=4", "parallelism.ring=4"], 4).ring == 4


def test_ring_refusals_by_config():
    import pytest
    from configs import ConfigError
    with pytest.raises(ConfigError, match=r"parallelism\.ring=3 with parallelism\.cp=4.*choose parallelism\.ring in "
                                          r"\{1, 2, 4\} or parallelism\.ring=auto"):
        _validate(["parallelism.cp=4", "parallelism.ring=3"], 4)
    with pytest.raises(ConfigError, match=r"parallelism\.cp=4 cannot split the heads.*parallelism\.ring=auto$"):
        _validate(["parallelism.cp=4", "parallelism.ring=1"] + TWO_HEADS, 4)  # Ulysses alone, asked for by name
    with pytest.raises(ConfigError, match=r"parallelism\.ring=many is neither auto nor a positive integer"):
        _validate(["parallelism.cp=4", "parallelism.ring=many"], 4)
    # packing and sliding windows run under the ring (tests/test_ring.py checks them exact)
    assert _validate(["parallelism.cp=4", "parallelism.ring=2", "data.pack=true", "+model.arch.use_sliding_window=true",
                      "+model.arch.sliding_window=8"], 4).ring == 2


def test_packed_rows_under_the_hybrid_match_single_process(tmp_path):
    from test_engine_packing import packed_overrides
    extra = packed_overrides(tmp_path)
    ref = train(tmp_path, "w1", 1, extra + ["parallelism.cp=1"])
    assert len({r["loss"] for r in ref}) == 3
    got = train(tmp_path, "w4_cp4_ring2", 4, extra + ["parallelism.cp=4", "parallelism.ring=2"])
    assert_same_trajectory(got, ref, "packed, w4 cp4 ring 2")
