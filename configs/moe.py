"""MoEConfig: how MoE layers route, balance, dispatch and save memory (docs/moe.md). Read only for MoE families."""

from dataclasses import dataclass

from configs.device import runs_on_cuda
from configs.errors import one_of, require
from configs.precision import bf16_weights

MOE_DISPATCHERS = ("auto", "alltoall", "deepep")
MOE_BALANCES = ("aux", "bias", "none")
MOE_RECOMPUTE = ("none", "act", "experts")


@dataclass
class MoEConfig:
    # auto: the torch all-to-all (DeepEP runs only when asked for by name until its path is verified: docs/moe.md)
    dispatcher: str = "auto"
    # aux: per-sequence balance loss (layout-independent); bias: aux-loss-free expert-bias update; none
    balance: str = "aux"
    aux_loss_coef: float = 1e-3  # weight of the balance loss (summed over layers, mean over sequences)
    bias_update_rate: float = 1e-3  # moe.balance=bias: bias step per optimizer step
    # none | act (recompute the SwiGLU activation) | experts (keep only the dispatched inputs, rerun the expert FFN
    # in backward, recompute_group_size experts at a time; under moe/lean_pass.py, at ep=1 on CUDA: keep no h and run
    # only the first projection again)
    recompute: str = "none"
    recompute_group_size: int = 1
    offload_inputs: bool = False  # with recompute=experts: the dispatched inputs wait for backward in pinned host memory


# families whose MoE blocks ds_ulysses_ext.moe replaces (and so can split over ep): every MoE family of the registry
# (gpt_oss: HF's GptOssMLP becomes our block with GPT-OSS's router, biases and clamped SwiGLU; deepseek_v3,
# glm4_moe_lite, glm4_moe: HF's DeepseekV3MoE-style block with its biased, group-limited sigmoid router; mistral4: the
# same block with a softmax router; cohere2_moe: top-k then softmax / sigmoid, averaged shared expert; qwen3_vl_moe:
# Qwen3-MoE's block in a VL checkpoint's language model; qwen3_next, qwen3_5_moe_text: Qwen3-MoE's router with a
# sigmoid-gated shared expert; bailing_hybrid: DeepSeek-V3's block, docs/moe.md)
EP_FAMILIES = ("qwen3_moe", "latent_moe", "gpt_oss", "deepseek_v3", "glm4_moe_lite", "glm4_moe", "mistral4",
               "cohere2_moe", "qwen3_vl_moe", "qwen3_next", "qwen3_5_moe_text", "bailing_hybrid")


def check_moe(cfg, world_size: int) -> None:
    """The moe.* rules and EP's rules that need more than the expert count (configs/model.py check_experts checks
    that)."""
    moe, ep, family, arch = cfg.moe, cfg.parallelism.ep, cfg.model.family, cfg.model.arch
    for key, value, choices in (("dispatcher", moe.dispatcher, MOE_DISPATCHERS), ("balance", moe.balance, MOE_BALANCES),
                                ("recompute", moe.recompute, MOE_RECOMPUTE)):
        one_of(f"moe.{key}", value, choices)
    require(moe.aux_loss_coef >= 0, f"moe.aux_loss_coef={moe.aux_loss_coef} must be >= 0 (0: the loss is logged only)")
    require(moe.bias_update_rate > 0 or moe.balance != "bias",
            f"moe.balance=bias needs moe.bias_update_rate > 0, got {moe.bias_update_rate}")
    require(moe.recompute_group_size >= 1, f"moe.recompute_group_size={moe.recompute_group_size} must be >= 1 "
            "(1 = one expert at a time)")
    require(not moe.offload_inputs or moe.recompute == "experts",
            f"moe.offload_inputs=true needs moe.recompute=experts (got {moe.recompute}): then the dispatched inputs are "
            "all the experts keep for backward, and they are what goes to host memory")
    is_moe = family in EP_FAMILIES
    require(is_moe or (moe.recompute == "none" and not moe.offload_inputs),
            f"moe.recompute={moe.recompute} / moe.offload_inputs={moe.offload_inputs} apply to MoE layers, and "
            f"model.family={family} has none we split; set moe=default")
    require(ep == 1 or is_moe,
            f"parallelism.ep={ep} with model.family={family}: experts are split only for {', '.join(EP_FAMILIES)}; "
            "set parallelism.ep=1")
    require(ep == 1 or cfg.deepspeed.zero_stage == 3,
            f"parallelism.ep={ep} needs deepspeed=zero3 (got zero_stage={cfg.deepspeed.zero_stage}): ZeRO-2 would "
            "average different ranks' experts together; use deepspeed=zero3 or parallelism.ep=1")
    require(not arch.get("output_router_logits", False),
            "model.arch.output_router_logits=true asks for HF's load-balancing loss, which pools the batch and every "
            "layer and so changes with the cp split; set it false and use moe.balance=aux (moe.aux_loss_coef)")
    act = arch.get("hidden_act", "silu")
    # GPT-OSS's experts compute their own clamped SwiGLU whatever hidden_act says (HF's GptOssExperts never reads it)
    require(not is_moe or family == "gpt_oss" or act == "silu",
            f"model.arch.hidden_act={act}: our experts compute SwiGLU (silu); use a model with silu experts")
    if moe.dispatcher == "deepep":
        import importlib.util
        require(importlib.util.find_spec("deep_ep") is not None,
                "moe.dispatcher=deepep needs the optional deep_ep package (DeepEP's 1.x line built from its "
                "repository; the PyPI sdist does not build, docs/moe.md); use moe.dispatcher=alltoall or auto")
        require(runs_on_cuda(cfg.device), f"moe.dispatcher=deepep needs CUDA, and this run is on the CPU "
                f"(device={cfg.device}); use moe.dispatcher=alltoall on CPU")
        # DeepEP moves tokens through its own NVLink/NVSHMEM buffers between GPUs, not through the process group; it
        # has never run under gloo, whose use on CUDA is ranks that share a GPU, and a hang there would say nothing
        require(cfg.dist_backend != "gloo",
                "moe.dispatcher=deepep with dist_backend=gloo: DeepEP exchanges tokens through its own buffers between "
                "GPUs and is untried under gloo (ranks sharing a GPU); use moe.dispatcher=alltoall (or auto) there")
        require(ep in (1, 2, 4, 8), f"moe.dispatcher=deepep with parallelism.ep={ep}: DeepEP's normal mode runs on "
                "2, 4 or 8 ranks of one node, its low-latency mode here at ep=1; use moe.dispatcher=alltoall or auto")
        if ep == 1:
            _check_low_latency(cfg)


def deepep_tokens_per_rank(cfg) -> int:
    """The most tokens one MoE call sees on a rank: the micro-batch's rows x the local sequence (padded to a
    multiple of 2 cp, the zigzag layout's; never less than Ulysses' multiple of cp), rounded up to DeepEP's 4."""
    cp = cfg.parallelism.cp
    local = -(-cfg.data.seq_len // (2 * cp)) * 2
    tokens = cfg.trainer.micro_batch_size * local
    return -(-tokens // 4) * 4


def _check_low_latency(cfg) -> None:
    # DeepEP's low-latency buffer is sized for decoding batches: refuse here what its kernels cannot take, with the
    # fix, rather than at the first MoE call (ds_ulysses_ext/moe/deepep.py holds the limits)
    from ds_ulysses_ext.errors import UnsupportedError
    from ds_ulysses_ext.moe.deepep import _ll_max_tokens_per_rank, check_low_latency
    import torch
    arch = cfg.model.arch
    dim = int(arch.get("latent_size", 0) or 0) or int(arch.get("hidden_size", 0) or 0)
    experts = next((int(arch[k]) for k in ("num_experts", "num_local_experts") if arch.get(k)), 0)
    top_k = int(arch.get("num_experts_per_tok", 1) or 1)
    require(bf16_weights(cfg.precision), f"moe.dispatcher=deepep at ep=1 (DeepEP's low-latency mode) moves bf16 tokens "
            f"only; set precision=bf16 or use moe.dispatcher=alltoall (got precision={cfg.precision})")
    tokens = deepep_tokens_per_rank(cfg)
    try:
        # the expert width and top-k are checked here when the preset names them, else when the model is built
        buffer = min(tokens, _ll_max_tokens_per_rank() // 4 * 4)
        check_low_latency(tokens, dim or 2048, top_k, experts or 4, 1, buffer, torch.bfloat16)
    except UnsupportedError as err:
        require(False, f"moe.dispatcher=deepep at ep=1 (DeepEP's low-latency mode), {tokens} tokens per rank "
                f"(trainer.micro_batch_size x data.seq_len / parallelism.cp): {err}")
