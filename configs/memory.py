"""MemoryConfig: which activation-memory policies to apply (recompute, offload, tiling)."""

from dataclasses import dataclass, fields
from typing import Any, Mapping

from configs.errors import require
from configs.model import decoder_arch  # a VL preset keeps the decoder's layer count under text_config

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
    # recompute=except_attention: the attention tensors it keeps (q, k, v, out, logsumexp, the recorded output) go
    # to pinned host memory after each layer's attention and come back one layer ahead in backward
    attention_offload: bool = False
    # offload_activations / attention_offload: the most GiB of device tensors whose copies to the host are queued
    # but not done (both offloads together); past it the host waits for the oldest copy. Their blocks cannot be
    # reused until copied, so this much can sit reserved above what is allocated. Lower costs the host its lead:
    # 0.5 was as fast as 2 on an H200 at 16k and 32k tokens and reserved 0.9-1.5 GiB less (docs/benchmarks.md BE)
    offload_inflight_gib: float = 0.5
    tiled_mlp: bool = False  # run the MLP over sequence tiles so its intermediate never exists whole
    mlp_tile_tokens: int = 8192  # tiled_mlp: tokens per tile
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; less fragmentation
    # memory=auto: before the build, predict every preset (ds_ulysses_ext/memory/planner.py) and run the fastest that
    # fits (engine/run/auto_memory.py); the policy fields above are then the chosen preset's
    auto: bool = False
    auto_gpu_gib: float = 0.0  # memory.auto: GPU memory to fit in GiB; 0 = the device's (on CPU: no fitting, none)
    auto_host_gib: float = 0.0  # memory.auto: host memory for offload in GiB; 0 = this host's physical memory


# the policy fields a memory preset sets: what memory=auto fills in (and refuses to be given alongside it)
AUTO_FILLS = tuple(f.name for f in fields(MemoryConfig)
                   if f.name not in ("expandable_segments", "offload_inflight_gib", "auto", "auto_gpu_gib",
                                     "auto_host_gib"))


def _layer_count_in_range(count: int, lowest: int, arch: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether lowest <= count <= the model's layers (when known), and the upper bound for a message."""
    decoder, where = decoder_arch(arch)
    num_layers = decoder.get("num_hidden_layers")
    upper = f" and <= {where}num_hidden_layers={num_layers}" if num_layers else ""
    return count >= lowest and (not num_layers or count <= num_layers), upper


def check_memory(mem: MemoryConfig, arch: Mapping[str, Any]) -> None:
    if mem.auto:
        default = MemoryConfig()
        chosen = [f"memory.{k}={getattr(mem, k)}" for k in AUTO_FILLS if getattr(mem, k) != getattr(default, k)]
        require(not chosen, f"memory=auto chooses the policy fields itself, but {', '.join(chosen)} is set: drop "
                            "it, or name a preset (memory=<name>) to set fields by hand")
    require(mem.auto_gpu_gib >= 0 and mem.auto_host_gib >= 0,
            f"memory.auto_gpu_gib={mem.auto_gpu_gib} and memory.auto_host_gib={mem.auto_host_gib} must be >= 0")
    if mem.recompute == "block":
        ok, upper = _layer_count_in_range(mem.recompute_num_layers, 1, arch)
        require(
            ok,
            f"memory.recompute=block needs memory.recompute_num_layers >= 1{upper}, got "
            f"{mem.recompute_num_layers}; set memory.recompute_num_layers (or use memory=full_recompute)",
        )
    require(
        mem.budget_gib == 0 or mem.recompute in ("budget", "except_attention"),
        f"memory.budget_gib={mem.budget_gib} only applies to memory.recompute=budget or except_attention, got "
        f"{mem.recompute!r}; set memory.budget_gib=0 or choose one of those",
    )
    require(
        not (mem.recompute == "except_attention" and mem.budget_gib > 0)
        or (mem.probe_none_gib > 0 and mem.recompute_num_layers == 0),
        "memory.recompute=except_attention with memory.budget_gib chooses recompute_num_layers from the probe: "
        "set memory.probe_none_gib and memory.probe_full_gib (peak_mem_gib of a step with recompute_num_layers=0 "
        "and with all layers) and leave memory.recompute_num_layers=0",
    )
    if mem.recompute == "except_attention":
        ok, upper = _layer_count_in_range(mem.recompute_num_layers, 0, arch)
        require(
            ok,
            f"memory.recompute=except_attention takes memory.recompute_num_layers >= 0{upper} (layers "
            f"recomputed whole, attention included), got {mem.recompute_num_layers}",
        )
    require(
        not mem.selective_kept or mem.recompute in ("block", "budget"),
        f"memory.selective_kept=true only applies to memory.recompute=block or budget, got "
        f"{mem.recompute!r}; use memory.recompute=selective for selective recompute alone",
    )
    require(
        mem.recompute != "budget" or mem.budget_gib > 0,
        f"memory.recompute=budget needs memory.budget_gib > 0, got {mem.budget_gib}; "
        "set memory.budget_gib=<target peak GiB>",
    )
    require(
        (mem.probe_none_gib > 0) == (mem.probe_full_gib > 0) and mem.probe_none_gib >= mem.probe_full_gib,
        f"memory.probe_none_gib={mem.probe_none_gib} and memory.probe_full_gib={mem.probe_full_gib}: give both "
        "(peak_mem_gib of a memory=none and a memory=full_recompute step), none >= full, or neither",
    )
    require(
        not mem.attention_offload or mem.recompute == "except_attention",
        f"memory.attention_offload=true moves the attention tensors that memory.recompute=except_attention keeps; "
        f"got memory.recompute={mem.recompute!r}: use memory=except_attention_offload, or "
        "memory.offload_activations=true to offload layer inputs",
    )
    require(
        not mem.tiled_mlp or mem.mlp_tile_tokens >= 1,
        f"memory.tiled_mlp=true needs memory.mlp_tile_tokens >= 1, got {mem.mlp_tile_tokens}",
    )
    require(mem.offload_inflight_gib > 0,
            f"memory.offload_inflight_gib={mem.offload_inflight_gib} must be > 0 (GiB of copies to the host in flight)")
    require(
        mem.offload_max_gib >= 0 and (mem.offload_max_gib == 0 or mem.offload_activations),
        f"memory.offload_max_gib={mem.offload_max_gib} must be >= 0 and only caps memory.offload_activations=true "
        f"(got offload_activations={mem.offload_activations}); set memory.offload_activations=true or "
        "memory.offload_max_gib=0",
    )
