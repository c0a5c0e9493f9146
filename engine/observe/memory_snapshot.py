"""One training step under the CUDA allocator's history: what is alive at the step's memory peak, and where it came from.

`logging.memory_snapshot_step=N` records every allocation and free of step N (1-based) on every rank and writes,
under run.out_dir, `memory_step{N}_rank{r}.pickle` (torch's snapshot: open it at https://pytorch.org/memory_viz) and
`memory_step{N}_rank{r}.txt`: the step's peak of allocated memory, what was allocated before the step began (weights,
gradients, optimizer states, DeepSpeed's buffers), and the step's own allocations still alive at that peak, summed
by the Python line that made them. That table is what a peak is read from: which tensor of which module holds it.

torch.profiler's memory view needs a GUI and torch's snapshot alone gives every block of the step; the peak's live
set by allocation site is computed here from the snapshot's trace (`live_at_peak`), a pure function of its dict.
CUDA only: the history is the CUDA caching allocator's (refused elsewhere before the run starts).
"""
from __future__ import annotations

import pickle
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from configs.errors import ConfigError

GIB = 2 ** 30
MAX_ENTRIES = 1_000_000  # trace events kept; a 16k step of a 1B model with recompute makes about 60k
# frames skipped when naming an allocation's site: torch's own Python, which allocates on behalf of its caller
_INTERNAL = ("/torch/", "\\torch\\", "<frozen")
_KEEP_FROM = ("site-packages/", "dist-packages/")


def check_device(step: int, device: torch.device) -> None:
    if step and device.type != "cuda":
        raise ConfigError(f"logging.memory_snapshot_step={step} records the CUDA allocator's history; this run is on "
                          f"{device.type}: set logging.memory_snapshot_step=0 (logging.profile_step profiles on any "
                          "device)")


def _site(frames: list) -> str:
    """The innermost frame outside torch's own Python, as `path:line function` (path from the package root)."""
    for f in frames:
        name = f.get("filename", "")
        if name and not any(s in name for s in _INTERNAL):
            for marker in _KEEP_FROM:
                if marker in name:
                    name = name.split(marker, 1)[1]
                    break
            else:
                name = Path(name).name if Path(name).is_absolute() else name
            return f"{name}:{f.get('line', '?')} {f.get('name', '?')}"
    return "(torch internals or no Python frame)"


def live_at_peak(snapshot: dict, device: int, baseline_bytes: int) -> dict:
    """Replay device `device`'s trace: the peak of allocated bytes (baseline_bytes = allocated when recording began)
    and the recorded allocations alive at that moment, summed by site, largest first.

    A block counts from its `alloc` until its `free_requested` (the program let go of it); torch then logs the same
    block's `free_completed`, which must not count again. A block allocated before recording began (a gradient, an
    activation of the previous step) lowers the count when it is freed, so the peak is the allocator's own."""
    live: dict = {}
    requested: set = set()  # blocks whose free_requested was counted; their free_completed is not
    now = peak = baseline_bytes
    at_peak: dict = {}
    for ev in snapshot["device_traces"][device]:
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc":
            live[addr] = (ev["size"], ev.get("frames", []))
            requested.discard(addr)  # the address is in use again: its next free counts
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_requested" or (action == "free_completed" and addr not in requested):
            now -= live.pop(addr)[0] if addr in live else ev.get("size", 0)
            if action == "free_requested":
                requested.add(addr)
        elif action == "free_completed":
            requested.discard(addr)
    by_site: dict = {}
    for size, frames in at_peak.values():
        site = _site(frames)
        count, total = by_site.get(site, (0, 0))
        by_site[site] = (count + 1, total + size)
    rows = sorted(((total, count, site) for site, (count, total) in by_site.items()), reverse=True)
    return {"peak_bytes": peak, "baseline_bytes": baseline_bytes,
            "sites": [{"site": s, "tensors": c, "bytes": b} for b, c, s in rows]}


def report_text(result: dict, step: int, top: int = 25) -> str:
    lines = [f"step {step}: peak allocated {result['peak_bytes'] / GIB:.2f} GiB = allocated before the step "
             f"{result['baseline_bytes'] / GIB:.2f} GiB + the step's allocations alive at the peak "
             f"{(result['peak_bytes'] - result['baseline_bytes']) / GIB:.2f} GiB, by the line that allocated them:",
             f"{'GiB':>8} {'tensors':>8}  site"]
    for row in result["sites"][:top]:
        lines.append(f"{row['bytes'] / GIB:8.3f} {row['tensors']:8d}  {row['site']}")
    rest = result["sites"][top:]
    if rest:
        lines.append(f"{sum(r['bytes'] for r in rest) / GIB:8.3f} {sum(r['tensors'] for r in rest):8d}  "
                     f"({len(rest)} more sites)")
    return "\n".join(lines) + "\n"


@contextmanager
def _recorded(out_dir: Path, step: int, rank: int, device: torch.device):
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    # the allocator's own running peak, before and after: not reset, the run's peak_alloc_gib stays the run's
    peak_before = torch.cuda.max_memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
        allocator_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.memory._record_memory_history(enabled=None)
    stem = out_dir / f"memory_step{step}_rank{rank}"
    with open(stem.with_suffix(".pickle"), "wb") as f:
        pickle.dump(snapshot, f)
    result = live_at_peak(snapshot, device.index if device.index is not None else torch.cuda.current_device(),
                          baseline)
    check = (f"the allocator's own peak, {allocator_peak / GIB:.2f} GiB, was set in this step: the replay's equals it"
             if allocator_peak > peak_before else
             f"the run's peak so far, {peak_before / GIB:.2f} GiB, was set before this step (this step's is lower)")
    stem.with_suffix(".txt").write_text(report_text(result, step) + check + "\n")


def maybe_record_memory(snapshot_step: int, step: int, out_dir: Path, rank: int, device: torch.device):
    """The allocator's history around step `step` (1-based) if it is the configured one, else nothing."""
    if snapshot_step and step == snapshot_step:
        return _recorded(out_dir, step, rank, device)
    return nullcontext()
