"""Where step metrics go: metrics.jsonl (docs/design.md §3), a rank-0 progress bar, and W&B.

Only rank 0 writes. W&B runs in `disabled` or `offline` mode unless the user asks for `online`, and
never prompts for a login: `online` without credentials is an error at start-up, not a prompt.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, out_dir: Path, cfg, is_main: bool, total_steps: int, start_step: int, config_dict: dict):
        self.is_main = is_main
        self.path = out_dir / "metrics.jsonl"
        self.bar = None
        self.wandb_run = None
        if not is_main:
            return
        _continue_metrics_at(self.path, start_step)
        if cfg.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.wandb_run = _start_wandb(cfg.wandb, config_dict, out_dir, start_step)
        self.log_every = max(1, cfg.log_every)

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec_per_gpu']:.0f}")
        if self.wandb_run is not None and record["step"] % self.log_every == 0:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _continue_metrics_at(path: Path, start_step: int) -> None:
    """Make metrics.jsonl hold exactly the steps before this run's first, so that one file is one trajectory.

    A run resumed from step k keeps rows 1..k and drops later ones (steps past the last checkpoint that are
    about to run again); a fresh run (k = 0) moves an older run's file aside to metrics.prev.jsonl. Appending
    would mix two trajectories, or repeat steps, in the file that plots and benchmarks read."""
    if not path.exists():
        return
    if start_step == 0:
        os.replace(path, path.with_name("metrics.prev.jsonl"))
        log.warning("run.out_dir held metrics of an earlier run: moved to metrics.prev.jsonl")
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _step_of(line) <= start_step]
    if len(kept) < len(lines):
        tmp = path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        log.warning("metrics.jsonl: dropped %d rows after step %d, which this resumed run computes again",
                    len(lines) - len(kept), start_step)


def _step_of(line: str) -> float:
    """A row's step; a line torn by a crash mid-write counts as past every step, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _start_wandb(wcfg, config_dict: dict, out_dir: Path, start_step: int = 0):
    """A resumed run (start_step > 0) continues the W&B run of the run it resumes, whose id out_dir keeps,
    so one run's charts hold one trajectory. Steps that run again after the checkpoint are dropped by W&B,
    which keeps the values it logged first; a resume is exact, so they are the same numbers."""
    if wcfg.mode == "disabled":
        return None
    if wcfg.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        raise RuntimeError("logging.wandb.mode=online needs WANDB_API_KEY in the environment (no login "
                           "prompt is shown); use logging.wandb.mode=offline and `wandb sync` later")
    import wandb
    id_file = out_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if start_step > 0 and id_file.exists() else None
    run = wandb.init(project=wcfg.project, entity=wcfg.entity, name=wcfg.name, mode=wcfg.mode,
                     dir=str(wcfg.dir or out_dir), config=config_dict, id=run_id,
                     resume="allow" if run_id else None, settings=wandb.Settings(silent=True))
    id_file.write_text(run.id + "\n")
    return run
