"""DataConfig: where training samples come from and how they are cut to seq_len."""

from dataclasses import dataclass
from typing import Optional

DATA_SOURCES = ("synthetic", "jsonl", "demo")
DATA_FORMATS = ("text", "chat")
OVERLONG_POLICIES = ("truncate", "drop")
BAD_LINE_POLICIES = ("skip", "fail")


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
    # trainer.eval_every steps (engine/evaluate.py); 0 = no held-out set
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
