"""`DataStats`: what building a dataset kept, cut and skipped, so a run can log it and tests can assert it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataStats:
    source: str = ""
    num_samples: int = 0  # kept samples (the dataset's length)
    num_lines: int = 0  # lines read from a JSONL file (0 for synthetic)
    num_truncated: int = 0  # longer than seq_len, cut to its first seq_len tokens (overlong=truncate)
    num_dropped: int = 0  # longer than seq_len, left out (overlong=drop)
    num_bad_lines: int = 0  # malformed lines skipped (on_bad_line=skip)
    num_all_masked: int = 0  # kept samples with no target after the causal shift (legal, but worth knowing)
    num_chat_boundary_mismatches: int = 0  # chats whose template was not prefix-stable (see chat.py)
    num_tokens: int = 0  # input tokens over kept samples
    # Targets after the causal shift over kept samples; None where counting would mean generating every sample
    # (the lazy synthetic dataset).
    num_target_tokens: Optional[int] = None
    # data.pack=true: the samples above are packed into num_rows rows of pack_seq_len tokens; efficiency is
    # real tokens / (rows x seq_len)
    num_rows: int = 0
    pack_seq_len: int = 0
    pack_efficiency: Optional[float] = None

    def summary(self) -> str:
        parts = [
            f"data[{self.source}]: {self.num_samples:,} samples",
            f"{self.num_tokens:,} tokens",
            f"{self.num_target_tokens:,} targets" if self.num_target_tokens is not None else "targets not counted",
            f"{self.num_truncated:,} truncated",
            f"{self.num_dropped:,} dropped",
            f"{self.num_bad_lines:,} bad lines",
            f"{self.num_all_masked:,} all-masked",
        ]
        if self.num_lines:
            parts.insert(1, f"{self.num_lines:,} lines read")
        if self.pack_efficiency is not None:
            parts.append(f"packed into {self.num_rows:,} rows of {self.pack_seq_len:,} tokens "
                         f"(packing efficiency {self.pack_efficiency:.1%})")
        if self.num_chat_boundary_mismatches:
            parts.append(f"{self.num_chat_boundary_mismatches:,} chat boundary mismatches")
        return ", ".join(parts)
