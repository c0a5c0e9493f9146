"""Register the schemas with Hydra's ConfigStore: the one place that does.

`hydra_conf/train.yaml` lists `train_schema` first in its defaults, so every YAML value is merged onto the
typed tree: a misspelt key or a wrong type fails at compose time, not deep inside a run.
"""

from hydra.core.config_store import ConfigStore

from configs.data import DataConfig
from configs.log import LoggingConfig
from configs.memory import MemoryConfig
from configs.model import ModelConfig
from configs.moe import MoEConfig
from configs.parallel import DeepSpeedConfig, ParallelismConfig
from configs.train import TrainConfig
from configs.trainer import TrainerConfig

# Config group (a folder of hydra_conf/) -> its schema. A group file may start with
# `defaults: [schema, _self_]` to be checked on its own; under train.yaml the root schema already types it.
GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallelism": ParallelismConfig,
    "deepspeed": DeepSpeedConfig,
    "trainer": TrainerConfig,
    "memory": MemoryConfig,
    "moe": MoEConfig,
    "logging": LoggingConfig,
}


def register_configs() -> None:
    """Store `train_schema` and `<group>/schema` for each group. Idempotent: storing again overwrites."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name="schema", node=schema)
