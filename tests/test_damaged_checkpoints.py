"""A damaged newest checkpoint, end to end (gloo, world 2): the error names the checkpoint and the file
(trainer.on_corrupt_checkpoint=abort), or the run resumes from the previous checkpoint and continues its
trajectory exactly (fallback, the default).

One run saves step 2 and step 4, then each test damages a copy of it. The run went on uninterrupted from step
2 to 4, so its own rows for steps 3 and 4 are the trajectory a fallback to step 2 must repeat bit for bit.
"""
import json
import logging
import re
import shutil

import pytest

from dist_harness import run_ranks
from test_engine import BASE, _run, train

CP2 = ["parallelism.cp=2", "trainer.stop_after_steps=4"]
NEWEST = "step_00000004"
DAMAGES = {  # the three kinds of file that failed with a raw traceback before the manifest
    "optimizer_shard": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "model_state": "zero_pp_rank_0_mp_rank_00_model_states.pt",
    "fingerprint": "resume_fingerprint.json",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    rows = train(root, "run", 2, CP2 + ["trainer.save_every=2"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (root / "run" / "checkpoints" / "latest").read_text().strip() == NEWEST
    return root / "run", rows


def _copy_and_cut(saved_dir, tmp_path, name):
    shutil.copytree(saved_dir, tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / NEWEST / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy cut short
    return path


def _run_logging_checkpoints(rank, world, overrides, log_file):
    # pytest's own handler holds the forked ranks' records, so rank 0 writes engine/checkpoints/checkpoint.py's to a file
    if rank == 0:
        logger = logging.getLogger("engine.checkpoints.checkpoint")
        logger.addHandler(logging.FileHandler(log_file))
        logger.setLevel(logging.INFO)
    _run(rank, world, overrides)


def train_logged(tmp_path, name, world, extra):
    """train(), and what engine/checkpoints/checkpoint.py logged on rank 0."""
    out, log_file = tmp_path / name, tmp_path / f"{name}.checkpoint.log"
    log_file.write_text("")
    run_ranks(_run_logging_checkpoints, world, BASE + [f"run.out_dir={out}"] + extra, str(log_file))
    return _rows(out), log_file.read_text()


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("what", sorted(DAMAGES))
def test_a_cut_file_is_named_or_the_run_falls_back_and_continues_exactly(saved, tmp_path, what):
    saved_dir, uninterrupted = saved
    name = DAMAGES[what]
    _copy_and_cut(saved_dir, tmp_path, name)
    with pytest.raises(Exception, match=f"checkpoint .*{NEWEST} .*is damaged: {re.escape(name)}: "
                                        r"\d+ bytes on disk, \d+ when written"):
        train(tmp_path, "run", 2, CP2 + ["trainer.on_corrupt_checkpoint=abort"])
    assert _rows(tmp_path / "run") == uninterrupted  # refused before anything was loaded or logged
    resumed, logged = train_logged(tmp_path, "run", 2, CP2)  # the default: fallback
    assert f"{NEWEST} (named by checkpoints/latest) is damaged: {name}" in logged
    assert "trainer.on_corrupt_checkpoint=fallback: resuming from step_00000002 instead" in logged
    assert resumed[:2] == uninterrupted[:2]  # kept, step times and all: resumed at step 2, not started over
    for got, ref in zip(resumed[2:], uninterrupted[2:]):
        assert (got["loss"], got["grad_norm"]) == (ref["loss"], ref["grad_norm"]), (got["step"], got, ref)


def test_a_checkpoint_without_a_manifest_is_loaded_and_a_failed_read_names_the_file(saved, tmp_path):
    saved_dir, _ = saved
    cut = _copy_and_cut(saved_dir, tmp_path, DAMAGES["optimizer_shard"])
    (cut.parent / "manifest.json").unlink()  # as a checkpoint written before manifests existed
    with pytest.raises(Exception, match=f"checkpoint .*{NEWEST}: reading .*{re.escape(cut.name)} failed on rank 1"):
        train_logged(tmp_path, "run", 2, CP2)
    logged = (tmp_path / "run.checkpoint.log").read_text()
    assert f"checkpoint {NEWEST} has no manifest.json (written before manifests existed)" in logged
