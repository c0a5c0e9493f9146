"""Build the model and the DeepSpeed engine for a validated plan.

Order matters: the DeepSpeed config object must exist before the model is created so that ZeRO-3
partitions parameters while they are created (HfDeepSpeedConfig -> zero.Init inside transformers)
instead of materialising the whole model on every rank (DeepSpeed issue #7458).
"""
from __future__ import annotations

import logging

import torch

from configs import Plan, TrainConfig
from configs.moe import deepep_tokens_per_rank
from configs.precision import bf16_weights
from ds_ulysses_ext import CPCausalLM, Topology, enable_context_parallel
from ds_ulysses_ext.linear_attention import set_linear_attn_kernel
from ds_ulysses_ext.kernels import apply_fused_kernels
from ds_ulysses_ext.kernels.fp8 import apply_fp8, check_fp8_device, resolve_compile
from ds_ulysses_ext.memory import ProbeResult, apply_memory_policies
from ds_ulysses_ext.moe import moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel, expert_parameters

from ..checkpoints.buffers import restore_from_export
from ..run.schedule import build_scheduler
from .clipping_adamw import ClippingAdamW
from .config import optimizer_params, to_deepspeed_dict
from .grad_reduction import check_engine
from .hf_config import hf_config_of
from .init import init_random_weights
from .patches import mark_expert_parallel, no_reduction_alone, share_master_weights

try:  # transformers >= 5; an older one builds with HF's own init, on the CPU, as before
    from transformers.initialization import no_init_weights
except ImportError:
    no_init_weights = None

log = logging.getLogger(__name__)

_HF_DS_CONFIG = []  # transformers reads the live HfDeepSpeedConfig through a weakref: keep it alive


def model_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if bf16_weights(cfg.precision) else torch.float32


def refuse_missing_weights(path, missing) -> None:
    """HF starts a parameter the checkpoint lacks from random values and only logs it: a checkpoint of another layout
    (other key prefixes, a pruned or partial save) would then train a partly random model that looks loaded."""
    if missing:
        names = sorted(missing)
        raise RuntimeError(
            f"model.path={path}: {len(names)} parameters of the model have no weights in the checkpoint (e.g. "
            f"{', '.join(names[:3])}), so they would start from random values; check that the folder is a complete "
            "save of this model family (model.family), or use model.source=config for a random init")


def build_hf_model(cfg: TrainConfig, ds_dict: dict, device: torch.device = torch.device("cpu")):
    """Random init outside ZeRO-3 builds on `device`; a pretrained model comes back on the CPU (build() moves
    it), a ZeRO-3 one partitioned by zero.Init."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from ds_ulysses_ext.hf_classes import register_causal_lms
    from ds_ulysses_ext.moe.latent_model import register_latent_moe
    register_latent_moe()
    register_causal_lms()  # mistral4, the Qwen3-VL checkpoints: AutoModelForCausalLM learns them here
    _HF_DS_CONFIG.clear()  # a previous build's ZeRO-3 config must not leak into a ZeRO-2 build
    zero3 = ds_dict["zero_optimization"]["stage"] == 3
    if zero3:
        _HF_DS_CONFIG.append(HfDeepSpeedConfig(ds_dict))
    m = cfg.model
    torch.manual_seed(cfg.run.seed)  # random init is identical on every rank and every layout
    if m.source == "pretrained":
        model, info = AutoModelForCausalLM.from_pretrained(m.path, dtype=model_dtype(cfg), output_loading_info=True,
                                                           attn_implementation=hf_attn(m))
        refuse_missing_weights(m.path, info["missing_keys"])
        # what the stock class dropped (our MoE routers' expert_bias): build() puts it back once our blocks are in
        model._unread_keys = set(info["unexpected_keys"])
    else:
        hf_config = hf_config_of(m)
        if zero3 or no_init_weights is None:  # zero.Init partitions while HF builds: that path stays HF's own
            model = AutoModelForCausalLM.from_config(hf_config, dtype=model_dtype(cfg), attn_implementation=hf_attn(m))
        else:
            model = _uninitialised_on(device, hf_config, model_dtype(cfg), hf_attn(m))
        init_random_weights(model, cfg.run.seed, getattr(hf_config, "initializer_range", 0.02))
    # HF's init (run on some paths, skipped on others) draws from the global RNG: leave one state for all
    torch.manual_seed(cfg.run.seed)
    model.config.use_cache = False
    return model.train()


def hf_attn(model_cfg) -> str:
    """The attention HF builds the model with; enable_context_parallel replaces it (ds_ulysses_ext/models.py)."""
    from ds_ulysses_ext.models import SUPPORTED
    family = SUPPORTED.get(model_cfg.family)
    return family.hf_attn if family is not None else "sdpa"


def _uninitialised_on(device: torch.device, hf_config, dtype: torch.dtype, attn: str = "sdpa"):
    """The model with its parameters on `device`, their values unset: init_random_weights writes every one.

    Skipping HF's init saves its CPU time (19 s for the Llama-3.2-1B shape on 2 cores), and empty
    parameters are never copied from the CPU. The buffers (RoPE inv_freq) are computed on the CPU as before
    and copied, not recomputed on the device, where pow may round differently."""
    from transformers import AutoModelForCausalLM
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn)
    cpu_buffers = dict(model.named_buffers())
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(cpu_buffers[name])
    # HF ties inside the init_weights that no_init_weights turns off; tied here, after the move, because
    # to_empty unties parameters on a device whose tensors cannot share a CPU tensor's type (meta)
    model.tie_weights()
    return model


def build(cfg: TrainConfig, plan: Plan, topo: Topology, device: torch.device, load_universal: bool = False):
    """Returns (engine, hf_model, loss_scale)."""
    import deepspeed
    ds_dict = to_deepspeed_dict(cfg, plan, load_universal)
    if cfg.precision == "fp8":
        check_fp8_device(device, cfg.fp8.emulate_on_cpu)
    hf = build_hf_model(cfg, ds_dict, device)
    enable_context_parallel(hf, topo, backend=cfg.model.attn_backend)
    set_linear_attn_kernel(hf, cfg.model.linear_attn_kernel)  # auto on a model without linear layers: a no-op
    stage = ds_dict["zero_optimization"]["stage"]
    if is_moe(cfg):
        enable_expert_parallel(hf, topo, moe_settings(cfg))
        if topo.ep_size > 1:
            mark_expert_parallel(expert_parameters(hf), topo)  # before deepspeed.initialize partitions them
    fp8 = None
    if cfg.precision == "fp8":  # before the fused kernels: their projection groups take plain nn.Linear only
        compile_casts = resolve_compile(cfg.fp8.compile, cfg.fp8.recipe, device.type)
        fp8 = apply_fp8(hf, cfg.fp8.recipe, cfg.fp8.linears, compile_casts, partitioned=stage == 3,
                        amax_history=cfg.fp8.amax_history, device=device)
        log.info("%s", fp8)
    # before the memory policies: they wrap these forwards (a tiled MLP runs the fused product per tile)
    kernels = apply_fused_kernels(hf, cfg.model.kernels, device, loss_head=cfg.model.loss_head,
                                  projections=cfg.model.projection_groups)
    restore_from_export(hf, cfg.model.path, hf.__dict__.pop("_unread_keys", ()))
    policies = _apply_memory(hf, cfg)
    model = CPCausalLM(hf, loss_chunk_size=cfg.trainer.loss_chunk_size, fused_loss=cfg.trainer.fused_loss,
                       head_kernel=kernels.head, fused_rows=cfg.model.kernels != "none")
    if stage != cfg.deepspeed.zero_stage:
        log.info("deepspeed.zero_stage=%d on one rank runs as ZeRO-%d: same memory, less per-step overhead "
                 "(engine/ds/config.py)", cfg.deepspeed.zero_stage, stage)
    if stage != 3:
        model.to(device)
    p = optimizer_params(cfg)
    adamw = dict(lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"])
    optimizer = None  # ZeRO-Offload: DeepSpeed builds its CPU Adam from ds_dict["optimizer"]
    if stage == 0:  # one rank, no ZeRO: the optimizer steps the parameters and clips inside its fused kernel
        optimizer = ClippingAdamW(model.parameters(), cfg.trainer.grad_clip,
                                  skip_nonfinite=cfg.trainer.on_nonfinite == "skip", **adamw)
        if cfg.trainer.optimizer_in_backward:
            optimizer.step_in_backward()
            log.info("trainer.optimizer_in_backward: each parameter steps in backward as its gradient completes "
                     "and the gradient is freed (the optimizer phase's work is timed in the backward's)")
    elif "optimizer" not in ds_dict:
        # fused: one kernel over DeepSpeed's flat fp32 partition instead of a chain of foreach passes (the
        # stock-HF anchor steps with fused=True too); torch has it for CUDA and CPU alike
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **adamw)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_dict, mpu=topo,
                                      lr_scheduler=build_scheduler(cfg.trainer))
    if stage == 0:
        no_reduction_alone(engine)
    scale = check_engine(engine, plan)
    if share_master_weights(engine):  # one copy of the weights where the master copy would equal them
        log.info("master weights share the parameters' storage (%s): no second copy", cfg.deepspeed.master_weights)
    log.info("gradient reduction: ZeRO-%d, per-rank loss share scaled by %g", engine.zero_optimization_stage(), scale)
    engine.memory_policies = policies
    engine.fp8_report = fp8
    return engine, hf, scale


def is_moe(cfg: TrainConfig) -> bool:
    from configs.moe import EP_FAMILIES
    return cfg.model.family in EP_FAMILIES


def moe_step_end(hf, cfg: TrainConfig, apply_bias: bool) -> dict:
    """After each optimizer step of an MoE run: the step's load-imbalance figure and, with moe.balance=bias, the
    routers' bias update (every rank the same). Collective."""
    ctx = hf._moe_context
    rate = cfg.moe.bias_update_rate if apply_bias else 0.0
    return ctx.finish_step(rate, moe_blocks(hf))


def moe_settings(cfg: TrainConfig) -> MoESettings:
    m = cfg.moe
    return MoESettings(dispatcher=m.dispatcher, balance=m.balance, aux_loss_coef=m.aux_loss_coef,
                       bias_update_rate=m.bias_update_rate, recompute=m.recompute,
                       recompute_group_size=m.recompute_group_size, offload_inputs=m.offload_inputs,
                       max_tokens_per_rank=deepep_tokens_per_rank(cfg) if m.dispatcher == "deepep" else 0,
                       fused_kernels=cfg.model.kernels != "none")


def _apply_memory(hf, cfg: TrainConfig):
    # recompute=budget decides from a probe of peak memory given in the config (two short runs'
    # peak_mem_gib); without one it recomputes every layer and says so in a warning (memory/budget.py)
    mem = cfg.memory
    probe = None
    if mem.probe_none_gib > 0:
        probe = ProbeResult(mem.probe_none_gib, mem.probe_full_gib, hf.config.num_hidden_layers)
    return apply_memory_policies(hf, mem, probe)
