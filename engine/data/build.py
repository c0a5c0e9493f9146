"""`build_dataset`: turns a `DataConfig` (configs/) into an indexable dataset of unshifted samples.

Accepts any object with the DataConfig attributes (the dataclass, an OmegaConf node, a SimpleNamespace):
source, path, format, tokenizer_path, seq_len, masked_fraction, num_samples, overlong, on_bad_line,
padding_side. Fields a source does not use are ignored, except where ignoring them would hide a mistake.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from .errors import DataError
from .jsonl import load_jsonl
from .packing import pack_dataset
from .passkey import PasskeyDataset, PasskeyTask, passkey_lengths
from .stats import DataStats
from .synthetic import SyntheticDataset
from .tokenizer import DEMO_CORPUS, DEMO_TOKENIZER, check_tokenizer_fits, tokenizer_of

_CHOICES = {
    "source": ("synthetic", "jsonl", "demo", "passkey"),
    "format": ("text", "chat"),
    "overlong": ("truncate", "drop"),
    "on_bad_line": ("skip", "fail"),
}


def build_dataset(cfg: Any, *, seed: int, vocab_size: int) -> tuple[Sequence[dict], DataStats, Optional[Any]]:
    """The samples of `_build_samples`, or with `cfg.pack` the rows they pack into (packing.py)."""
    ds, stats, tokenizer = _build_samples(cfg, seed=seed, vocab_size=vocab_size)
    if getattr(cfg, "pack", False):
        ds, stats = pack_dataset(ds, stats, cfg)
    return ds, stats, tokenizer


def _build_samples(cfg: Any, *, seed: int, vocab_size: int) -> tuple[Sequence[dict], DataStats, Optional[Any]]:
    """Returns (dataset, stats, tokenizer or None for synthetic).

    Each item is `{"input_ids": LongTensor[L], "labels": LongTensor[L]}`, 1 <= L <= cfg.seq_len, labels
    unshifted and aligned with input_ids, masked positions -100. `seed` only matters for synthetic data;
    `vocab_size` is the model's (`model.arch.vocab_size`): no token id may reach it.
    """
    _validate(cfg, vocab_size)
    if cfg.source == "synthetic":
        ds = SyntheticDataset(
            num_samples=cfg.num_samples,
            seq_len=cfg.seq_len,
            vocab_size=vocab_size,
            masked_fraction=cfg.masked_fraction,
            seed=seed,
        )
        return ds, DataStats(source="synthetic", num_samples=len(ds), num_tokens=len(ds) * cfg.seq_len), None

    if cfg.source == "passkey":
        return _passkey(cfg, seed, vocab_size)

    if cfg.source == "demo":
        _check_demo_fields(cfg)
        tokenizer = tokenizer_of(cfg)
        check_tokenizer_fits(tokenizer, vocab_size, "shipped demo")
        path = DEMO_CORPUS
    else:
        if not cfg.path:
            raise DataError("data.source=jsonl needs data.path, the local JSONL file to train on")
        if not cfg.tokenizer_path:
            raise DataError(
                "data.source=jsonl needs data.tokenizer_path (a local tokenizer directory, or a hub id already "
                "in the Hugging Face cache)"
            )
        tokenizer = tokenizer_of(cfg)
        path = cfg.path
    samples, stats = load_jsonl(
        path,
        tokenizer,
        fmt=cfg.format,
        seq_len=cfg.seq_len,
        vocab_size=vocab_size,
        overlong=cfg.overlong,
        on_bad_line=cfg.on_bad_line,
        source=cfg.source,
    )
    if not samples:
        raise DataError(f"{path} gave no usable samples ({stats.summary()}); check the file and data.format")
    return samples, stats, tokenizer


def _passkey(cfg: Any, seed: int, vocab_size: int):
    tokenizer = tokenizer_of(cfg)
    check_tokenizer_fits(tokenizer, vocab_size, "passkey")
    lengths = passkey_lengths(cfg)
    ds = PasskeyDataset(PasskeyTask(cfg.passkey, tokenizer, cfg.path), lengths, cfg.num_samples, seed)
    ds.task.make(random.Random(0), min(lengths))  # a length too short for the key fails here, before the build
    return ds, DataStats(source="passkey", num_samples=len(ds), num_tokens=0), tokenizer


def _validate(cfg: Any, vocab_size: int) -> None:
    for field, allowed in _CHOICES.items():
        value = getattr(cfg, field)
        if value not in allowed:
            raise DataError(f"data.{field}={value!r} is not supported; choose one of {', '.join(allowed)}")
    if cfg.padding_side != "right":
        raise DataError(
            f"data.padding_side={cfg.padding_side!r}: only right padding is supported (left padding would put pad "
            "tokens before real ones, which context parallelism cannot split exactly); set data.padding_side=right"
        )
    if not isinstance(cfg.seq_len, int) or cfg.seq_len < 1:
        raise DataError(f"data.seq_len={cfg.seq_len!r} must be a positive integer")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"model.arch.vocab_size={vocab_size!r} must be a positive integer")
    if cfg.source == "synthetic":
        if not isinstance(cfg.num_samples, int) or cfg.num_samples < 1:
            raise DataError(f"data.num_samples={cfg.num_samples!r} must be a positive integer for synthetic data")
        if not 0.0 <= float(cfg.masked_fraction) <= 1.0:
            raise DataError(f"data.masked_fraction={cfg.masked_fraction!r} must lie in [0, 1]")


def _check_demo_fields(cfg: Any) -> None:
    # The demo always uses the shipped files; a user path here would otherwise be silently ignored.
    for field, shipped in (("path", DEMO_CORPUS), ("tokenizer_path", DEMO_TOKENIZER)):
        value = getattr(cfg, field)
        if value and Path(value).resolve() != shipped:
            raise DataError(
                f"data.source=demo uses the shipped corpus and tokenizer, but data.{field}={value!r} is set; "
                f"set data.source=jsonl to train on your own file, or unset data.{field}"
            )
    if cfg.format != "text":
        raise DataError(f"the demo corpus is plain text; set data.format=text (got {cfg.format!r})")
