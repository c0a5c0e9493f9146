"""trainer.on_nonfinite: a step with an inf/NaN loss or gradient norm stops the run on every rank (abort), or is
dropped by DeepSpeed and reported (skip). Never silently applied.

The non-finite step is made the way it happens in practice: a learning rate far too high. lr=1e30 with no
warmup turns the first Adam update into weights of about 1e30, and the next forward overflows.
"""
import json
import math
from pathlib import Path

import pytest

from engine.observe.tracking import read_metrics
from test_engine import BASE, _rel

from dist_harness import run_ranks

BLOW_UP = ["trainer.lr=1e30", "trainer.warmup_steps=0", "trainer.max_steps=4"]


def _run_and_note(rank, world, overrides, notes):
    from configs import compose_config
    import train as entry
    from engine.observe.nonfinite import NonFiniteStep
    try:
        entry.run(compose_config(overrides))
        note = "finished"
    except NonFiniteStep as err:
        note = str(err)
    Path(notes, f"rank{rank}.txt").write_text(note)


def _train(tmp_path, name, world, extra):
    out, notes = tmp_path / name, tmp_path / f"{name}_notes"
    notes.mkdir()
    run_ranks(_run_and_note, world, BASE + [f"run.out_dir={out}"] + extra, str(notes))
    text = (out / "metrics.jsonl").read_text()
    for line in text.splitlines():  # strict JSON: a parser that refuses NaN / Infinity reads every row
        json.loads(line, parse_constant=lambda word: pytest.fail(f"bare {word} in metrics.jsonl: {line}"))
    rows = read_metrics(out / "metrics.jsonl")  # the non-finite numbers as floats again
    return rows, [(notes / f"rank{r}.txt").read_text() for r in range(world)], out


def _finite(row):
    return math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def test_abort_stops_every_rank_at_the_first_nonfinite_step_and_saves_nothing_after_it(tmp_path):
    rows, notes, out = _train(tmp_path, "abort", 2, ["parallelism.cp=2", "trainer.save_every=1"] + BLOW_UP)
    assert _finite(rows[0]) and not _finite(rows[-1]), rows
    bad = rows[-1]["step"]
    assert all(_finite(r) for r in rows[:-1]) and bad < 4  # the run stopped there: later steps never ran
    for note in notes:  # every rank raised, none hung in a collective
        assert note.startswith(f"step {bad}: loss=") and "is not finite" in note, note
        assert f"the latest checkpoint is step_{bad - 1:08d}" in note, note
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{bad - 1:08d}"
    assert "skipped" not in rows[-1]


# DeepSpeed skips by the gradient norm on ZeRO-3 and in fp32; its bf16 ZeRO-2 path needs the per-tensor scan
# (deepspeed=zero0 by its own optimizer's found_inf, engine/ds/clipping_adamw.py)
@pytest.mark.parametrize("world, layout", [(1, ["precision=bf16", "deepspeed=zero2", "parallelism.cp=1"]),
                                           (2, ["parallelism.cp=2"]),
                                           (1, ["precision=bf16", "deepspeed=zero0", "deepspeed.master_weights=bf16",
                                                "parallelism.cp=1"])],
                         ids=["bf16_zero2_w1", "fp32_zero3_cp2", "bf16_zero0_w1"])
def test_skip_drops_overflowing_steps_and_reports_each(tmp_path, world, layout):
    rows, notes, out = _train(tmp_path, "skip", world, layout + ["trainer.on_nonfinite=skip", "trainer.export_hf=true"]
                              + BLOW_UP)
    assert notes == ["finished"] * world
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "skipped" not in rows[0] and _finite(rows[0])
    for r in rows[1:]:
        assert r["skipped"] is True and not math.isfinite(r["grad_norm"]), r
    # the updates really were dropped: an applied NaN gradient would have made the weights NaN
    from safetensors.torch import load_file
    weights = load_file(next((out / "hf_export").glob("*.safetensors")))
    assert all(bool(w.float().isfinite().all()) for w in weights.values())


def test_abort_is_not_triggered_by_a_finite_run(tmp_path):
    # the check reads numbers the step already has: a normal bf16 run goes through unchanged
    rows, notes, _ = _train(tmp_path, "finite", 1, ["precision=bf16", "parallelism.cp=1", "trainer.max_steps=3"])
    assert notes == ["finished"] and all(_finite(r) and "skipped" not in r for r in rows)
    assert _rel(rows[-1]["loss"], rows[0]["loss"]) < 0.5


@pytest.mark.parametrize("loss, grad_norm, policy, expected", [
    (1.0, 1.0, "abort", (False, False)),
    (1.0, math.inf, "abort", (False, True)),
    (math.nan, 1.0, "abort", (False, True)),
    (1.0, math.nan, "skip", (True, False)),
    (math.inf, math.inf, "skip", (True, False)),
    # DeepSpeed applied this update (its gradients were finite): skipping is not what happened, so stop
    (math.nan, 1.0, "skip", (False, True)),
])
def test_judge(loss, grad_norm, policy, expected):
    from engine.observe.nonfinite import judge
    from engine.run.step import StepResult
    assert judge(StepResult(loss=loss, grad_norm=grad_norm, tokens=1, input_tokens=1), policy) == expected
