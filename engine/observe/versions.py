"""The libraries a run uses, logged at its start, and a warning where transformers or DeepSpeed is not the pinned one.

We bind to transformers' model classes (by exact class and forward, ds_ulysses_ext/memory/recompute.py) and patch
DeepSpeed internals (engine/ds/patches.py), so another version of either is the likeliest cause of a changed or
missing code path. torch is left out of the check: the GPU image runs torch 2.11 against the CPU pin 2.13, both
verified (pyproject.toml).
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

CHECKED = ("transformers", "deepspeed")


def installed() -> dict[str, str]:
    """{library: version} of what the run imports."""
    import deepspeed
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__}


def pinned() -> dict[str, str]:
    """{library: version} of the `name==version` requirements: the installed package's metadata, else pyproject.toml
    beside the package (a checkout run from its root, as on the GPU machine, is not installed)."""
    try:
        lines = importlib.metadata.requires("ds_ulysses_ext") or []
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        lines = re.findall(r'"([^"]+)"', pyproject.read_text()) if pyproject.exists() else []
    pins = {}
    for line in lines:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def version_warning(have: dict[str, str], pins: dict[str, str]) -> str | None:
    """A warning naming each checked library whose version is not the pinned one; None when all match."""
    off = [f"{name} {have[name]} (pinned {pins[name]})" for name in CHECKED
           if name in pins and name in have and have[name] != pins[name]]
    if not off:
        return None
    return ("installed " + ", ".join(off) + ": the HF model classes and DeepSpeed internals this project binds to "
            "were tested at the pinned versions; a family newer than the installed transformers is unavailable, and "
            "other versions may differ. Install the pins with `pip install -e .` where you can")
