"""ParallelismConfig (how ranks split the work) and DeepSpeedConfig (ZeRO knobs).

dp is not a field: it is derived, dp = world_size // cp (see validate.Plan).
"""

from dataclasses import dataclass


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
