"""Typed config tree for ds_ulysses_ext: schemas, Hydra registration and validation.

Hydra composes YAML (hydra_conf/) onto these dataclasses; the entry point turns the result into a
TrainConfig with `to_dataclass` and calls `validate(cfg, world_size)` before any model is loaded.
"""

from configs.compose import HYDRA_CONF_DIR, compose_config, to_dataclass
from configs.data import DataConfig
from configs.errors import ConfigError
from configs.log import LoggingConfig, WandbConfig
from configs.memory import MemoryConfig
from configs.model import ModelConfig
from configs.parallel import DeepSpeedConfig, ParallelismConfig
from configs.run import RunConfig
from configs.store import register_configs
from configs.train import TrainConfig
from configs.trainer import TrainerConfig
from configs.validate import Plan, validate

__all__ = [
    "HYDRA_CONF_DIR",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "LoggingConfig",
    "MemoryConfig",
    "ModelConfig",
    "ParallelismConfig",
    "Plan",
    "RunConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "compose_config",
    "register_configs",
    "to_dataclass",
    "validate",
]
