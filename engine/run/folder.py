"""The run folder (run.out_dir): what a run writes there, and keeping it the record of one trajectory.

A run writes config.json (the resolved config and plan of the run that last started here), checkpoints/ (step_*/,
each with the config that wrote it, and `latest`), metrics.jsonl, loss.png, hf_export/ (with training.json: its step
and config), retrieval.json/.png (data=passkey evaluations), wandb_run_id, and the profile_*/memory_* files of
logging.profile_step / memory_snapshot_step; scripts/export_hf.py adds hf_export_<tag>/ and scripts/eval_retrieval.py
eval_retrieval/. They agree because:
- nothing is written before every refusal is checked: config.json once the model is built and the checkpoint
  loaded (engine/run/train.py), so a refused run leaves the folder as it was;
- a run that starts at step 0 (no checkpoint, or trainer.resume=false) first moves an earlier run's outputs into
  previous/ (and a previous/ already there into that one: nothing is deleted). Left in place, that run's
  checkpoints would stay `latest` where this run does not save the same steps, be a fallback's "older checkpoint"
  or a mix of two runs' files where it does, and its export, metrics and retrieval score would pass for this run's;
- a resumed run that will train past hf_export's step renames it hf_export_<tag> (the name scripts/export_hf.py
  gives an export of that checkpoint), and drops a retrieval score of a step it computes again, as metrics.jsonl
  drops those rows (engine/observe/tracking.py): hf_export is only ever the model the run ended with.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from ..checkpoints.checkpoint import tag_of
from ..checkpoints.export import read_record
from .refusal import Refused

log = logging.getLogger(__name__)

PREVIOUS = "previous"
STAGING = PREVIOUS + ".tmp"
# what a run (and the scripts that read it) write into run.out_dir; anything else there is the user's and stays
OUTPUTS = ("checkpoints", "config.json", "metrics.jsonl", "metrics.prev.jsonl", "loss.png", "retrieval.json",
           "retrieval.png", "eval_retrieval", "wandb_run_id")
OUTPUT_PATTERNS = ("hf_export*", "profile_step*_rank*", "memory_step*_rank*")


def earlier_outputs(out_dir: Path) -> list[Path]:
    found = {out_dir / name for name in OUTPUTS if (out_dir / name).exists()}
    found.update(p for pattern in OUTPUT_PATTERNS for p in out_dir.glob(pattern))
    return sorted(found)


def check_fresh_start(out_dir: Path, model_path: str | None = None) -> None:
    """A run about to start at step 0, before anything is built: refused when its weights are read from an earlier
    run's output there, which it would move (its config.json, checkpoints and export would name a folder gone), or
    when such a move was cut short."""
    staging = out_dir / STAGING
    if staging.exists():
        raise Refused(f"{staging} holds an earlier run's outputs that a run starting at step 0 was moving to "
                      f"{out_dir / PREVIOUS} when it stopped: rename it (e.g. to previous_interrupted) or delete it, "
                      "or use a new run.out_dir")
    source = Path(model_path).resolve() if model_path else None
    for path in earlier_outputs(out_dir) if source is not None else ():
        if source == path.resolve() or path.resolve() in source.parents:
            raise Refused(
                f"model.path={model_path} is {path.name} of the earlier run in run.out_dir={out_dir}, which this run, "
                f"starting at step 0, would move to {out_dir / PREVIOUS}: use a new run.out_dir for this run (or "
                "copy the export out of the folder first)")


def start_fresh(out_dir: Path, rank: int) -> None:
    """Every rank: rank 0 moves an earlier run's outputs into previous/. A previous/ already there (the run before
    that) moves inside it: nothing is deleted, and the warning says how much checkpoint data the folder keeps."""
    if rank == 0:
        moved = earlier_outputs(out_dir)
        if moved:
            staging = out_dir / STAGING  # then renamed whole: previous/ is the earlier run entire, or not there
            staging.mkdir()
            for path in moved + ([out_dir / PREVIOUS] if (out_dir / PREVIOUS).exists() else []):
                os.replace(path, staging / path.name)
            os.replace(staging, out_dir / PREVIOUS)
            kept = sum(p.stat().st_size for p in (out_dir / PREVIOUS).rglob("*") if p.is_file()
                       and "checkpoints" in p.relative_to(out_dir).parts)
            log.warning("run.out_dir held an earlier run (%s): moved to %s, with %.1f GiB of checkpoints there and "
                        "below (delete it when they are no longer needed); this run starts at step 0",
                        ", ".join(p.name for p in moved), out_dir / PREVIOUS, kept / 2**30)
    dist.barrier()


def continue_at(out_dir: Path, start: int, stop: int, rank: int) -> None:
    """Every rank, a run resumed at step `start` that trains to `stop`: what stops being true once it does."""
    if rank == 0 and start < stop:
        export = out_dir / "hf_export"
        if export.is_dir():
            step = (read_record(export) or {}).get("step")
            name = f"hf_export_{tag_of(step)}" if step is not None else f"hf_export_before_{tag_of(start)}"
            shutil.rmtree(out_dir / name, ignore_errors=True)  # the same checkpoint's export, written again
            os.replace(export, out_dir / name)
            log.info("hf_export renamed %s: this run trains past its step", name)
        score = out_dir / "retrieval.json"
        if score.exists() and json.loads(score.read_text()).get("step", 0) > start:
            for path in (score, out_dir / "retrieval.png"):
                path.unlink(missing_ok=True)
            log.info("retrieval.json dropped: its step is past %s, which this run computes again", tag_of(start))
    dist.barrier()


def write_config(out_dir: Path, run_config: dict) -> None:
    """Rank 0: config.json, the resolved config and plan of the run now writing this folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(run_config, indent=2))
    os.replace(tmp, out_dir / "config.json")

