"""One training step under torch.profiler: where a step's time goes, kernel by kernel.

`logging.profile_step=N` profiles step N (1-based) on every rank and writes, under run.out_dir,
`profile_step{N}_rank{r}.json` (a Chrome/Perfetto trace) and `profile_step{N}_rank{r}.txt` (the ops by
self device time on GPU, self CPU time on CPU). The phases of engine/run/step.py appear in both as
`phase.forward`, `phase.backward` and `phase.optimizer`. Only that one step pays the profiler's overhead:
its metrics line is marked `"profiled": true` so that nobody reads its step time as a normal one.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def phase(name: str):
    """A named range in the profiler's trace (costs nothing measurable when no profiler runs)."""
    return record_function(f"phase.{name}")


@contextmanager
def _profiled(out_dir: Path, step: int, rank: int, device: torch.device):
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    stem = out_dir / f"profile_step{step}_rank{rank}"
    prof.export_chrome_trace(str(stem.with_suffix(".json")))
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    stem.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=50))


def maybe_profile(profile_step: int, step: int, out_dir: Path, rank: int, device: torch.device):
    """The profiler around step `step` (1-based) if it is the configured one, else nothing."""
    if profile_step and step == profile_step:
        return _profiled(out_dir, step, rank, device)
    return nullcontext()
