"""memory=auto: every memory preset predicted for this run, the fastest one that fits chosen, before the build.

The presets are hydra_conf/memory/*.yaml (all but `budget`, which needs a measured probe, and `auto` itself); the
cost model is ds_ulysses_ext/memory/planner.py with its calibrated coefficients. A preset fits when its predicted
peak is at most FIT_FRACTION of the GPU's memory and, with offload, the node's ranks' pinned host memory is at most
FIT_FRACTION of the host's. The choice is the fastest that fits, where presets within TIE_FRACTION of the fastest
time count as equally fast; among those, one that pins no host memory wins, then the least GPU memory. When none fits, the run is refused with the longest
data.seq_len that would fit.
scripts/plan.py prints the same table from a laptop (no CUDA, nothing built).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from omegaconf import OmegaConf

from configs import TrainConfig
from configs.compose import HYDRA_CONF_DIR
from configs.errors import ConfigError
from configs.memory import AUTO_FILLS, MemoryConfig
from configs.precision import bf16_weights
from configs.model import shape_arch
from ds_ulysses_ext.memory.planner import ModelShape, Policy, Prediction, RunShape, load_calibration, predict

from ..ds.config import effective_zero_stage

log = logging.getLogger(__name__)

GIB = 2 ** 30
# a preset fits when its predicted peak allocation is at most this share of the GPU's memory: the allocator
# reserves 5-15% over what is allocated (docs/benchmarks.md), and the model's error is up to ~15% (docs/memory.md)
FIT_FRACTION = 0.85
# presets predicted within this fraction of the fastest one's step time count as equally fast (the model's time error
# on the calibration rows is mostly under 5%): one of them without host memory is chosen, then the least GPU memory
TIE_FRACTION = 0.03
NOT_CANDIDATES = ("auto", "budget")  # budget chooses from a measured probe, which a plan does not have
# presets predicted and listed but never chosen, while no step of theirs has run on a GPU. Empty since the attention
# offload presets ran on an H200 (2026-12-02): their copies hid behind compute (except_attention_offload_tiled 11.83 s
# against except_attention's 11.90 s at 128k), and except_attention_offload moves the same tensors the same way
NOT_YET_MEASURED: tuple = ()


@dataclass(frozen=True)
class Candidate:
    name: str
    prediction: Prediction
    fits_gpu: bool
    fits_host: bool
    measured: bool = True  # False: a preset no GPU has run yet, listed but never chosen
    refused: str = ""  # what validate says of this run with the preset (a 2-layer model and a 4-layer block): never chosen

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host and self.measured and not self.refused


@dataclass(frozen=True)
class MemoryPlan:
    candidates: tuple
    choice: Optional[str]
    gpu_gib: float
    host_gib: float
    run: RunShape

    def table(self) -> str:
        head = (f"{'preset':<32}{'peak GiB':>10}{'host GiB':>10}{'step s':>10}{'tok/s/GPU':>11}  fits "
                f"(GPU {self.gpu_gib:.0f} GiB x {FIT_FRACTION}, host {self.host_gib:.0f} GiB)")
        lines = [head]
        for c in sorted(self.candidates, key=lambda c: c.prediction.step_s):
            p = c.prediction
            why = ("yes" if c.fits else f"no: refused ({_first_sentence(c.refused)})" if c.refused
                   else "no: GPU" if not c.fits_gpu else "no: host" if not c.fits_host
                   else "not chosen: not run on a GPU yet")
            mark = "  <- chosen" if c.name == self.choice else ""
            lines.append(f"{c.name:<32}{p.peak_gib:>10.1f}{p.host_gib:>10.1f}{p.step_s:>10.3g}"
                         f"{p.tokens_per_s_per_gpu:>11,.0f}  {why}{mark}")
        return "\n".join(lines)


def preset_fields() -> dict:
    """name -> MemoryConfig field values (defaults filled in) for every candidate preset in hydra_conf/memory/."""
    out = {}
    for path in sorted((HYDRA_CONF_DIR / "memory").glob("*.yaml")):
        if path.stem in NOT_CANDIDATES:
            continue
        values = OmegaConf.to_container(OmegaConf.load(path)) or {}
        out[path.stem] = {**dataclasses.asdict(MemoryConfig()), **values}
    return out


def model_shape(cfg: TrainConfig) -> ModelShape:
    """model.arch, or a pretrained checkpoint's config.json (configs/model.py shape_arch: read as JSON)."""
    arch = dict(shape_arch(cfg.model))
    if isinstance(arch.get("text_config"), Mapping):  # a VL checkpoint (qwen3_vl): its language model is the shape
        arch = {**arch, **arch["text_config"]}
    return ModelShape.from_arch(arch, cfg.model.family)


def planned_backend(cfg: TrainConfig, on_gpu: bool = True) -> str:
    """The attention kernel a GPU run gets: auto is FA4 where flash_attn.cute is installed (not imported here)."""
    name = cfg.model.attn_backend
    if name == "auto":
        name = "fa4" if on_gpu and _installed("flash_attn.cute") else "sdpa"
    return "fa4" if name == "fa4" else "sdpa"  # flash_attn (FA2) is costed as SDPA/cuDNN


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def run_shape(cfg: TrainConfig, world_size: int, ranks_per_node: int, on_gpu: bool = True,
              seq_len: Optional[int] = None) -> RunShape:
    zero = effective_zero_stage(cfg, world_size)  # one rank runs ZeRO-3 as ZeRO-2 unless it offloads parameters
    return RunShape(seq_len=seq_len or cfg.data.seq_len, cp=cfg.parallelism.cp, world=world_size,
                    micro_batch=cfg.trainer.micro_batch_size, zero_stage=zero,
                    master_weights=cfg.deepspeed.master_weights if bf16_weights(cfg.precision) else "fp32",
                    attn_backend=planned_backend(cfg, on_gpu),
                    kernels="fused" if on_gpu and cfg.model.kernels != "none" else "none",
                    moe_recompute=cfg.moe.recompute, moe_group=cfg.moe.recompute_group_size,
                    moe_lean=lean_moe(cfg, on_gpu), grads_in_backward=bool(cfg.trainer.optimizer_in_backward),
                    loss_chunk=cfg.trainer.loss_chunk_size, ranks_per_node=ranks_per_node)


def lean_moe(cfg: TrainConfig, on_gpu: bool) -> bool:
    """Whether the MoE layers will run moe/lean_pass.py (its `applies`, from the config): ep=1 through the all-to-all
    dispatcher, the fused kernels on a GPU in bf16, Qwen3-layout experts (not GPT-OSS's), inputs not offloaded."""
    return (on_gpu and cfg.model.kernels != "none" and bf16_weights(cfg.precision) and cfg.parallelism.ep == 1
            and cfg.moe.dispatcher != "deepep" and not cfg.moe.offload_inputs and cfg.model.family != "gpt_oss")


def _candidate(name: str, fields: dict, shape: ModelShape, run: RunShape, coef: dict, gpu_gib: float,
               host_gib: float, refused: str = "") -> Candidate:
    p = predict(shape, run, Policy.of(fields), coef)
    return Candidate(name, p, fits_gpu=p.peak_gib <= FIT_FRACTION * gpu_gib,
                     fits_host=p.host_gib * run.ranks_per_node <= FIT_FRACTION * host_gib,
                     measured=name not in NOT_YET_MEASURED, refused=refused)


def refusals(cfg: TrainConfig, world_size: int) -> dict:
    """preset -> validate's message for this run with that preset ("" where it passes). The cost model can predict a
    preset that the run would refuse (block recompute of more layers than the model has), and auto must never choose
    what the run then stops on."""
    from configs.validate import validate
    out = {}
    for name in preset_fields():
        try:
            validate(chosen_config(cfg, name), world_size)
            out[name] = ""
        except ConfigError as err:
            out[name] = str(err)
    return out


def _first_sentence(message: str) -> str:
    return message.split("; ")[0].split("\n")[0][:100]


def _choose(fitting: list) -> Optional[str]:
    """The fastest; presets within TIE_FRACTION of its time count as equally fast, and among them one without host
    memory wins, then the least GPU memory. Pinned host memory is taken from every rank of a node at once, from the
    page cache and the data loaders, and a host out of memory kills the run without a Python error; when it buys no
    time, the GPU memory it saves (both fit) is not worth that."""
    if not fitting:
        return None
    fastest = min(c.prediction.step_s for c in fitting)
    tied = [c for c in fitting if c.prediction.step_s <= (1 + TIE_FRACTION) * fastest]
    return min(tied, key=lambda c: (c.prediction.host_gib > 0, c.prediction.peak_gib, c.prediction.step_s)).name


def plan_memory(cfg: TrainConfig, world_size: int, gpu_gib: float, host_gib: float, ranks_per_node: int = 1,
                on_gpu: bool = True) -> MemoryPlan:
    """Every candidate preset predicted for this run; the choice is the fastest that fits (None: none fits)."""
    shape, run = model_shape(cfg), run_shape(cfg, world_size, ranks_per_node, on_gpu)
    coef = load_calibration()["coefficients"]
    refused = refusals(cfg, world_size)
    cands = tuple(_candidate(n, f, shape, run, coef, gpu_gib, host_gib, refused[n])
                  for n, f in preset_fields().items())
    choice = _choose([c for c in cands if c.fits])
    return MemoryPlan(cands, choice, gpu_gib, host_gib, run)


def longest_fitting(cfg: TrainConfig, world_size: int, gpu_gib: float, host_gib: float, ranks_per_node: int = 1,
                    on_gpu: bool = True) -> tuple[int, Optional[str]]:
    """The longest data.seq_len (a multiple of 1024 x cp, at most the configured one) that some preset fits, and
    that preset; (0, None) when not even 1024 x cp tokens fit."""
    shape, coef = model_shape(cfg), load_calibration()["coefficients"]
    unit = 1024 * cfg.parallelism.cp
    best, best_name = 0, None
    refused = refusals(cfg, world_size)
    for name, fields in preset_fields().items():
        def fits(k: int) -> bool:
            run = run_shape(cfg, world_size, ranks_per_node, on_gpu, seq_len=k * unit)
            return _candidate(name, fields, shape, run, coef, gpu_gib, host_gib, refused[name]).fits
        lo, hi = 0, max(cfg.data.seq_len // unit, 1)
        while lo < hi:  # largest k with fits(k); peaks grow with the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo * unit > best:
            best, best_name = lo * unit, name
    return best, best_name


def refusal(cfg: TrainConfig, plan: MemoryPlan, world_size: int, on_gpu: bool = True) -> ConfigError:
    longest, name = longest_fitting(cfg, world_size, plan.gpu_gib, plan.host_gib, plan.run.ranks_per_node, on_gpu)
    fix = (f"the longest that fits is data.seq_len={longest} (memory={name}); " if longest else
           "not even 1024 tokens per rank fit; ")
    return ConfigError(
        f"memory=auto: no memory preset fits data.seq_len={cfg.data.seq_len} at parallelism.cp={cfg.parallelism.cp}, "
        f"micro-batch {cfg.trainer.micro_batch_size}, on a {plan.gpu_gib:.0f} GiB GPU (a preset fits at "
        f"{FIT_FRACTION:.0%} of it) and a {plan.host_gib:.0f} GiB host:\n{plan.table()}\n{fix}or raise "
        "parallelism.cp over more GPUs, or name a preset (memory=<name>) to run it anyway")


def chosen_config(cfg: TrainConfig, name: str) -> TrainConfig:
    """cfg with the preset's policy fields in place of memory=auto's (and auto off, so the run reads the preset)."""
    fields = {k: v for k, v in preset_fields()[name].items() if k in AUTO_FILLS}
    memory = dataclasses.replace(cfg.memory, auto=False, auto_gpu_gib=0.0, auto_host_gib=0.0, **fields)
    return dataclasses.replace(cfg, memory=memory)


def device_gpu_gib(device) -> float:
    import torch
    return torch.cuda.get_device_properties(device).total_memory / GIB


def host_total_gib() -> float:
    """Physical memory of this host (the same on every rank of a node, unlike what is available right now)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def apply_auto_memory(cfg: TrainConfig, world_size: int, device, ranks_per_node: int,
                      is_main: bool = True) -> TrainConfig:
    """Before the model is built: log the prediction table and the choice, return cfg with the chosen preset.
    Raises ConfigError when none fits. On CPU without memory.auto_gpu_gib there is no GPU to fit: memory=none."""
    mem = cfg.memory
    on_gpu = device.type == "cuda"
    if mem.auto_gpu_gib > 0:
        gpu_gib = mem.auto_gpu_gib
    elif on_gpu:
        gpu_gib = device_gpu_gib(device)
    else:
        if is_main:
            log.info("memory=auto: no GPU on this %s run and no memory.auto_gpu_gib, so no memory to fit: "
                     "memory=none", device.type)
        return chosen_config(cfg, "none")
    host_gib = mem.auto_host_gib or host_total_gib()
    plan = plan_memory(cfg, world_size, gpu_gib, host_gib, ranks_per_node, on_gpu)
    if plan.choice is None:
        raise refusal(cfg, plan, world_size, on_gpu)
    if is_main:
        p = next(c.prediction for c in plan.candidates if c.name == plan.choice)
        log.info("memory=auto: each preset predicted for data.seq_len=%d, cp=%d, %d local tokens "
                 "(ds_ulysses_ext/memory/planner.py, calibrated on one H200):\n%s", cfg.data.seq_len,
                 cfg.parallelism.cp, plan.run.local_tokens, plan.table())
        log.info("memory=auto chose memory=%s: predicted %.1f GiB peak, %.3g s per step", plan.choice, p.peak_gib,
                 p.step_s)
        for caveat in plan_caveats(cfg):
            log.warning("memory=auto: %s", caveat)
    return chosen_config(cfg, plan.choice)


def plan_caveats(cfg: TrainConfig) -> list[str]:
    """What the prediction table cannot vouch for on this run, one sentence each, for the training log and
    scripts/plan.py: a prediction outside what the calibration rows measured must say so where it is read."""
    caveats = []
    if cfg.precision == "fp8":  # FP8 linears save the same bf16 inputs; their GEMM time has no calibration row
        caveats.append("under precision=fp8 the planner's step model is bf16's (no FP8 row in its calibration), so "
                       "the predicted step time is bf16's; the peak counts FP8 linears' saved tensors as bf16 "
                       "linears' (the same bf16 inputs)")
    linear = model_shape(cfg).linear_layers
    if linear:
        caveats.append(f"this model's {linear} linear-attention layers have no calibration row: their recurrence's "
                       "time is costed at the dense matmul rate, and the step measured against it took 4x the "
                       "prediction (Qwen3.5-35B-A3B x 4 on an H100 at 81,920 tokens: 5.27 s against 1.3 s; its peak "
                       "within 6%, docs/linear_attention.md); read the step times as a lower bound")
    return caveats


def calibration_case(row: dict) -> tuple[ModelShape, RunShape, Policy]:
    """A measured row of planner_calibration.json as the planner's inputs (presets and models from hydra_conf/).
    A row's `memory_overrides` are the run's memory.* overrides on top of its preset, as on the command line."""
    model = OmegaConf.to_container(OmegaConf.load(HYDRA_CONF_DIR / "model" / f"{row['model']}.yaml"))
    fields = {**dataclasses.asdict(MemoryConfig()),
              **(OmegaConf.to_container(OmegaConf.load(HYDRA_CONF_DIR / "memory" / f"{row['memory']}.yaml")) or {})}
    unknown = set(row.get("memory_overrides", {})) - set(fields)
    if unknown:
        raise KeyError(f"calibration row memory_overrides: {sorted(unknown)} are not MemoryConfig fields")
    fields.update(row.get("memory_overrides", {}))
    world = row.get("world", 1)
    run = RunShape(seq_len=row["seq_len"], cp=row["cp"], world=world,
                   zero_stage=row.get("zero_stage", 3 if world > 1 else 2),
                   master_weights=row["master_weights"], attn_backend=row["attn_backend"], kernels=row["kernels"],
                   moe_recompute=row["moe_recompute"], moe_group=row.get("moe_group", 1),
                   shared_master=row.get("shared_master", True), moe_lean=row.get("moe_lean", False),
                   grads_in_backward=row.get("grads_in_backward", False))
    return ModelShape.from_arch(model["arch"], model["family"]), run, Policy.of(fields)
