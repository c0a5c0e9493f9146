"""A run folder never lies (issue 43): after a rerun with trainer.resume=false, a fallback from a damaged `latest` and
a refused run, the folder's `latest`, config.json and hf_export agree (or the run was refused before it wrote
anything), scripts/export_hf.py exports what `latest` names, and a resume continues that run.

One run (4 steps, checkpoints at 2 and 4, an export) is copied for each case; every later run and export reads the
copy, as a user's commands would read the folder. Then the other files a run folder holds: the eval script's score
and the task it names, a fresh run reading its weights from the folder it would move, and W&B after a resume.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_harness import run_ranks
from test_engine import BASE, ROOT, _free_port, train

from engine.checkpoints import manifest
from engine.observe.tracking import read_metrics

sys.path.insert(0, str(ROOT / "scripts"))

# linear decay over 4 steps: the last step's lr is the floor (README: "decays to lr * min_lr_ratio at max_steps")
FIRST = ["parallelism.cp=2", "trainer.max_steps=4", "trainer.save_every=2", "trainer.save_at_end=true",
         "trainer.export_hf=true", "trainer.lr_decay=linear", "trainer.min_lr_ratio=0.1"]
# what the later runs change: no save inside the loop at step 4, so only the end-of-run save can write it
AGAIN = [o for o in FIRST if not o.startswith("trainer.save_every")]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("first")
    rows = train(root, "run", 2, FIRST)
    assert rows[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # BASE's trainer.lr at the floor on the last step
    return root / "run", rows


def _copy(first, tmp_path):
    shutil.copytree(first[0], tmp_path / "run")
    return tmp_path / "run"


def _config(run):
    return json.loads((run / "config.json").read_text())


def _latest(run):
    return (run / "checkpoints" / "latest").read_text().strip()


def _export_latest(run, out):
    """scripts/export_hf.py <run> as a user runs it: the checkpoint `latest` names."""
    from export_hf import main as export_main
    export_main([str(run), "--out", str(out)])
    return out


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


def assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def assert_folder_agrees(run, step):
    """`latest`, config.json, the checkpoint's own config and hf_export all speak of one run at `step`."""
    tag = f"step_{step:08d}"
    assert _latest(run) == tag
    assert manifest.verify(run / "checkpoints" / tag, 0) == []  # intact
    config = _config(run)
    assert json.loads((run / "checkpoints" / tag / "config.json").read_text()) == config
    record = json.loads((run / "hf_export" / "training.json").read_text())
    assert (record["step"], record["checkpoint"], record["config"]) == (step, tag, config["config"])
    assert_same_weights(_export_latest(run, run.parent / f"exported_{tag}"), run / "hf_export")


def test_a_rerun_with_resume_false_replaces_the_earlier_run_and_a_resume_continues_it(first, tmp_path):
    run = _copy(first, tmp_path)
    (run / "previous").mkdir()  # the run before that one, moved aside by an earlier restart
    (run / "previous" / "config.json").write_text("{}")
    other = ["trainer.lr=1e-3", "run.seed=1"]
    rows = train(tmp_path, "run", 2, AGAIN + other + ["trainer.resume=false"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _config(run)["config"]["trainer"]["lr"] == 1e-3
    assert_folder_agrees(run, 4)
    # the earlier run is kept whole, apart: never `latest`, a fallback's older checkpoint, or this run's export
    kept = run / "previous"
    assert sorted(p.name for p in (kept / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert not list((run / "checkpoints").glob("step_00000002"))
    assert _config(kept)["config"]["trainer"]["lr"] == 3e-3 and (kept / "hf_export").is_dir()
    assert read_metrics(kept / "metrics.jsonl") == first[1]
    assert (kept / "previous" / "config.json").read_text() == "{}"  # nothing deleted: the one before, inside

    # extending it continues this run (seed 1): the earlier run's checkpoint would be refused for its seed
    more = train(tmp_path, "run", 2, AGAIN + other + ["trainer.max_steps=5"])
    assert [r["step"] for r in more] == [1, 2, 3, 4, 5] and more[:4] == rows
    assert_folder_agrees(run, 5)
    assert json.loads((run / "hf_export_step_00000004" / "training.json").read_text())["step"] == 4


def test_a_fallback_from_a_damaged_latest_leaves_latest_naming_one_that_verifies(first, tmp_path, capsys):
    run = _copy(first, tmp_path)
    cut = run / "checkpoints" / "step_00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    cut.write_bytes(cut.read_bytes()[:1000])  # a copy cut short
    with pytest.raises(SystemExit, match="2"):  # the manifest's verdict, not torch's error deep inside the load
        _export_latest(run, tmp_path / "not_exported")
    assert f"step_00000004 is damaged: {cut.name}: 1000 bytes on disk" in capsys.readouterr().err
    # the fallback run stops before it saves step 4 again (a killed or stop_after_steps run)
    train(tmp_path, "run", 2, AGAIN + ["trainer.stop_after_steps=3"])
    assert _latest(run) == "step_00000002"
    assert (run / "checkpoints" / "damaged_step_00000004").is_dir()
    exported = _export_latest(run, tmp_path / "exported")
    assert json.loads((exported / "training.json").read_text())["step"] == 2
    assert not (run / "hf_export").exists()  # the first run's step-4 export: renamed, this run trains past step 2
    assert (run / "hf_export_step_00000004").is_dir()

    rows = train(tmp_path, "run", 2, AGAIN)  # and on to the end
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in first[1]]
    assert_folder_agrees(run, 4)


def test_a_refused_run_writes_nothing_and_says_why_once(first, tmp_path):
    run = _copy(first, tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "scripts" / "train.py")] + BASE + FIRST + [f"run.out_dir={run}", "model=tiny_moe",
                                                               "parallelism.ep=2", "moe.dispatcher=alltoall"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert said.count("refused: the checkpoint in run.out_dir was written by a different run (model.family: "
                      "checkpoint 'llama' vs now 'qwen3_moe'") == 1, said[-4000:]
    ours = said.split("torch/distributed/elastic")[0]  # torchrun's own report of the failed ranks comes after
    assert "Traceback" not in ours and "Error executing job" not in ours, ours
    assert len(said.encode()) < 8000, said  # torchrun's own report is about 2.5 KB of it
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    assert_folder_agrees(run, 4)  # the dense run's folder, exported as the dense run
    more = train(tmp_path, "run", 2, AGAIN + ["trainer.max_steps=5"])
    assert [r["step"] for r in more] == [1, 2, 3, 4, 5]
    assert_folder_agrees(run, 5)


# a passkey task away from data=passkey's defaults (5-digit keys in corpus filler), which an HF folder would get
TASK = ["data=passkey", "data.seq_len=96", "data.num_samples=16", "data.passkey.key_length=2",
        "data.passkey.filler=repeat", "data.passkey.eval_depths=[0.5]", "data.passkey.eval_samples_per_cell=1",
        "data.eval_samples=2", "trainer.eval_every=1"]


def _score(rank, world, target):
    import eval_retrieval
    eval_retrieval.run(eval_retrieval.compose([f"target={target}", "device=cpu", "lengths=[96]", "depths=[0.5]",
                                               "samples_per_cell=1"]))


def test_the_eval_script_scores_the_task_the_export_records_and_keeps_the_runs_score(tmp_path):
    import eval_retrieval
    train(tmp_path, "pk", 1, TASK + ["parallelism.cp=1", "trainer.max_steps=1", "trainer.export_hf=true"])
    run = tmp_path / "pk"
    trained = (run / "retrieval.json").read_text()  # the training-time score, at step 1
    cfg = eval_retrieval.compose([f"target={run / 'hf_export'}", "device=cpu"])
    _, task, _, _, out_dir, scored = eval_retrieval.resolve(cfg, 1)  # an HF folder: the task from its training.json
    assert (task.cfg.key_length, task.cfg.filler) == (2, "repeat")
    assert scored["task"]["key_length"] == 2 and scored["step"] == 1 and "training.json" in scored["task_from"]
    assert out_dir == run / "hf_export" / "eval_retrieval"

    run_ranks(_score, 1, str(run))  # a run dir: scores its export, next to the run's own score, not over it
    assert (run / "retrieval.json").read_text() == trained
    result = json.loads((run / "eval_retrieval" / "retrieval.json").read_text())
    assert result["task"]["key_length"] == 2 and result["task"]["filler"] == "repeat" and result["step"] == 1


def test_a_fresh_run_that_reads_its_weights_from_the_earlier_runs_export_is_refused(tmp_path):
    from engine.run.folder import check_fresh_start
    from engine.run.refusal import Refused
    (tmp_path / "hf_export").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(Refused, match=r"model.path=.*hf_export is hf_export of the earlier run .*new run.out_dir"):
        check_fresh_start(tmp_path, str(tmp_path / "hf_export"))
    check_fresh_start(tmp_path, str(tmp_path.parent / "elsewhere"))  # anywhere else: the move is the run's to make
    (tmp_path / "previous.tmp").mkdir()  # a move into previous/ that a crash cut short: its files are there alone
    with pytest.raises(Refused, match=r"previous.tmp holds an earlier run's outputs .* rename it"):
        check_fresh_start(tmp_path)


def test_wandb_goes_on_in_a_new_run_when_a_resumed_step_differs_from_the_one_it_holds(tmp_path, monkeypatch):
    from types import SimpleNamespace
    from engine.observe.tracking import Tracker
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))  # no credentials anywhere
    cfg = SimpleNamespace(progress_bar=False, log_every=1,
                          wandb=SimpleNamespace(mode="offline", project="t", entity=None, name="t", dir=None))

    def row(step, loss):
        return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec_per_gpu": 1.0}
    first = Tracker(tmp_path, cfg, True, 3, 0, {})
    for step in (1, 2, 3):  # killed after step 3; the checkpoint is step 1's
        first.log(row(step, float(step)))
    first.close()
    resumed = Tracker(tmp_path, cfg, True, 3, 1, {})
    resumed.log(row(2, 2.0))  # the same numbers again: W&B's are right, the same run goes on
    assert resumed.wandb_run.id == first.wandb_run.id
    resumed.log(row(3, 9.0))  # another value (a changed lr, say): W&B would keep 3.0 under step 3
    assert resumed.wandb_run.id != first.wandb_run.id
    assert resumed.wandb_run.config["resumed_from"] == {"wandb_run": first.wandb_run.id, "step": 2}
    resumed.close()
    assert (tmp_path / "wandb_run_id").read_text().strip() == resumed.wandb_run.id
