"""RetrievalEvalConfig: scripts/eval_retrieval.py's config, the training tree plus the grid to score."""

from dataclasses import dataclass, field
from typing import List, Optional

from configs.train import TrainConfig


@dataclass
class RetrievalEvalConfig(TrainConfig):
    # a run.out_dir (its hf_export/ is scored on the passkey task it was trained on) or an HF model folder
    # (scored on data.passkey as configured); the script takes it as its first, positional argument
    target: Optional[str] = None
    lengths: List[int] = field(default_factory=list)  # [] = the run's data.passkey.eval_lengths (or data.seq_len)
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples_per_cell: int = 8
    out_dir: Optional[str] = None  # retrieval.json + retrieval.png; default: the target folder
