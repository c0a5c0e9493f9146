"""A short passkey run learns retrieval (issue 13): the engine trains the CPU demo's stage-1 model, and the
held-out grid says it retrieves the key, while the same model at its random init does not."""
import json
import sys
from pathlib import Path

from dist_harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # train.py and eval_retrieval.py, called on forked ranks

# the CPU demo's stage 1 (hydra_conf/experiment/cpu_passkey_short.yaml: 2 layers, hidden 128, 8 heads of 16
# with a KV head each, repeated filler, 2-digit keys, lr 3e-3, betas (0.9, 0.98), cp=2 on 2 ranks, ZeRO-3, fp32)
# in rows of 128 tokens instead of 256, 64 samples a step in one micro-batch, 10 warmup steps instead of 30
STEPS = 100
RECIPE = ["experiment=cpu_passkey_short", "data.seq_len=128", "data.passkey.lengths=[64,96,128]",
          f"trainer.max_steps={STEPS}", "trainer.global_batch_size=64", "trainer.micro_batch_size=64",
          "trainer.warmup_steps=10", "trainer.save_at_end=false", "trainer.export_hf=true"]
# the held-out grid, scored at the last step (data.passkey.eval_*): 2 lengths x 5 depths x 8 samples
LENGTHS, DEPTHS, PER_CELL = [96, 128], [0.0, 0.25, 0.5, 0.75, 1.0], 8
GRID = [f"data.passkey.eval_lengths=[{','.join(map(str, LENGTHS))}]",
        f"data.passkey.eval_depths=[{','.join(map(str, DEPTHS))}]",
        f"data.passkey.eval_samples_per_cell={PER_CELL}", "data.eval_samples=8", f"trainer.eval_every={STEPS}"]
BAR, CHANCE = 0.8, 0.05


def _train(rank, world, overrides):
    from configs import compose_config
    import train as entry
    entry.run(compose_config(overrides))


def _score_export(rank, world, run_dir, out_dir):
    import eval_retrieval
    eval_retrieval.run(eval_retrieval.compose([
        f"target={run_dir}", "parallelism.cp=2", "device=cpu", f"lengths=[{','.join(map(str, LENGTHS))}]",
        f"depths=[{','.join(map(str, DEPTHS))}]", f"samples_per_cell={PER_CELL}", f"out_dir={out_dir}"]))


def _score_random_init(rank, world, overrides, out_file):
    """The run's own model before any step (the engine's init from run.seed), scored on the same grid."""
    from configs import compose_config, validate
    from ds_ulysses_ext import init_topology
    from engine.ds.build import build
    from engine.data import pad_id_of
    from engine.data.passkey import PasskeyTask
    from engine.data.tokenizer import tokenizer_of
    from engine.ds.distributed import init_distributed, read_runtime
    from engine.run.retrieval import eval_grid_of, score_retrieval
    cfg = compose_config(overrides)
    rt = read_runtime(cfg.device)
    plan = validate(cfg, rt.world_size)
    init_distributed(rt)
    topo = init_topology(plan.cp, plan.ep, plan.ring)
    engine, _, _ = build(cfg, plan, topo, rt.device)
    task = PasskeyTask(cfg.data.passkey, tokenizer_of(cfg.data), cfg.data.path)
    lengths, depths, per_cell = eval_grid_of(cfg.data)
    result = score_retrieval(engine, task, cfg.run.seed, lengths, depths, per_cell, topo, plan.dp,
                             plan.micro_batch_size, pad_id_of(task.tok), rt.device)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)


def test_a_short_passkey_run_learns_retrieval_that_its_random_init_lacks(tmp_path):
    """The trained model must clear BAR (0.8) mean exact match on the 80-sample grid, its random init stay at or
    below CHANCE (0.05).

    Measured (2026-12-01, the shared 2-core machine): 1.00 at step 100 (80 of 80; the in-training score and
    scripts/eval_retrieval.py on the HF export agree cell by cell), 0.00 at the random init. The recipe's curve
    on this grid, scored every 10 steps in a separate run with the same losses bit for bit: 0.01 at steps 10
    and 20, 0.16 at 30, 0.71 at 40, 0.79 at 50, 0.84 at 60, 0.88 at 70, 0.95 at 80, 0.99 at 90, 1.00 at 100,
    0.95-1.00 up to 150. Step 100 is on the plateau: another CPU's rounding may shift the curve by a few steps,
    which the margin over the bar allows for (not measured on other CPUs); trained for 10 steps the test fails
    (0.0125). Wall: 53-57 s at load 1.7-2.0 (100 steps of 0.32 s, then 8 s for the eval script and 5 s for the
    random init)."""
    run_dir = tmp_path / "run"
    overrides = RECIPE + GRID + [f"run.out_dir={run_dir}"]
    run_ranks(_train, 2, overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    trained = json.loads((run_dir / "retrieval.json").read_text())
    assert trained["step"] == STEPS and rows[-1]["retrieval_acc"] == trained["mean_accuracy"]
    assert [(c["length"], c["depth"], c["samples"]) for c in trained["cells"]] == \
        [(L, d, PER_CELL) for L in LENGTHS for d in DEPTHS]

    # the export, scored by the eval script at cp=2 (the run's task from its config): the same verdicts
    scored = tmp_path / "scored"
    run_ranks(_score_export, 2, str(run_dir), str(scored))
    exported = json.loads((scored / "retrieval.json").read_text())
    assert [c["accuracy"] for c in exported["cells"]] == [c["accuracy"] for c in trained["cells"]]

    # the same model class, shape and task at the run's random init: near zero on the same grid
    random_file = tmp_path / "random_init.json"
    run_ranks(_score_random_init, 2, overrides, str(random_file))
    untrained = json.loads(random_file.read_text())
    print(f"passkey grid: trained {trained['mean_accuracy']:.3f}, random init {untrained['mean_accuracy']:.3f}")
    assert untrained["mean_accuracy"] <= CHANCE, untrained
    assert trained["mean_accuracy"] >= BAR, trained
