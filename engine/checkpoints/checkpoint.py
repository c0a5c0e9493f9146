"""Save, find and resume checkpoints (HF exports: engine/checkpoints/export.py).

Layout under <run.out_dir>/checkpoints/:  step_00000004/ (DeepSpeed's files + rng_rank<r>.pt) and
`latest`, a one-line file naming the newest COMPLETE tag. `latest` is replaced atomically by rank 0
only after every rank has finished writing (a barrier), so a crash mid-save leaves the previous
checkpoint as latest. With `trainer.keep_checkpoints=N`, rank 0 then deletes all but the newest N
complete checkpoints (a 1B model's ZeRO state with fp32 masters is ~20 GB, an 8B's ~130 GB, so a long run
with save_every would otherwise fill its disk and die in a save). Like `latest`, this assumes out_dir is on
one filesystem that all ranks share. The data order is a pure function of (seed, step) (engine/data/sampler.py), so
the step number, DeepSpeed's optimizer/scheduler state and the RNG states are all a resume needs.

Before `latest` moves, the ranks write the checkpoint's manifest (engine/checkpoints/manifest.py: each file's size and
SHA-256). A resume verifies it before reading anything else; a damaged checkpoint stops the run naming the
file (trainer.on_corrupt_checkpoint=abort) or the run resumes from the newest older checkpoint that verifies
(fallback). Either way every rank takes the same branch, from the verdicts of all of them. Going back is exact
for the same reason a resume is: the steps since that checkpoint are computed again, identically.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..run.refusal import Refused
from . import manifest

log = logging.getLogger(__name__)


LAYOUT_FILE = "optimizer_layout.json"  # what the saved ZeRO state is partitioned for (engine/checkpoints/reshard.py)
# the resolved config of the run that wrote the checkpoint: what an export of it builds (the run folder's config.json
# is the latest run's, which may be another layout, e.g. after a resume on other ranks)
CONFIG_FILE = "config.json"
DAMAGED_PREFIX = "damaged_"  # a damaged checkpoint a fallback stepped over, kept for a look but never resumed
_FIX = ("restore the checkpoint from a copy, point checkpoints/latest at an older tag, or start over with "
        "trainer.resume=false or a new run.out_dir")


class DamagedCheckpoint(Refused):
    """A checkpoint file that is missing, cut short, or holds other bytes than were written."""


class ResumeRefused(Refused):
    """The checkpoint in run.out_dir cannot continue this run (other settings, or a layout it cannot load into)."""


def tag_of(step: int) -> str:
    return f"step_{step:08d}"  # zero-padded, so tags sort by step (prune relies on it)


def ckpt_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def latest_tag(out_dir: Path) -> Optional[str]:
    path = ckpt_root(out_dir) / "latest"
    return path.read_text().strip() if path.exists() else None


# the settings a resumed run must share with the run that wrote the checkpoint, or its trajectory silently
# becomes another run's: the weights' shape and source, the data and its order, the batch, the precision of
# the weights and of the optimizer's master copy (DeepSpeed would cast the saved one to the other silently)
RESUME_KEYS = ("model", "data", "run.seed", "trainer.global_batch_size", "precision", "deepspeed.master_weights")
# keys added to RESUME_KEYS later, or fields added later inside a RESUME_KEYS section (a dict, e.g. "data"):
# a fingerprint written before one existed ran with its default
_DEFAULT_WHEN_ABSENT = {"deepspeed.master_weights": "fp32", "data.eval_samples": 0}
# fields inside a RESUME_KEYS section that do not change the training trajectory: adding a validation file
# to a run must not stop it from resuming
_NOT_TRAJECTORY = {"data": ("eval_path",)}


def _pick(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def resume_fingerprint(config: dict) -> dict:
    picked = {key: _pick(config, key) for key in RESUME_KEYS}
    for section, fields in _NOT_TRAJECTORY.items():
        picked[section] = {k: v for k, v in picked[section].items() if k not in fields}
    return picked


def check_resume_compatible(saved: dict, current: dict) -> None:
    saved = dict(saved)
    for dotted, default in _DEFAULT_WHEN_ABSENT.items():
        section, _, field = dotted.partition(".")
        if dotted in RESUME_KEYS:
            saved.setdefault(dotted, default)
        elif isinstance(saved.get(section), dict):
            saved[section] = {field: default, **saved[section]}
    diffs = [key for key in RESUME_KEYS if saved.get(key) != current.get(key)]
    if diffs:
        leaves = [line for key in diffs for line in _leaf_diffs(key, saved.get(key), current.get(key))]
        leaves.sort(key=lambda line: line.split(":")[0].count("."))  # model.family before model.arch.<key>
        shown = "; ".join(leaves[:4]) + (f"; and {len(leaves) - 4} more" if len(leaves) > 4 else "")
        raise ResumeRefused(f"the checkpoint in run.out_dir was written by a different run ({shown}). Resuming would "
                            "silently continue another trajectory: use a new run.out_dir, or trainer.resume=false "
                            "to start over there (the earlier run's outputs move to <run.out_dir>/previous)")


_ABSENT = object()


def _leaf_diffs(key: str, saved, now) -> list[str]:
    """`model.arch.num_experts: checkpoint absent vs now 8`, one line per differing leaf (a section's dump would
    bury the one key that differs in kilobytes)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [line for k in sorted(set(saved) | set(now), key=str)
                for line in _leaf_diffs(f"{key}.{k}", saved.get(k, _ABSENT), now.get(k, _ABSENT))]
    if saved == now:
        return []
    show = lambda v: "absent" if v is _ABSENT else repr(v)  # noqa: E731
    return [f"{key}: checkpoint {show(saved)} vs now {show(now)}"]


def save(engine, out_dir: Path, step: int, rank: int, fingerprint: dict | None = None, keep: int = 0,
         layout: dict | None = None, config: dict | None = None, extra: dict | None = None) -> str:
    """`layout`: engine/checkpoints/reshard.py's optimizer_layout, which a resume on other ranks is checked against;
    `config`: the run's resolved config (and plan), which an export of this checkpoint builds its model from;
    `extra`: run state outside the module and optimizer, the same on every rank (fp8.recipe=delayed's amax history),
    by name: rank 0 writes each to `<name>.pt`, outside the module's state dict, so no HF export carries it."""
    tag = tag_of(step)
    root = ckpt_root(out_dir)
    if rank == 0 and (root / tag).exists() and latest_tag(out_dir) != tag:
        # a save of this step that a crash cut short, or a damaged one a fallback stepped over: files of it that
        # this save does not write (another world size's shards) would join this checkpoint's manifest
        shutil.rmtree(root / tag)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, root / tag / f"rng_rank{rank}.pt")
    if rank == 0 and fingerprint is not None:
        (root / tag / "resume_fingerprint.json").write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
    if rank == 0 and layout is not None:
        (root / tag / LAYOUT_FILE).write_text(json.dumps(layout, sort_keys=True))
    if rank == 0 and config is not None:
        (root / tag / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    for name, state in (extra or {}).items() if rank == 0 else ():
        torch.save(state, root / tag / f"{name}.pt")
    dist.barrier()
    manifest.write(root / tag, rank)  # before `latest` moves: a checkpoint named there always has one
    if rank == 0:
        point_latest(out_dir, tag)
        log.info("checkpoint %s saved", tag)
        removed = prune(out_dir, keep)
        if removed:
            log.info("deleted older checkpoints %s (trainer.keep_checkpoints=%d)", ", ".join(removed), keep)
    dist.barrier()
    return tag


def point_latest(out_dir: Path, tag: str) -> None:
    """Rank 0: `latest` names `tag`, replaced atomically (a crash leaves the old name or the new, never half)."""
    root = ckpt_root(out_dir)
    tmp = root / "latest.tmp"
    tmp.write_text(tag + "\n")
    os.replace(tmp, root / "latest")


def settle_fallback(out_dir: Path, tag: str, rank: int) -> list[str]:
    """After a fallback resumed from `tag` (every rank, once it loaded): the damaged checkpoints it stepped over, up
    to the old `latest`, become damaged_<tag> and `latest` names `tag`. Else `latest` would keep naming a damaged
    checkpoint until this run saves that step again: a run stopped before (or that never saves it) leaves an export
    or a resume of `latest` reading the damaged files, and pruning counting them. Returns the renamed tags."""
    moved = []
    if rank == 0:
        root, old = ckpt_root(out_dir), latest_tag(out_dir)
        for path in sorted(root.glob("step_*")):
            if path.is_dir() and tag < path.name <= old:
                target = root / (DAMAGED_PREFIX + path.name)
                shutil.rmtree(target, ignore_errors=True)  # an older fallback's copy of the same step
                os.replace(path, target)
                moved.append(path.name)
        point_latest(out_dir, tag)
        if moved:
            log.warning("checkpoints/latest now names %s; the damaged %s renamed %s (not resumed, exported or pruned)",
                        tag, ", ".join(moved), ", ".join(DAMAGED_PREFIX + m for m in moved))
    dist.barrier()
    return moved


def prune(out_dir: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints, `latest` among them; 0 keeps every one."""
    latest = latest_tag(out_dir)
    if keep <= 0 or latest is None:
        return []
    root = ckpt_root(out_dir)
    # tags are zero-padded step numbers, so they sort by step. A tag newer than `latest` is a save that a
    # crash cut short: it is not counted as complete and not deleted (the resumed run's save of that step
    # overwrites it)
    complete = sorted(p.name for p in root.glob("step_*") if p.is_dir() and p.name <= latest)
    doomed = complete[:-keep]
    for tag in doomed:
        shutil.rmtree(root / tag)
    return doomed


def read_json(path: Path):
    """A checkpoint's JSON file, or an error naming it (a checkpoint without a manifest is read unverified)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"checkpoint file {path} cannot be read ({type(err).__name__}: {err}); "
                                f"{_FIX}") from err


def resume_tag(out_dir: Path, rank: int, policy: str) -> Optional[str]:
    """The checkpoint to resume from, verified; None when there is none. Every rank must call it together.

    `latest` when it verifies (or has no manifest: written before manifests existed, accepted with a log
    line). Damaged: policy abort raises naming the files; fallback returns the newest older one that
    verifies, with a warning, or raises when none does."""
    tag = latest_tag(out_dir)
    if tag is None:
        return None
    root = ckpt_root(out_dir)
    if not tag.startswith("step_"):  # `latest` itself cut short: which saves completed is unknown
        raise DamagedCheckpoint(f"{root / 'latest'} holds {tag!r}, not a checkpoint tag: write the tag of a "
                                f"complete checkpoint into it (e.g. `echo step_00000100 > {root / 'latest'}`), or "
                                "start over with trainer.resume=false or a new run.out_dir")
    problems = _verdict(root, tag, rank)
    if not problems:
        return tag
    older = [sorted((p.name for p in root.glob("step_*") if p.is_dir() and p.name < tag), reverse=True)]
    dist.broadcast_object_list(older, src=0)  # one list: every rank verifies the same candidates together
    older = older[0]
    damage = f"checkpoint {root / tag} (named by checkpoints/latest) is damaged: " + "; ".join(problems)
    if policy == "abort":
        back = f" (the next older one is {older[0]})" if older else " (there is no older one)"
        raise DamagedCheckpoint(
            f"{damage}. trainer.on_corrupt_checkpoint=abort stops here. trainer.on_corrupt_checkpoint=fallback "
            f"resumes from the newest older checkpoint that verifies{back} and computes the steps since again "
            f"(the same trajectory); or {_FIX}")
    for candidate in older:
        bad = _verdict(root, candidate, rank)
        if not bad:
            if rank == 0:
                log.warning("%s. trainer.on_corrupt_checkpoint=fallback: resuming from %s instead; the steps after "
                            "it are computed again (the same trajectory)", damage, candidate)
            return candidate
        damage += f"; the older {candidate} is damaged too: " + "; ".join(bad)
    raise DamagedCheckpoint(f"{damage}. trainer.on_corrupt_checkpoint=fallback found no older checkpoint that "
                            f"verifies; {_FIX}")


def _verdict(root: Path, tag: str, rank: int) -> list[str]:
    problems = manifest.verify(root / tag, rank)
    if problems is None:
        if rank == 0:
            log.info("checkpoint %s has no %s (written before manifests existed): loaded unverified",
                     tag, manifest.MANIFEST)
        return []
    return problems


def _read(folder: Path, rank: int, path, load, *args, **kwargs):
    """load(path, ...), or an error naming the checkpoint and the file. Verification makes this rare: a
    checkpoint without a manifest, or a file that changed after it was verified."""
    try:
        return load(path, *args, **kwargs)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        damaged = DamagedCheckpoint(f"checkpoint {folder}: reading {path} failed on rank {rank} "
                                    f"({type(err).__name__}: {err}); {_FIX}")
        damaged.rank_local = True  # this rank alone may have raised it: it says so itself
        raise damaged from err


def check_resume(out_dir: Path, tag: str, fingerprint: dict) -> None:
    """Refuse, before any model is built, to resume a checkpoint written with other settings."""
    saved = ckpt_root(out_dir) / tag / "resume_fingerprint.json"
    if saved.exists():
        check_resume_compatible(read_json(saved), json.loads(json.dumps(fingerprint)))


def load_extra(out_dir: Path, tag: str, rank: int, name: str):
    """What save's `extra` wrote under `name` in checkpoint `tag` (in checkpoints/, also where the model state is
    read from a re-partitioned copy), or None where it holds none."""
    path = ckpt_root(out_dir) / tag / f"{name}.pt"
    return _read(path.parent, rank, path, torch.load, weights_only=False) if path.exists() else None


def load(engine, out_dir: Path, tag: str, rank: int, load_root: Path | None = None) -> int:
    """Restore engine state and RNG; returns the number of optimizer steps already done.

    `load_root`: where the tag's folder is, when not checkpoints/ (a resharded copy, engine/checkpoints/reshard.py). Such
    a copy has no RNG states for the new ranks; they keep their own, which only dropout would read (the data
    order is a function of the step)."""
    root = load_root or ckpt_root(out_dir)
    store = engine.checkpoint_engine  # every file DeepSpeed reads goes through its load
    real_load = store.load
    store.load = lambda path, *args, **kwargs: _read(root / tag, rank, path, real_load, *args, **kwargs)
    try:
        path, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    finally:
        del store.load  # the class's own method again
    if path is None:
        raise RuntimeError(f"checkpoint {root / tag} named by 'latest' could not be loaded")
    rng_file = root / tag / f"rng_rank{rank}.pt"
    rng = None
    if load_root is None or rng_file.exists():
        rng = _read(root / tag, rank, rng_file, torch.load, weights_only=False)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(client["step"])
