"""Tokenizer loading (offline only) and the shipped demo files' locations.

Runs never download. `data.tokenizer_path` is a local directory (tokenizer.json + tokenizer_config.json), or a
Hugging Face hub id that is already in the local HF cache: `from_pretrained(..., local_files_only=True)`
resolves both and fails fast otherwise.
"""

from __future__ import annotations

from pathlib import Path

from .errors import DataError

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_data"
DEMO_CORPUS = DEMO_DIR / "corpus.jsonl"
DEMO_TOKENIZER = DEMO_DIR / "tokenizer"


def load_tokenizer(path: str | Path):
    """`AutoTokenizer.from_pretrained(path, local_files_only=True)` with an error that says how to fix it."""
    from transformers import AutoTokenizer  # lazily: synthetic runs never pay for importing transformers

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(
            f"could not load the tokenizer data.tokenizer_path={str(path)!r} offline: {e}\n"
            "Give a local directory holding tokenizer.json and tokenizer_config.json, or a hub id that is already "
            "in the Hugging Face cache (fetch it once on a machine with network, e.g. `hf download <id>`); "
            "runs never download."
        ) from e


def check_tokenizer_fits(tokenizer, vocab_size: int, what: str) -> None:
    """Refuse a tokenizer with more entries than the model's embedding has rows."""
    if len(tokenizer) > vocab_size:
        raise DataError(
            f"the {what} tokenizer has {len(tokenizer)} entries but model.arch.vocab_size={vocab_size}; "
            f"set model.arch.vocab_size >= {len(tokenizer)} or use a tokenizer that fits the model"
        )


def pad_id_of(tokenizer) -> int:
    """The id `collate` pads with: the tokenizer's pad, else its eos, else 0 (pads are masked either way)."""
    if tokenizer is None:
        return 0
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def tokenizer_of(cfg):
    """The tokenizer a run's data used (an HF export ships it), or None for synthetic data."""
    if cfg.source == "demo":
        return load_tokenizer(DEMO_TOKENIZER)
    if cfg.source == "passkey":
        return load_tokenizer(cfg.tokenizer_path or DEMO_TOKENIZER)
    if cfg.source == "jsonl" and cfg.tokenizer_path:
        return load_tokenizer(cfg.tokenizer_path)
    return None
