"""LoggingConfig and WandbConfig: what a run reports and where.

(Named log.py, not logging.py, so it can never shadow the standard library module.)
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from configs.errors import require

if TYPE_CHECKING:  # configs.train imports this module
    from configs.train import TrainConfig

WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online; never prompts for a login (online needs WANDB_API_KEY)
    project: str = "ds_ulysses_ext"
    entity: Optional[str] = None  # team or user; None = the API key's default entity
    name: Optional[str] = None  # run name; None = W&B picks one (the presets set ${run.name})
    dir: Optional[str] = None  # where W&B writes; None = its default ./wandb (the presets set ${run.out_dir})


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True  # tqdm bar on rank 0
    log_every: int = 1  # console/W&B every N steps (metrics.jsonl always gets every step)
    phase_times: bool = False  # time forward / backward / optimizer per step (adds GPU syncs); for breakdowns
    profile_step: int = 0  # profile this step (1-based) with torch.profiler into run.out_dir; 0 = never
    # record this step's CUDA allocations (1-based): a snapshot for pytorch.org/memory_viz and what is alive at its
    # peak, by the line that allocated it, into run.out_dir (engine/observe/memory_snapshot.py); 0 = never
    memory_snapshot_step: int = 0
    peak_tflops: float = 0.0  # per-GPU bf16 dense peak used for MFU; 0 = detect from the GPU name


def check_logging(cfg: "TrainConfig") -> None:
    # after check_trainer, so a wrong trainer.max_steps is blamed on itself, not on this key
    steps = cfg.trainer.max_steps
    for key in ("profile_step", "memory_snapshot_step"):
        n = getattr(cfg.logging, key)
        require(0 <= n <= steps, f"logging.{key}={n} must be a step of this run, 1..trainer.max_steps={steps} "
                "(or 0 for none)")
