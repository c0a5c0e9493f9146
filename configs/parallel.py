"""ParallelismConfig (how ranks split the work) and DeepSpeedConfig (ZeRO knobs).

dp is not a field: it is derived, dp = world_size // cp (see validate.Plan).
"""

from dataclasses import dataclass

MASTER_WEIGHTS = ("fp32", "bf16")


@dataclass
class ParallelismConfig:
    cp: int = 1  # context parallel degree: ranks that split one sequence (Ulysses all-to-all); divides world
    ep: int = 1  # expert parallel degree: ranks that split the MoE experts; divides world and the expert count
    tp: int = 1  # tensor parallel degree; only 1 is supported (TP+CP is refused at config time)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 3  # 2 or 3: the stages whose gradient reduction over cp we have verified to be exact
    offload_optimizer: bool = False  # optimizer state to host memory (ZeRO-Offload)
    offload_param: bool = False  # parameters to host memory; needs zero_stage=3
    overlap_comm: bool = True  # overlap gradient reduction with backward
    contiguous_gradients: bool = True  # copy grads into one buffer as produced; less fragmentation
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduce bucket
    stage3_param_persistence_threshold: int = 100_000  # params smaller than this stay gathered (ZeRO-3)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements prefetched ahead of use (ZeRO-3)
    # dtype of the optimizer's master weights, gradients and Adam moments. fp32: DeepSpeed's mixed precision
    # (an fp32 copy of the bf16 weights takes the update); bf16: the update is computed and stored in bf16, as
    # a plain torch AdamW on bf16 parameters does (about half the optimizer's memory and time, but updates
    # smaller than a weight's bf16 spacing are lost). bf16 needs precision=bf16.
    master_weights: str = "fp32"
