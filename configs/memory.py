"""MemoryConfig: which activation-memory policies to apply (recompute, offload, tiling)."""

from dataclasses import dataclass

RECOMPUTE_POLICIES = ("none", "full", "block", "selective", "budget", "except_attention")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class MemoryConfig:
    # none: keep all activations; full: recompute every decoder layer; block: recompute only
    # recompute_num_layers layers; selective: keep matmul and all-to-all outputs, recompute the cheap ops;
    # budget: recompute as little as fits the peak in budget_gib; except_attention: recompute every layer
    # but keep its core attention (never re-run), the fast long-context policy.
    recompute: str = "none"
    # recompute=block: how many decoder layers are recomputed; recompute=except_attention: how many layers
    # are recomputed whole, attention included (0 = none; raise it when keeping every attention does not fit)
    recompute_num_layers: int = 0
    recompute_method: str = "uniform"  # recompute=block: uniform = spread over depth; block = the first N layers
    budget_gib: float = 0.0  # recompute=budget or except_attention: target peak GPU memory in GiB
    # recompute=budget: the probe, i.e. peak_mem_gib of one step with memory=none and with memory=full_recompute
    # at this seq_len (two short runs); 0 = no probe, and budget then recomputes every layer (with a warning).
    # recompute=except_attention with budget_gib: the peaks with recompute_num_layers=0 and with all layers.
    probe_none_gib: float = 0.0
    probe_full_gib: float = 0.0
    # block/budget: the layers that are NOT recomputed still recompute their element-wise work (selective),
    # so long context keeps most attention outputs and re-runs attention only in the recomputed layers
    selective_kept: bool = False
    offload_activations: bool = False  # saved activations go to pinned host memory during forward
    # offload_activations: host GiB per rank that one forward may fill; past it, the remaining (deepest) saved
    # tensors stay on the GPU. 0 = no cap. For ranks whose host memory cannot hold every layer input.
    offload_max_gib: float = 0.0
    tiled_mlp: bool = False  # run the MLP over sequence tiles so its intermediate never exists whole
    mlp_tile_tokens: int = 8192  # tiled_mlp: tokens per tile
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; less fragmentation
