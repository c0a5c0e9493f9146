"""ModelConfig: which HF causal LM to train and how to build it."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from configs.errors import ConfigError, divisors, fmt, require
from ds_ulysses_ext.models import SUPPORTED
from ds_ulysses_ext.moe.family_keys import FAMILY_KEYS, readers, unread_keys
from ds_ulysses_ext.rope import CP_ROPE_TYPES, unchecked_rope_types
from ds_ulysses_ext.attention.zigzag import padded_seq_len

if TYPE_CHECKING:  # configs.train imports this module
    from configs.train import TrainConfig

# HF `model_type`s the library can split under cp: its registry, so validate and the model build agree.
SUPPORTED_FAMILIES = tuple(SUPPORTED)
MOE_FAMILIES = tuple(f.model_type for f in SUPPORTED.values() if f.moe)
MODEL_SOURCES = ("config", "pretrained")
ATTN_BACKENDS = ("auto", "sdpa", "flash_attn", "fa4")
LATENT_ALIGN = 512  # a LatentMoE latent size must be a multiple of this
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen3_moe / gpt_oss, mixtral / deepseek
_LATENT_KEYS = ("latent_size", "moe_latent_size")


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, for logs only
    family: str = "llama"  # HF model_type; one of SUPPORTED_FAMILIES
    source: str = "config"  # "config": random init from `arch`; "pretrained": load weights from `path`
    path: Optional[str] = None  # local dir or hub id; required when source=pretrained
    # HF config kwargs (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    # head_dim, ...). source=config: the whole model shape. source=pretrained: the checkpoint's config.json
    # is the truth; the presets repeat its head/layer/expert counts here only so `validate` can check cp and
    # ep before anything is downloaded. Keys left out are checked later, at model load.
    arch: Dict[str, Any] = field(default_factory=dict)
    attn_backend: str = "auto"  # local attention kernel after the all-to-all: auto | sdpa | flash_attn | fa4
    # per-token kernels (RMSNorm, SwiGLU, RoPE) on CUDA: auto (Liger if installed, else torch.compile) | liger | compile |
    # none (HF's eager modules and torch's loss-head rows: no fused kernel anywhere; what CPU always runs). Each is
    # checked at first use (ds_ulysses_ext/kernels)
    kernels: str = "auto"
    # the fused loss head on CUDA: auto (= ours) | ours (ds_ulysses_ext/loss.py's chunks, each chunk's softmax rows in
    # one Triton kernel) | liger (Liger-Kernel's fused linear cross-entropy, fp32 weight-gradient accumulation; needs
    # model.kernels=liger, or auto with Liger installed). docs/benchmarks.md (loss head) has both measured
    loss_head: str = "auto"
    # with fused kernels (model.kernels not none, on CUDA): q/k/v and gate/up each run as one autograd node, their input
    # gradients summed in cuBLAS's epilogue, and except_attention's replay skips the q/k/v GEMMs nothing reads
    # (ds_ulysses_ext/kernels/projections.py); false: HF's separate linears (to bisect a numerical difference)
    projection_groups: bool = True
    # the linear-attention layers' delta rule (hybrid families only: Qwen3.5 / 3.6, Qwen3-Next, Ling-3.0): auto
    # (flash-linear-attention's chunked kernels on CUDA in bf16 when fla imports, else the torch path) | fla | torch.
    # fla is checked against torch at first use (ds_ulysses_ext/linear_attention/fla_kernels.py)
    linear_attn_kernel: str = "auto"


def check_model(model: ModelConfig) -> None:
    require(
        model.source != "pretrained" or bool(model.path),
        "model.source=pretrained needs model.path; set model.path=<local dir or hub id>, "
        "or use model.source=config for a random init",
    )
    if model.source == "pretrained" and model.path:
        # a hub id is "name" or "namespace/name"; anything else can only be a local folder, so it must exist
        # (else transformers fails after start-up with a message about repo ids)
        path = str(model.path)
        local_only = path.startswith((".", "/", "~")) or path.count("/") > 1
        require(
            not local_only or Path(path).expanduser().is_dir(),
            f"model.path={path} is not a folder here (and cannot be a hub id, which is name or namespace/name); "
            "fix the path, or run the run that writes it first (e.g. the previous stage of a curriculum)",
        )
    # An empty arch would silently build the HF default config (a 7B Llama for family=llama).
    require(
        model.source != "config" or bool(model.arch),
        "model.source=config needs model.arch (the HF config kwargs of the random-init model); "
        "use a preset such as model=tiny, or set model.arch.hidden_size=... etc.",
    )
    for key in _LATENT_KEYS:
        if key in model.arch:
            check_latent_size(key, model.arch[key])
    check_checkpoint_family(model)
    check_family_keys(model)
    check_routing_groups(model.arch)
    check_attention_keys(model.arch)


def checkpoint_config(model: ModelConfig) -> Optional[dict]:
    """A pretrained checkpoint's config.json, read as JSON (no transformers), where model.path is a local folder that
    has one; None for a hub id or a random init."""
    if model.source != "pretrained" or not model.path:
        return None
    path = Path(str(model.path)).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def shape_arch(model: ModelConfig) -> Mapping[str, Any]:
    """The keys the shape rules and memory=auto read. A pretrained checkpoint in a local folder is built from its
    config.json (engine/ds/hf_config.py), so its shape is that file's, not the preset's model.arch: a 4-layer or tiny
    preset with a real checkpoint would otherwise be planned and checked as 4 or 2 layers. A hub id's config is known
    only at load; the preset's arch stands in until then (and the model is checked again when built)."""
    ckpt = checkpoint_config(model)
    return model.arch if ckpt is None else ckpt


def check_checkpoint_family(model: ModelConfig) -> None:
    """The checkpoint must be the family the run names: model.family picks our attention, MoE and RoPE handling."""
    ckpt = checkpoint_config(model)
    if ckpt is None:
        return
    found = [ckpt.get("model_type")]
    if isinstance(ckpt.get("text_config"), Mapping):  # Qwen3.5's or a VL checkpoint: its causal LM is the text model
        found.append(ckpt["text_config"].get("model_type"))
    require(
        model.family in found,
        f"model.path={model.path} holds a {found[0]!r} checkpoint (its config.json's model_type), but "
        f"model.family={model.family}; set model.family={found[-1]} (or a preset of that family: model=<preset>)",
    )


def check_family_keys(model: ModelConfig) -> None:
    """Keys our MoE block reads that the family's HF class does not (ds_ulysses_ext/moe/family_keys.py)."""
    unread = unread_keys(model.family, model.arch)
    if not unread:
        return
    key = unread[0]
    switch = f" or use a family that reads it (model.family={FAMILY_KEYS[key][0]})" if FAMILY_KEYS[key] else ""
    raise ConfigError(
        f"model.arch.{key}={model.arch[key]} with model.family={model.family}: HF's {model.family} model never reads "
        f"it (read by: {readers(key)}): the model its export loads as would not have it, whatever our MoE block did "
        f"with it in training; remove it (~model.arch.{key}){switch}")


def check_routing_groups(arch: Mapping[str, Any]) -> None:
    """DeepSeek-V3 / GLM group-limited routing that HF's rule cannot run, refused here rather than at the build
    (ds_ulysses_ext/moe/router.py check_groups says what runs)."""
    from ds_ulysses_ext.moe.router import check_groups
    if int(arch.get("n_group", 1) or 1) == 1 or "n_routed_experts" not in arch:
        return
    try:
        check_groups(arch["n_routed_experts"], arch.get("num_experts_per_tok", 1), arch["n_group"],
                     arch.get("topk_group", 1))
    except ValueError as err:
        raise ConfigError(f"model.arch: {err} (model.arch.n_group / model.arch.topk_group)") from None


def check_attention_keys(arch: Mapping[str, Any]) -> None:
    """What ds_ulysses_ext/models.py check_attention_config refuses at model load, here before it when arch says it
    (the engine runs the context-parallel attention at every cp, 1 included)."""
    dropout = arch.get("attention_dropout", 0) or 0
    require(
        not dropout,
        f"model.arch.attention_dropout={dropout}: the context-parallel attention applies no dropout, and a dropout "
        "mask drawn on each rank's share could never be checked against the unsplit model; set "
        "model.arch.attention_dropout=0",
    )
    require(
        "is_causal" not in arch,
        f"model.arch.is_causal={arch.get('is_causal')}: transformers reads it for its own masks only (false: "
        "bidirectional), and the context-parallel attention is causal only and refuses the is_causal it would be "
        "handed; remove model.arch.is_causal (~model.arch.is_causal)",
    )


def check_latent_size(key: str, size: int) -> None:
    if size > 0 and size % LATENT_ALIGN == 0:
        return
    lower = size // LATENT_ALIGN * LATENT_ALIGN
    nearest = [n for n in (lower, lower + LATENT_ALIGN) if n > 0]
    raise ConfigError(
        f"model.arch.{key}={size} is not a multiple of {LATENT_ALIGN}, which LatentMoE requires; "
        f"use model.arch.{key}={' or '.join(str(n) for n in nearest)}"
    )


def check_positions(cfg: "TrainConfig", ring: int) -> None:
    # positions past what the model was built for silently extrapolate RoPE; known only when arch says it. A
    # pretrained checkpoint may do so on purpose (long-context fine-tuning): the build says it, it does not refuse
    # (engine/ds/hf_config.py position_warning)
    if cfg.model.source == "pretrained":
        return
    arch, at = decoder_arch(cfg.model.arch)
    limit = arch.get("max_position_embeddings")
    padded = padded_seq_len(cfg.data.seq_len, cfg.parallelism.cp, ring)
    require(
        not limit or padded <= limit,
        f"data.seq_len={cfg.data.seq_len} (padded to {padded} for cp) exceeds {at}max_position_embeddings="
        f"{limit}; shorten data.seq_len or raise {at}max_position_embeddings (RoPE will extrapolate)",
    )


def _rope_key(arch: Mapping[str, Any]) -> str:
    # HF reads rope_scaling first when both are given (convert_rope_params_to_dict)
    return "rope_scaling" if arch.get("rope_scaling") else "rope_parameters"


def check_rope(cfg: "TrainConfig") -> None:
    """RoPE types under cp (ds_ulysses_ext/rope.py); known only when model.arch says the rope type."""
    cp, (arch, at) = cfg.parallelism.cp, decoder_arch(cfg.model.arch)
    if cp == 1:
        return
    key = _rope_key(arch)
    params = arch.get(key)
    unknown = unchecked_rope_types(params)
    require(
        not unknown,
        f"{at}{key}.rope_type={unknown[0] if unknown else ''} is not one of the RoPE types checked under cp "
        f"{fmt(CP_ROPE_TYPES)}; set {at}{key}.rope_type to one of them or run with parallelism.cp=1",
    )  # a length cp does not divide is fine for every type: the cp pads never enter the length (rope.py)


def decoder_arch(arch: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """model.arch's keys of the decoder and where they sit: a VL preset (qwen3_vl) nests them under text_config."""
    text = arch.get("text_config")
    return (text, "model.arch.text_config.") if isinstance(text, Mapping) else (arch, "model.arch.")


def check_experts(model: ModelConfig, ep: int, world_size: int) -> None:
    require(
        world_size % ep == 0,
        f"parallelism.ep={ep} does not divide the world size {world_size}; "
        f"choose parallelism.ep in {fmt(divisors(world_size))}",
    )
    arch, at = decoder_arch(model.arch)
    key = next((k for k in _EXPERT_KEYS if k in arch), None)
    if key is None:
        require(
            ep == 1 or model.family in MOE_FAMILIES,
            f"parallelism.ep={ep} but model.family={model.family} has no experts; set parallelism.ep=1",
        )
        return  # an MoE preset without an expert count: checked at model load
    num_experts = arch[key]
    valid = [e for e in divisors(num_experts) if world_size % e == 0]
    require(
        num_experts % ep == 0,
        f"parallelism.ep={ep} does not divide {at}{key}={num_experts}; "
        f"choose parallelism.ep in {fmt(valid)} (world size {world_size})",
    )
