"""enable_expert_parallel(model, topology, settings): put our MoE block into an HF MoE model and split its experts.

- HF Qwen3-MoE sparse blocks and GPT-OSS MLPs are replaced by `MoEBlock`s holding the same weights (HF's
  parameter names and layouts, so a checkpoint loads as is); LatentMoE models (latent_model.py) are built with
  `MoEBlock`s already.
- Each block keeps experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of its EP group and gets the model's one
  `MoEContext` (dispatcher over the EP group, the CP group for the balance statistics).
- Under ZeRO-3 the expert parameters are marked for DeepSpeed as expert-parallel (engine/ds/patches.py says how)
  before `deepspeed.initialize` partitions them, over their expert-data-parallel group.
Works on an already ZeRO-3-partitioned model (weights are gathered block by block) and on a plain one.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from ..errors import UnsupportedError
from ..models import text_config_of
from ..topology import Topology
from .dispatch import AllToAllDispatcher
from .experts import RECOMPUTE_MODES
from .family_keys import check_family_keys
from .layer import SHARED_COMBINES, MoEBlock, MoEContext, MoESpec, moe_blocks

log = logging.getLogger(__name__)

DISPATCHERS = ("auto", "alltoall", "deepep")
BALANCES = ("aux", "bias", "none")


@dataclass(frozen=True)
class MoESettings:
    dispatcher: str = "auto"  # auto: deepep on CUDA when it imports and the EP group suits it, else alltoall
    balance: str = "aux"  # aux: per-sequence balance loss; bias: aux-loss-free expert bias; none
    aux_loss_coef: float = 1e-3
    bias_update_rate: float = 1e-3
    recompute: str = "none"  # none | act | experts (experts.py)
    recompute_group_size: int = 1
    offload_inputs: bool = False
    # dispatcher=deepep at ep=1 (DeepEP's low-latency mode): its buffer's tokens per rank, i.e. the most tokens one
    # MoE call sees on a rank (micro-batch x local sequence); a multiple of 4, at most 511 by default (deepep.py)
    max_tokens_per_rank: int = 0
    # on CUDA, the combine, the slot expansion's backward and the experts' SwiGLU as Triton kernels (kernels/
    # slot_sum.py, kernels/glu.py), each checked against the torch path at first use; false: the torch path, the
    # reference (the engine sets it from model.kernels != none)
    fused_kernels: bool = True

    def check(self) -> None:
        for name, value, choices in (("dispatcher", self.dispatcher, DISPATCHERS),
                                     ("balance", self.balance, BALANCES),
                                     ("recompute", self.recompute, RECOMPUTE_MODES)):
            if value not in choices:
                raise UnsupportedError(f"moe.{name}={value} is not one of {choices}")
        if self.offload_inputs and self.recompute != "experts":
            raise UnsupportedError("moe.offload_inputs=true needs moe.recompute=experts")


def hf_moe_spec(config, expert_bias: bool = False) -> MoESpec:
    """The MoE block shape of an HF Qwen3-MoE-style config (LatentMoE's adds latent_size and a shared expert), or
    of a GPT-OSS config (num_local_experts, intermediate_size per expert, swiglu_alpha / swiglu_limit). HF's
    router_aux_loss_coef is not read: our per-sequence balance loss (moe.aux_loss_coef) replaces HF's pooled one."""
    if getattr(config, "output_router_logits", False):
        raise UnsupportedError(
            "output_router_logits=true asks for HF's load-balancing loss, which pools the whole batch and every "
            "layer and so changes with the cp split; our per-sequence loss replaces it: set "
            "output_router_logits=false and use moe.balance=aux (moe.aux_loss_coef)")
    check_family_keys(config)  # keys read below that only some families' HF classes read
    family = getattr(config, "model_type", None)
    if family == "gpt_oss":  # its experts' activation is fixed; hidden_act is unread
        return MoESpec.gpt_oss(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                               config.intermediate_size, swiglu_alpha=float(config.swiglu_alpha),
                               swiglu_limit=float(config.swiglu_limit), expert_bias=expert_bias)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"MoE experts with hidden_act={act!r}: our experts compute SwiGLU (silu); "
                               "use a model whose experts are SwiGLU")
    if family == "bailing_hybrid":  # Ling-3.0: DeepSeek-V3's block, its routed experts named num_local_experts
        from .router import check_groups
        try:
            check_groups(config.num_local_experts, config.num_experts_per_tok, config.n_group or 1,
                         config.topk_group or 1)
        except ValueError as err:
            raise UnsupportedError(str(err)) from None
        return MoESpec.deepseek(config)
    if family in QWEN3_NEXT_MOE_FAMILIES:
        if family == "qwen3_5_moe_text" and not getattr(config, "norm_topk_prob", True):
            # not a field of its config: HF's Qwen3.5-MoE router always renormalises and never reads it
            raise UnsupportedError("norm_topk_prob=false in the qwen3_5_moe_text config: HF's Qwen3.5-MoE router "
                                   "always renormalises the top-k weights and never reads it, so the export would "
                                   "route otherwise than training did. Remove norm_topk_prob from the config")
        return MoESpec.qwen3_next(config, expert_bias)
    if family in DEEPSEEK_MOE_FAMILIES or family == "mistral4":
        from .router import check_groups
        try:
            check_groups(config.n_routed_experts, config.num_experts_per_tok, config.n_group or 1,
                         config.topk_group or 1)
        except ValueError as err:
            raise UnsupportedError(str(err)) from None
        return MoESpec.mistral4(config, expert_bias) if family == "mistral4" else MoESpec.deepseek(config)
    if family == "cohere2_moe":
        # HF raises on other values only when the block first runs; here before training, naming the field
        for key, choices in (("expert_selection_fn", ("softmax", "sigmoid")),
                             ("shared_expert_combination_strategy", SHARED_COMBINES)):
            if getattr(config, key) not in choices:
                raise UnsupportedError(f"{key}={getattr(config, key)!r} in the cohere2_moe config: HF's block runs "
                                       f"only {choices}; set {key} to one of them")
        return MoESpec.cohere2(config, expert_bias)
    if family == "qwen3_vl_moe_text" and not getattr(config, "norm_topk_prob", True):
        # not a field of its config: kept as a plain attribute that HF's router (which always renormalises) never reads
        raise UnsupportedError("norm_topk_prob=false in the qwen3_vl_moe text config: HF's Qwen3-VL-MoE router always "
                               "renormalises the top-k weights and never reads it, so the export would route "
                               "otherwise than training did. Remove norm_topk_prob from text_config")
    return MoESpec(hidden_size=config.hidden_size, num_experts=config.num_experts,
                   top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                   score=getattr(config, "router_score", "softmax"),
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
                   latent_size=int(getattr(config, "latent_size", 0) or 0),
                   shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
                   expert_bias=expert_bias)


def _gathered(params):
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed
        return deepspeed.zero.GatheredParameters(list(params))
    return contextlib.nullcontext()


# families whose MoE block is HF's DeepseekV3MoE (GLM-4-MoE and -Lite copy it): MoESpec.deepseek
DEEPSEEK_MOE_FAMILIES = ("deepseek_v3", "glm4_moe_lite", "glm4_moe")
# families whose MoE block is HF's Qwen3NextSparseMoeBlock (Qwen3.5-MoE copies it): MoESpec.qwen3_next
QWEN3_NEXT_MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")


# (module, class) of each HF MoE block we replace. A family newer than the installed transformers has no module there,
# and its model cannot be built either, so its block is skipped rather than failing every MoE run (the GPU image of
# 2026-12-06 ships transformers 5.17, which lacks bailing_hybrid).
_HF_MOE_BLOCKS = (
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("gpt_oss", "GptOssMLP"), ("deepseek_v3", "DeepseekV3MoE"),
    ("glm4_moe", "Glm4MoeMoE"), ("glm4_moe_lite", "Glm4MoeLiteMoE"), ("mistral4", "Mistral4MoE"),
    ("cohere2_moe", "Cohere2MoeSparseMoeBlock"), ("qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock"),
    ("qwen3_next", "Qwen3NextSparseMoeBlock"), ("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
    ("bailing_hybrid", "BailingHybridMoE"))


def _hf_moe_classes() -> tuple:
    import importlib
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    blocks = []
    for family, name in _HF_MOE_BLOCKS:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ModuleNotFoundError as e:
            if not f"transformers.models.{family}.modeling_{family}".startswith(e.name or "\0"):
                raise  # the family is there but something it imports is not: say so
            continue
        blocks.append(getattr(module, name))
    return tuple(blocks), GptOssExperts


def replace_hf_blocks(model, expert_bias: bool = False) -> int:
    """Swap every HF Qwen3-MoE (and Qwen3-VL-MoE text) sparse block, GPT-OSS MLP, DeepSeek-V3 / GLM-4-MoE(-Lite) /
    Mistral4 MoE and Cohere2-MoE sparse block for a MoEBlock with the same weights (the selection bias included);
    returns how many. Their dense layers stay HF's."""
    blocks, gpt_oss_experts = _hf_moe_classes()
    layers = model.get_decoder().layers
    replaced = 0
    for layer_id, layer in enumerate(layers):
        old = getattr(layer, "mlp", None)
        if not isinstance(old, blocks):
            continue
        experts = getattr(old, "experts", None)
        if hasattr(old, "router") and type(experts) is not gpt_oss_experts:
            # e.g. transformers' Mxfp4GptOssExperts (gate_up_proj_blocks/_scales): not the bf16/fp32 weights we hold
            raise UnsupportedError(
                f"layer {layer_id}: GPT-OSS experts of type {type(experts).__name__} (a quantized checkpoint kept "
                "quantized); load it dequantized, e.g. from_pretrained(..., quantization_config="
                "Mxfp4Config(dequantize=True)), or save a dequantized copy and set model.path to it")
        spec = hf_moe_spec(text_config_of(model.config), expert_bias)  # a VL model's MoE shape is its text config's
        old_params = list(old.parameters())
        dtype, device = old_params[0].dtype, old_params[0].device
        new = MoEBlock(spec, layer_id)
        with _gathered(old_params), torch.no_grad():
            new.to(device=_real_device(old_params[0], device), dtype=dtype)
            missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
        if unexpected or [k for k in missing if k != f"{spec.router_name}.{spec.bias_name}"]:
            raise RuntimeError(f"layer {layer_id}: HF MoE weights did not map onto ours: missing {missing}, "
                               f"unexpected {unexpected}")
        layer.mlp = new
        replaced += 1
    return replaced


def _real_device(param, device):
    # a ZeRO-3 parameter lives on the accelerator (or the host with offload); the gathered copy is where it is
    return param.device if param.numel() else device


def enable_expert_parallel(model, topology: Topology, settings: MoESettings = MoESettings()) -> MoEContext:
    """Install our MoE blocks, shard their experts over `topology`'s EP group, and return the shared context."""
    settings.check()
    replace_hf_blocks(model, expert_bias=settings.balance == "bias")
    blocks = moe_blocks(model)
    if not blocks:
        raise UnsupportedError(f"{type(model).__name__} has no MoE block we know how to split; "
                               "set parallelism.ep=1 for a dense model")
    for block in blocks:
        if settings.balance == "bias" and block.topk_router.expert_bias is None:
            block.topk_router.add_expert_bias()
    ctx = MoEContext(dispatcher=_dispatcher(settings, blocks[0].spec.num_experts, topology,
                                             dim=blocks[0].spec.expert_dim),
                     cp_group=topology.cp_group, balance=settings.balance)
    for block in blocks:
        with _gathered(list(block.experts.parameters())):
            block.shard(topology.ep_rank, topology.ep_size)
        block.experts.recompute = settings.recompute
        block.experts.group_size = settings.recompute_group_size
        block.experts.offload_inputs = settings.offload_inputs
        block.experts.fused = settings.fused_kernels
        block._ctx[0] = ctx
    model._moe_context = ctx
    model._moe_settings = settings
    return ctx


def _dispatcher(settings: MoESettings, num_experts: int, topology: Topology, dim: int = 0):
    """`auto` is the torch all-to-all: at ep=1 it is a local permute, which measured faster than DeepEP's
    low-latency round trip (docs/benchmarks.md, section L), and at ep > 1 DeepEP's normal mode has not been checked
    against it on several GPUs (docs/moe.md), and an unchecked dispatcher must not be picked silently.
    An explicit `deepep` runs DeepEP: at ep=1 its low-latency mode (checked bitwise against the all-to-all on an
    H200; for micro-batches of at most a few hundred tokens per rank), at ep = 2/4/8 its normal mode, with a warning."""
    if settings.dispatcher == "deepep" and topology.ep_size == 1:
        from .deepep import DeepEPLowLatencyDispatcher, deepep_ll_unavailable_reason
        reason = deepep_ll_unavailable_reason()
        if reason is not None:
            raise UnsupportedError(f"moe.dispatcher=deepep: {reason}; use moe.dispatcher=alltoall")
        if not settings.max_tokens_per_rank:
            raise UnsupportedError("moe.dispatcher=deepep at ep=1 runs DeepEP's low-latency mode, whose buffer is "
                                   "sized up front: set MoESettings.max_tokens_per_rank (the engine sets it from "
                                   "the micro-batch), or use moe.dispatcher=alltoall")
        if topology.rank == 0:
            log.info("MoE dispatcher: DeepEP low-latency mode at ep=1, buffer of %d tokens per rank",
                     settings.max_tokens_per_rank)
        return DeepEPLowLatencyDispatcher(num_experts, dim, topology.ep_group,
                                          max_tokens_per_rank=settings.max_tokens_per_rank)
    if settings.dispatcher == "deepep":
        from .deepep import DeepEPDispatcher, deepep_unavailable_reason
        reason = deepep_unavailable_reason(topology.ep_size)
        if reason is not None:
            raise UnsupportedError(f"moe.dispatcher=deepep: {reason}; use moe.dispatcher=alltoall")
        if topology.rank == 0:
            log.warning("MoE dispatcher: DeepEP normal mode (ep=%d). This path has not yet been checked against the "
                        "all-to-all dispatcher on several GPUs (docs/moe.md); compare a few steps with "
                        "moe.dispatcher=alltoall before relying on it", topology.ep_size)
        return DeepEPDispatcher(num_experts, topology.ep_group)
    if topology.rank == 0:
        log.info("MoE dispatcher: torch all-to-all over ep=%d%s", topology.ep_size,
                 " (moe.dispatcher=auto: DeepEP runs only when asked for, docs/moe.md)"
                 if settings.dispatcher == "auto" else "")
    return AllToAllDispatcher(num_experts, topology.ep_group if topology.ep_size > 1 else None,
                              fused=settings.fused_kernels)


def expert_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that belong to one EP rank (reduced over its EDP group, never with other ranks' experts)."""
    return [p for b in moe_blocks(model) for p in b.experts.parameters()]
