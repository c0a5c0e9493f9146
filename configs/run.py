"""RunConfig: what identifies one run (seed, name, where it writes)."""

from dataclasses import dataclass


@dataclass
class RunConfig:
    seed: int = 0  # seeds model init and data; the samples of step k depend only on seed, data and batch size
    out_dir: str = "outputs/run"  # metrics.jsonl, checkpoints and the resolved config go here; also Hydra's run dir
    name: str = "run"  # human-readable run name (W&B run name, log lines)
