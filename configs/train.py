"""TrainConfig: the root of the typed config tree. After the entry point, code sees only this."""

from dataclasses import dataclass, field

from configs.data import DataConfig
from configs.log import LoggingConfig
from configs.memory import MemoryConfig
from configs.model import ModelConfig
from configs.moe import MoEConfig
from configs.parallel import DeepSpeedConfig, ParallelismConfig
from configs.precision import Fp8Config
from configs.run import RunConfig
from configs.trainer import TrainerConfig


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # fp32 | bf16 (DeepSpeed's bf16 mode) | fp8 (bf16, with the decoder's linears in FP8: fp8.*); fp16 is refused
    # (no loss scaling here)
    precision: str = "bf16"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    device: str = "auto"  # auto = cuda when available, else cpu (gloo)
    # the collectives' backend. auto: NCCL on CUDA, gloo on CPU. gloo on CUDA stages every collective through host
    # memory and lets the ranks of a host share fewer GPUs than they are (rank i on GPU i mod count): slow, for
    # checking a multi-rank layout's numbers on a one-GPU machine (cp=2 in FP8, ZeRO-3 at world 2), never for speed
    dist_backend: str = "auto"
