"""DataConfig: where training samples come from and how they are cut to seq_len."""

from dataclasses import dataclass, field
from typing import List, Optional

from configs.errors import require

DATA_SOURCES = ("synthetic", "jsonl", "demo", "passkey")
PASSKEY_KEYS = ("digits", "letters")
PASSKEY_FILLERS = ("corpus", "repeat")
DATA_FORMATS = ("text", "chat")
OVERLONG_POLICIES = ("truncate", "drop")
BAD_LINE_POLICIES = ("skip", "fail")


@dataclass
class PasskeyConfig:
    """source=passkey: a key hidden in filler text, asked for at the end (engine/data/passkey.py, docs/retrieval.md)."""

    # sample lengths in tokens; [] = every sample data.seq_len long; several = each sample draws one (all are
    # padded to data.seq_len, so a mixture costs the longest); each must be <= data.seq_len
    lengths: List[int] = field(default_factory=list)
    depth_min: float = 0.0  # where the needle starts, as a fraction of the filler (0 = first, 1 = last token)
    depth_max: float = 1.0
    key: str = "digits"  # digits: random decimal digits; letters: a random lowercase word (several BPE tokens)
    key_length: int = 5  # characters of each key
    num_needles: int = 1  # keys asked for (same name, answered in order of appearance)
    num_distractors: int = 0  # keys of other names, not asked for (RULER's multi-key needle task)
    filler: str = "corpus"  # corpus: sentences of the shipped corpus; repeat: the classic "The grass is green..."
    # the held-out retrieval grid scored every trainer.eval_every steps (metric retrieval_acc, engine/run/retrieval.py)
    eval_lengths: List[int] = field(default_factory=list)  # [] = the largest of lengths (or data.seq_len)
    eval_depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    eval_samples_per_cell: int = 4


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic: random tokens; jsonl: user files; demo: small built-in set
    path: Optional[str] = None  # jsonl file or folder; required when source=jsonl
    format: str = "text"  # jsonl record layout: "text" field, or chat "messages" through the chat template
    tokenizer_path: Optional[str] = None  # local dir or hub id; required when source=jsonl
    # Tokens per sample (the global sequence length, before the cp split). It need not divide by cp: the
    # batch is right-padded up to a multiple of cp and the padding carries no loss.
    seq_len: int = 256
    masked_fraction: float = 0.25  # synthetic: fraction of labels set to -100, so masking is exercised
    num_samples: int = 4096  # synthetic: dataset size
    # the last N samples of the dataset (after truncation/dropping) are held out of training and scored every
    # trainer.eval_every steps (engine/run/evaluate.py); 0 = no held-out set
    eval_samples: int = 0
    # source=jsonl: a JSONL file or folder of validation samples (format, tokenizer and seq_len as for data.path),
    # all of them scored every trainer.eval_every steps; instead of data.eval_samples
    eval_path: Optional[str] = None
    overlong: str = "truncate"  # a sample longer than seq_len: truncate it, or drop it
    on_bad_line: str = "skip"  # an unparsable jsonl line: skip it (counted in the logs), or fail the run
    # Only "right" is accepted: labels are shifted on the full sequence before the cp split, which assumes
    # the real tokens start at position 0 and padding sits at the end.
    padding_side: str = "right"
    # Pack samples greedily into rows of seq_len tokens (engine/data/packing.py); documents never attend to or
    # predict each other. trainer.global_batch_size then counts rows. The rows do not depend on the layout.
    pack: bool = False
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)  # source=passkey only


def check_data(data: DataConfig) -> None:
    if data.source == "jsonl":
        require(bool(data.path), "data.source=jsonl needs data.path; set data.path=<.jsonl file or folder>")
        require(
            bool(data.tokenizer_path),
            "data.source=jsonl needs data.tokenizer_path; set data.tokenizer_path=<local dir or hub id>",
        )
    require(
        data.padding_side == "right",
        f"data.padding_side={data.padding_side}: left padding is not supported under cp: the boundary-token "
        "label shift assumes right padding; set data.padding_side=right",
    )
    require(data.seq_len >= 1, f"data.seq_len={data.seq_len} must be >= 1")
    require(
        0.0 <= data.masked_fraction < 1.0,
        f"data.masked_fraction={data.masked_fraction} must be in [0, 1) (1 would leave no token to train on); "
        "set e.g. data.masked_fraction=0.25",
    )
    require(data.num_samples >= 1, f"data.num_samples={data.num_samples} must be >= 1")
    if data.source == "passkey":
        check_passkey(data)


def check_passkey(data: DataConfig) -> None:
    """Refuse a passkey task that cannot be built (check_data calls this before any model is loaded)."""
    p = data.passkey
    for field_name in ("lengths", "eval_lengths"):
        for length in getattr(p, field_name):
            require(1 <= length <= data.seq_len,
                    f"data.passkey.{field_name} holds {length}, outside 1..data.seq_len={data.seq_len}; every sample "
                    f"is padded to data.seq_len: set data.seq_len={max(getattr(p, field_name))} or shorten "
                    f"data.passkey.{field_name}")
    require(0.0 <= p.depth_min <= p.depth_max <= 1.0,
            f"data.passkey.depth_min={p.depth_min} and depth_max={p.depth_max} must satisfy 0 <= min <= max <= 1; "
            "e.g. data.passkey.depth_min=0.0 data.passkey.depth_max=1.0")
    require(p.key in PASSKEY_KEYS,
            f"data.passkey.key={p.key} is not one of {PASSKEY_KEYS}; set data.passkey.key=digits")
    require(p.filler in PASSKEY_FILLERS,
            f"data.passkey.filler={p.filler} is not one of {PASSKEY_FILLERS}; set data.passkey.filler=corpus")
    require(p.key_length >= 1, f"data.passkey.key_length={p.key_length} must be >= 1; e.g. data.passkey.key_length=5")
    require(p.num_needles >= 1, f"data.passkey.num_needles={p.num_needles} must be >= 1")
    require(0 <= p.num_distractors <= 11,
            f"data.passkey.num_distractors={p.num_distractors} must be in 0..11 (one name each, 12 names); "
            "set e.g. data.passkey.num_distractors=3")
    require(len(p.eval_depths) > 0,
            "data.passkey.eval_depths is empty: the retrieval grid needs at least one depth; "
            "set e.g. data.passkey.eval_depths=[0.0,0.5,1.0]")
    require(all(0.0 <= d <= 1.0 for d in p.eval_depths),
            f"data.passkey.eval_depths={list(p.eval_depths)} must lie in [0, 1]; "
            "e.g. data.passkey.eval_depths=[0.0,0.5,1.0]")
    require(p.eval_samples_per_cell >= 1,
            f"data.passkey.eval_samples_per_cell={p.eval_samples_per_cell} must be >= 1")
