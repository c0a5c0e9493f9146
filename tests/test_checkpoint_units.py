"""Checkpoints that must never silently mislead a resume: a half-written save never becomes `latest`, pruning keeps
only complete ones, ZeRO-3 state is re-partitioned only when allowed, resume refuses another run's settings, the
manifest catches a flipped bit on every rank, and a damaged checkpoint falls back or stops by name."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_ranks
from engine.checkpoints import checkpoint
from engine.checkpoints.reshard import needs_reshard, optimizer_layout, steps_to_param_device


class _FailingEngine:
    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "half_written.pt").write_bytes(b"x")
        raise OSError("disk full")


def _partial_save(rank, world, out_dir):
    out_dir = Path(out_dir)
    root = checkpoint.ckpt_root(out_dir)
    root.mkdir(parents=True)
    (root / "latest").write_text("step_00000002\n")
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(_FailingEngine(), out_dir, 4, rank)
    assert checkpoint.latest_tag(out_dir) == "step_00000002"


def test_partially_written_checkpoint_never_becomes_latest(tmp_path):
    run_ranks(_partial_save, 1, str(tmp_path))


def test_keep_checkpoints_deletes_the_oldest_complete_ones_only(tmp_path):
    root = checkpoint.ckpt_root(tmp_path)
    for step in range(1, 6):
        (root / f"step_{step:08d}").mkdir(parents=True)
    assert checkpoint.prune(tmp_path, keep=2) == []  # no `latest` yet: nothing is known complete
    (root / "latest").write_text("step_00000004\n")  # step 5: a save a crash cut short
    assert checkpoint.prune(tmp_path, keep=0) == []
    assert checkpoint.prune(tmp_path, keep=2) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003", "step_00000004", "step_00000005"]
    assert checkpoint.prune(tmp_path, keep=1) == ["step_00000003"]
    assert checkpoint.latest_tag(tmp_path) == "step_00000004"


def test_resume_reshards_zero3_state_only_and_only_when_allowed(tmp_path):
    tag = checkpoint.ckpt_root(tmp_path) / "step_00000002"
    tag.mkdir(parents=True)
    assert not needs_reshard(tmp_path, tag.name, optimizer_layout(4, 3), allowed=True)  # older: no layout file
    (tag / checkpoint.LAYOUT_FILE).write_text(json.dumps(optimizer_layout(world_size=4, zero_stage=3)))
    assert not needs_reshard(tmp_path, tag.name, optimizer_layout(4, 3), allowed=True)
    assert needs_reshard(tmp_path, tag.name, optimizer_layout(2, 3), allowed=True)
    refusals = {"trainer.reshard_on_resume=false": (optimizer_layout(2, 3), False),
                "re-partitioned only into ZeRO-3": (optimizer_layout(1, 2), True)}
    for why, (layout, allowed) in refusals.items():
        with pytest.raises(RuntimeError, match=r"ZeRO-3 optimizer state partitioned over 4 rank\(s\)") as err:
            needs_reshard(tmp_path, tag.name, layout, allowed)
        assert why in str(err.value) and "scripts/export_hf.py" in str(err.value)
    (tag / checkpoint.LAYOUT_FILE).write_text(json.dumps(optimizer_layout(world_size=1, zero_stage=2)))
    assert needs_reshard(tmp_path, tag.name, optimizer_layout(2, 3), allowed=True)  # a 1-rank run, onto ZeRO-3


def test_adam_steps_move_to_their_parameters_device():
    # after a universal load on GPUs, Adam's step sits on the CPU and fused AdamW refuses it; here "meta" stands
    # for the parameter's device, which a CPU-only machine lacks
    on_device, already = torch.zeros(3, device="meta"), torch.zeros(3)
    optimizer = SimpleNamespace(state={on_device: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3)},
                                       already: {"step": torch.tensor(7.0)}})
    assert steps_to_param_device(optimizer) == 1
    assert optimizer.state[on_device]["step"].device.type == "meta"
    assert optimizer.state[already]["step"].device.type == "cpu"


def test_resume_refuses_another_master_precision_and_reads_older_checkpoints_as_fp32():
    import dataclasses
    from configs import compose_config
    config = dataclasses.asdict(compose_config(["precision=bf16"]))
    fp32 = checkpoint.resume_fingerprint(config)
    config["deepspeed"]["master_weights"] = "bf16"
    bf16 = checkpoint.resume_fingerprint(config)
    with pytest.raises(RuntimeError, match="different run .deepspeed.master_weights: checkpoint 'fp32' vs now 'bf16'"):
        checkpoint.check_resume_compatible(fp32, bf16)
    older = {k: v for k, v in fp32.items() if k != "deepspeed.master_weights"}  # written before the key existed
    checkpoint.check_resume_compatible(older, fp32)
    with pytest.raises(RuntimeError, match="deepspeed.master_weights: checkpoint 'fp32' vs now 'bf16'"):
        checkpoint.check_resume_compatible(older, bf16)


def test_resume_reads_a_checkpoint_from_before_data_eval_samples_as_no_held_out_set():
    import dataclasses
    from configs import compose_config
    config = dataclasses.asdict(compose_config([]))
    now = checkpoint.resume_fingerprint(config)
    older = {**now, "data": {k: v for k, v in now["data"].items() if k != "eval_samples"}}
    checkpoint.check_resume_compatible(older, now)
    config["data"]["eval_path"] = "val.jsonl"  # a validation file does not change training: still resumes
    checkpoint.check_resume_compatible(older, checkpoint.resume_fingerprint(config))
    config["data"]["eval_samples"] = 8  # holding samples out changes the training order: refused
    with pytest.raises(RuntimeError, match=r"different run .data\.eval_samples: checkpoint 0 vs now 8"):
        checkpoint.check_resume_compatible(older, checkpoint.resume_fingerprint(config))


def test_manifest_files_are_shared_largest_first_onto_the_least_loaded_rank():
    from engine.checkpoints.manifest import share
    sizes = {"a": 10, "b": 7, "c": 5, "d": 1}  # by hand: a->0 (10), b->1 (7), c->1 (12), d->0 (11)
    assert (share(sizes, 0, 2), share(sizes, 1, 2)) == (["a", "d"], ["b", "c"])
    assert share(sizes, 0, 1) == ["a", "b", "c", "d"]


def _manifest_verdicts(rank, world, folder, out):
    import torch.distributed as dist
    from engine.checkpoints import manifest
    folder = Path(folder)
    verdicts = {"none": manifest.verify(folder, rank)}  # no manifest yet: written before manifests existed
    manifest.write(folder, rank)
    verdicts["intact"] = manifest.verify(folder, rank)
    for name in ("big.pt", "small.pt"):  # big is rank 0's to hash, small rank 1's: each verdict reaches both
        dist.barrier()
        if rank == 0:
            data = bytearray((folder / name).read_bytes())
            data[3] ^= 1  # one bit, the same size
            (folder / name).write_bytes(bytes(data))
        dist.barrier()
        verdicts[name] = manifest.verify(folder, rank)
        dist.barrier()
        if rank == 0:
            data[3] ^= 1
            (folder / name).write_bytes(bytes(data))
    torch.save(verdicts, Path(out) / f"verdicts{rank}.pt")


def test_manifest_verdict_is_every_ranks_and_catches_a_flipped_bit(tmp_path):
    folder = tmp_path / "step_00000001"
    (folder / "sub").mkdir(parents=True)
    (folder / "big.pt").write_bytes(b"b" * 1000)
    (folder / "small.pt").write_bytes(b"s" * 10)
    (folder / "sub" / "fingerprint.json").write_text("{}")
    run_ranks(_manifest_verdicts, 2, str(folder), str(tmp_path))
    want = {"none": None, "intact": [],
            "big.pt": ["big.pt: its bytes differ from those written (SHA-256 mismatch, same size)"],
            "small.pt": ["small.pt: its bytes differ from those written (SHA-256 mismatch, same size)"]}
    for rank in (0, 1):
        assert torch.load(tmp_path / f"verdicts{rank}.pt") == want, rank
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(files) == ["big.pt", "small.pt", "sub/fingerprint.json"]
    import hashlib  # the recorded digest is the file's plain SHA-256 (what sha256sum prints)
    assert files["big.pt"] == {"size": 1000, "sha256": hashlib.sha256(b"b" * 1000).hexdigest()}


def _resume_tags(rank, world, out_dir, out):
    out_dir = Path(out_dir)
    root = checkpoint.ckpt_root(out_dir)
    from engine.checkpoints import manifest
    got = {}
    for step in (2, 4, 6):
        (root / checkpoint.tag_of(step)).mkdir(parents=True)
        (root / checkpoint.tag_of(step) / "state.pt").write_bytes(b"x" * 100)
        manifest.write(root / checkpoint.tag_of(step), rank)
    (root / "latest").write_text("step_00000006\n")
    got["intact"] = checkpoint.resume_tag(out_dir, rank, "abort")
    (root / "step_00000006" / "state.pt").write_bytes(b"x" * 50)
    (root / "step_00000004" / "state.pt").unlink()
    got["fallback"] = checkpoint.resume_tag(out_dir, rank, "fallback")  # past step 4, which is damaged too
    for policy in ("abort", "fallback"):
        (root / "step_00000002" / "state.pt").write_bytes(b"y" * 100)
        try:
            checkpoint.resume_tag(out_dir, rank, policy)
        except checkpoint.DamagedCheckpoint as err:
            got[f"{policy} error"] = str(err)
    for name, latest in (("missing", "step_00000009\n"), ("empty", "")):
        (root / "latest").write_text(latest)  # a tag with no folder; a `latest` cut short
        try:
            checkpoint.resume_tag(out_dir, rank, "abort")
        except checkpoint.DamagedCheckpoint as err:
            got[f"{name} error"] = str(err)
    torch.save(got, out)


def test_resume_tag_falls_back_past_every_damaged_checkpoint_or_stops_naming_them(tmp_path):
    run_ranks(_resume_tags, 1, str(tmp_path), str(tmp_path / "got.pt"))
    got = torch.load(tmp_path / "got.pt")
    assert got["intact"] == "step_00000006"
    assert got["fallback"] == "step_00000002"
    assert "step_00000006 (named by checkpoints/latest) is damaged: state.pt: 50 bytes on disk, 100 when written" \
        in got["abort error"]
    assert "trainer.on_corrupt_checkpoint=fallback resumes from the newest older checkpoint that verifies (the " \
           "next older one is step_00000004)" in got["abort error"]
    assert "the older step_00000004 is damaged too: state.pt: cannot be read" in got["fallback error"]
    assert "the older step_00000002 is damaged too: state.pt: its bytes differ" in got["fallback error"]
    assert "found no older checkpoint that verifies; restore the checkpoint from a copy" in got["fallback error"]
    assert "step_00000009 (named by checkpoints/latest) is damaged: its folder" in got["missing error"]
    assert "latest holds '', not a checkpoint tag: write the tag of a complete checkpoint into it" in got["empty error"]


def test_on_corrupt_checkpoint_is_validated_and_defaults_to_fallback():
    from configs import ConfigError, compose_config, validate
    assert compose_config([]).trainer.on_corrupt_checkpoint == "fallback"
    validate(compose_config(["trainer.on_corrupt_checkpoint=abort", "parallelism.cp=1"]), 1)
    with pytest.raises(ConfigError, match=r"trainer.on_corrupt_checkpoint=skip is not one of .*set "
                                          r"trainer.on_corrupt_checkpoint to one of them"):
        validate(compose_config(["trainer.on_corrupt_checkpoint=skip", "parallelism.cp=1"]), 1)
