"""DictConfig -> TrainConfig, and composing hydra_conf/ without a command line (tests and tools)."""

from pathlib import Path
from typing import Any, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from configs.store import register_configs
from configs.train import TrainConfig

HYDRA_CONF_DIR = Path(__file__).resolve().parent.parent / "hydra_conf"


def to_dataclass(dict_cfg: Any) -> TrainConfig:
    """Merge onto the schema (keys and types checked), resolve interpolations, return the typed tree."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), dict_cfg)
    return OmegaConf.to_object(merged)


def compose_config(overrides: Sequence[str] = (), config_name: str = "train") -> TrainConfig:
    """Compose hydra_conf/<config_name>.yaml with command-line style overrides, e.g. ["parallelism.cp=4"]."""
    register_configs()
    with initialize_config_dir(config_dir=str(HYDRA_CONF_DIR), version_base="1.3"):
        dict_cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_dataclass(dict_cfg)
