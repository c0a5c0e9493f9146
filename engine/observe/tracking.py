"""Where step metrics go: metrics.jsonl (docs/design.md §3), a rank-0 progress bar, and W&B.

Only rank 0 writes. W&B runs in `disabled` or `offline` mode unless the user asks for `online`, and
never prompts for a login: `online` without credentials is an error at start-up, not a prompt.

metrics.jsonl is strict JSON: Python's json writes an inf or NaN as the bare words Infinity / NaN, which strict
parsers (jq, JavaScript, Go, pandas' ujson) reject for the whole file. A non-finite number is written as null, and
the row's "nonfinite" object keeps what it was ({"grad_norm": "inf"}); read_metrics puts the floats back.

W&B keeps the first value it was sent for a step. A run resumed behind steps it had logged (a kill lost them) sends
them again; the same numbers when the resume is exact, other ones when a setting outside the resume check changed
(the lr, or max_steps and with it the schedule). At the first such step that differs, the run goes on in a new W&B
run (its config's resumed_from names the old run and the step), so no chart shows one trajectory's values under
another's steps.
"""
from __future__ import annotations

import json
import logging
import math
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
        self.dropped = _continue_metrics_at(self.path, start_step)  # step -> row, which W&B already holds
        if cfg.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.wandb_cfg, self.config_dict, self.out_dir = cfg.wandb, config_dict, out_dir
        self.wandb_run = _start_wandb(cfg.wandb, config_dict, out_dir, start_step)
        self.log_every = max(1, cfg.log_every)

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_row(record), allow_nan=False) + "\n")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec_per_gpu']:.0f}")
        if self.wandb_run is not None and _differs(self.dropped.pop(record["step"], None), record):
            self._new_wandb_run(record["step"])
        if self.wandb_run is not None and record["step"] % self.log_every == 0:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def _new_wandb_run(self, step: int) -> None:
        old = self.wandb_run.id
        self.wandb_run.finish()
        config = {**self.config_dict, "resumed_from": {"wandb_run": old, "step": step - 1}}
        self.wandb_run = _start_wandb(self.wandb_cfg, config, self.out_dir)
        self.dropped = {}
        log.warning("step %d: W&B run %s holds other values for this step, logged before the resumed checkpoint and "
                    "kept by W&B (it keeps a step's first); from here on the run logs to the new W&B run %s",
                    step, old, self.wandb_run.id)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def strict_row(record: dict) -> dict:
    """The row with each inf/NaN as null, named in "nonfinite" (dotted, inside a nested object) with its value as
    text."""
    bad = {}

    def clean(value, path):
        if isinstance(value, float) and not math.isfinite(value):
            bad[path] = str(value)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value
    row = {k: clean(v, k) for k, v in record.items()}
    return {**row, "nonfinite": bad} if bad else row


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's rows, with the non-finite numbers of strict_row as floats again."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            for dotted, text in row.pop("nonfinite", {}).items():
                *outer, last = dotted.split(".")
                node = row
                for key in outer:
                    node = node[int(key) if isinstance(node, list) else key]
                node[int(last) if isinstance(node, list) else last] = float(text)
            rows.append(row)
    return rows


def _differs(dropped: dict | None, record: dict) -> bool:
    """A step logged before (and dropped from metrics.jsonl) computed again with other numbers."""
    if dropped is None:
        return False
    again = strict_row(record)
    return any(dropped.get(k) != again.get(k) for k in ("loss", "grad_norm", "lr"))


def _continue_metrics_at(path: Path, start_step: int) -> dict:
    """Make metrics.jsonl hold exactly the steps before this run's first, so that one file is one trajectory.

    A run resumed from step k keeps rows 1..k and drops later ones (steps past the last checkpoint that are
    about to run again); a fresh run (k = 0) moves an older run's file aside to metrics.prev.jsonl (a training
    run has moved the whole earlier run to previous/ before, engine/run/folder.py). Appending would mix two
    trajectories, or repeat steps, in the file that plots and benchmarks read. Returns the dropped rows by step:
    W&B holds them already."""
    if not path.exists():
        return {}
    if start_step == 0:
        os.replace(path, path.with_name("metrics.prev.jsonl"))
        log.warning("run.out_dir held metrics of an earlier run: moved to metrics.prev.jsonl")
        return {}
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _step_of(line) <= start_step]
    dropped = {}
    for line in lines:
        if start_step < _step_of(line) < float("inf"):
            row = json.loads(line)
            dropped[row["step"]] = row
    if len(kept) < len(lines):
        tmp = path.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        log.warning("metrics.jsonl: dropped %d rows after step %d, which this resumed run computes again",
                    len(lines) - len(kept), start_step)
    return dropped


def _step_of(line: str) -> float:
    """A row's step; a line torn by a crash mid-write counts as past every step, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _start_wandb(wcfg, config_dict: dict, out_dir: Path, start_step: int = 0):
    """A resumed run (start_step > 0) continues the W&B run of the run it resumes, whose id out_dir keeps,
    so one run's charts hold one trajectory. Steps that run again after the checkpoint are dropped by W&B,
    which keeps the values it logged first; a resume is exact, so they are the same numbers unless a setting
    changed, and then Tracker.log goes on in a new W&B run."""
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
