"""FP8 linears (precision=fp8): the decoder's nn.Linear layers become torchao Float8Linear, instance by instance.

Shapes: x [B, s, H_in] -> y [B, s, H_out] as before. Each of a chosen linear's three GEMMs (y = x W^T, dx = dy W,
dW = dy^T x) takes float8 operands with the recipe's scales and accumulates in fp32; its output, its saved input
and every parameter stay bf16. Recipes (torchao's names, configs/precision.py): `tensorwise` one scale per tensor
(the default: its step measured faster); `rowwise` one per row along the GEMM's reduction (per token for
activations, per output feature for the weight); `rowwise_with_gw_hp` rowwise with the weight gradient's GEMM in bf16.

Why torchao's Float8Linear rather than our own: its casts, scale rules and the three GEMMs' layouts are what
torchtitan trains with and tests; we choose which modules it replaces and leave HF's classes untouched (the swap is
per instance: a new module object in the parent's slot, holding the same weight Parameter).

What stays bf16, and why:
- attention itself: there is no FP8 attention backward on Hopper;
- lm_head: outside the decoder; the fused loss head reads its weight directly (ds_ulysses_ext/lm.py);
- routers (`gate`, `router`, `shared_expert_gate`): a router's logits choose experts, and a rounding flip there is
  a different expert, not a rounding error;
- the MoE experts: our grouped GEMMs (moe/experts.py), not nn.Linear; FP8 grouped GEMMs (torchao's fused casts and
  torch._scaled_grouped_mm) measured 0.60-0.82x bf16's speed on the Qwen3-30B-A3B shape at 16k-64k tokens (each
  step casts every expert's weights twice; scripts/bench/bench_fp8_grouped.py, docs/precision.md);
- a linear whose in or out features are not multiples of 16 (the FP8 GEMM's alignment);
- with fp8.linears=mlp, everything but the dense MLPs' gate/up/down projections (shared experts included).
Under CP each rank's linears see its own tokens: rowwise's activation scales are per token, so the forward GEMMs
equal cp=1's; tensorwise scales take the amax of the local shard, and the weight-gradient scales of every recipe
but rowwise_with_gw_hp are over the local tokens (docs/precision.md).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import UnsupportedError
from ..hf_code import MLP_NAMES, is_plain_gated_mlp
from .fp8_delayed import bind_delayed_mlp, delayed_linears
from .fp8_scales import DelayedScales

log = logging.getLogger(__name__)

ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
ALIGN = 16  # torch._scaled_mm needs both GEMM dimensions divisible by 16
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell


@dataclass
class Fp8Report:
    recipe: str
    fp8: Counter = field(default_factory=Counter)  # leaf name -> how many run in FP8
    bf16: dict = field(default_factory=dict)  # leaf name -> why it stays bf16
    compiled: str = "false"  # the casts' compiled regions as they formed: regions, mlp, linear, false, or delayed
    # (every FP8 linear in a delayed site: kernels/fp8_casts.py's kernels, nothing compiled)
    whole_mlps: int = 0  # gated MLPs compiled as one region (compiled=mlp); their linears' own forwards compiled too
    qkv_regions: int = 0  # attention modules whose q/k/v run as one compiled region (compiled=regions)
    per_linear_why: str = ""  # why fp8.compile=mlp / regions fell back to compiling each linear alone, where it did
    delayed_mlps: int = 0  # fp8.recipe=delayed: gated MLPs whose casts take delayed scales (kernels/fp8_delayed.py)
    delayed_qkv: int = 0  # fp8.recipe=delayed: attention q/k/v groups with delayed scales (fp8.linears=all)
    delayed_o: int = 0  # fp8.recipe=delayed: o_proj linears with delayed scales (fp8.linears=all)
    dynamic_why: str = ""  # fp8.recipe=delayed: why FP8 MLPs left dynamic tensorwise scaling kept it, where some did
    scales: Optional[DelayedScales] = None  # fp8.recipe=delayed: the scale state, rolled after each optimizer step

    def as_dict(self) -> dict:
        return {"recipe": self.recipe, "fp8_linears": dict(sorted(self.fp8.items())),
                "bf16_linears": dict(sorted(self.bf16.items())), "compiled": self.compiled,
                "whole_mlps": self.whole_mlps, "qkv_regions": self.qkv_regions,
                **({"delayed_mlps": self.delayed_mlps, "delayed_qkv": self.delayed_qkv, "delayed_o": self.delayed_o}
                   if self.recipe == "delayed" else {})}

    def __str__(self) -> str:
        kept = "; ".join(f"{n} ({why})" for n, why in sorted(self.bf16.items())) or "none"
        return (f"precision=fp8, recipe {self.recipe}: {sum(self.fp8.values())} linears in FP8 "
                f"({', '.join(f'{n} x{c}' for n, c in sorted(self.fp8.items()))}), "
                f"{self._casts()}{self._delayed()}; decoder linears kept in bf16: {kept}; lm_head, "
                f"attention and the MoE experts' grouped GEMMs stay bf16 (FP8 grouped GEMMs measured slower)")

    def _delayed(self) -> str:
        if self.recipe != "delayed":
            return ""
        rest = sum(self.fp8.values()) - 3 * self.delayed_mlps - 3 * self.delayed_qkv - self.delayed_o
        attn = (f", {self.delayed_qkv} q/k/v groups and {self.delayed_o} o_proj" if self.delayed_qkv or self.delayed_o
                else "")
        return (f"; delayed scaling (amax history of {len(self.scales.history) if self.scales else 0} steps, "
                f"the first step's scales from its own amaxes) on {self.delayed_mlps} gated MLPs{attn}" +
                (f", tensorwise dynamic scaling on the other {rest} FP8 linears"
                 f"{' (' + self.dynamic_why + ')' if self.dynamic_why else ''}" if rest else ""))

    def _casts(self) -> str:
        if self.compiled == "delayed":
            return "casts in the delayed sites' own kernels"
        if self.compiled == "false":
            return "casts eager"
        if self.whole_mlps or self.qkv_regions:
            qkv = f", {self.qkv_regions} q/k/v groups as one region each" if self.qkv_regions else ""
            return f"casts compiled: {self.whole_mlps} gated MLPs whole{qkv}, any other FP8 linear alone"
        return "casts compiled per linear" + (f" ({self.per_linear_why})" if self.per_linear_why else "")


def check_fp8_device(device: torch.device, emulate_on_cpu: bool) -> None:
    """Refuse, before the model is built, a device that cannot run FP8 GEMMs, or a missing torchao."""
    if device.type == "cpu" and not emulate_on_cpu:
        raise UnsupportedError("precision=fp8 needs a GPU with FP8 GEMMs (compute capability 8.9 or newer); this run "
                               "is on the CPU: set precision=bf16")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_CAPABILITY:
            raise UnsupportedError(f"precision=fp8: this GPU ({torch.cuda.get_device_name(device)}, compute capability "
                                   f"{cap[0]}.{cap[1]}) has no FP8 GEMMs (8.9 or newer: H100, H200, L40S, B200); set "
                                   "precision=bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise UnsupportedError("precision=fp8 runs torchao's float8 training, which is not installed: pip install "
                               "'torchao==0.18.0' (the project's [fp8] extra), or set precision=bf16") from err


def resolve_compile(setting: str, recipe: str, device_type: str) -> str:
    """fp8.compile as the run uses it. `auto`: eager on the CPU; on CUDA the regions (whole MLPs, and q/k/v where all
    three run in FP8) for tensorwise and each linear alone for the rowwise recipes. One MLP alone on an H200
    (docs/benchmarks.md, 2026-12-04 late): the region measured 1.04-1.13x the per-linear casts with tensorwise, and
    0.89-0.94x with rowwise (why rowwise loses there is not known). The q/k/v region (fp8.linears=all only; under
    `mlp` the two settings are the same): the 8B layer shape's step 1.011x faster with it, the 1B shape's the same
    (H100, FA4, 16k, 2026-12-06)."""
    if setting != "auto":
        return setting
    if device_type != "cuda":
        return "false"
    return "regions" if recipe in ("tensorwise", "delayed") else "linear"


def _why_bf16(leaf: str, module: torch.nn.Linear, linears: str) -> str:
    """'' when the linear runs in FP8, else the reason it stays bf16."""
    if leaf in ROUTER_NAMES:
        return "router"
    if linears == "mlp" and leaf not in MLP_NAMES:
        return "fp8.linears=mlp"
    if module.in_features % ALIGN or module.out_features % ALIGN:
        return f"features not multiples of {ALIGN}"
    return ""


def apply_fp8(hf_model: torch.nn.Module, recipe: str, linears: str, compile_casts: str,
              partitioned: bool = False, compile_fn: Optional[Callable] = None, amax_history: int = 16,
              device: Optional[torch.device] = None) -> Fp8Report:
    """Swap the chosen decoder linears for Float8Linear; before the fused kernels bind (their projection groups take
    plain nn.Linear only, so FP8 linears keep their own forward) and before DeepSpeed wraps the model.

    compile_casts: `mlp` compiles each gated MLP whose three projections run in FP8 as one region, and every FP8
    linear's forward alone as well (what runs where a memory policy calls the projections directly: the selective
    recompute's rewritten MLP); `regions` as `mlp`, and each attention's q/k/v, where all three run in FP8, as one
    region too; `linear` each linear alone; `false` eager casts. `partitioned`: ZeRO-3 partitions the
    weights across ranks, and its gather hooks sit on each linear's __call__, which a whole-MLP region would trace
    into; there each linear is compiled alone (the hooks stay outside). `compile_fn`: torch.compile unless a test
    hands another (the eager backend checks the regions on CPU). recipe `delayed`: the gated MLPs, q/k/v groups and
    o_proj that kernels/fp8_delayed.py computes run there, with scales from `amax_history` steps of amaxes (the state
    on `device`); any other chosen linear runs tensorwise (_bind_delayed)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    report = Fp8Report(recipe=recipe)
    chosen = set()
    decoder = hf_model.get_decoder()
    for name, module in decoder.layers.named_modules():
        if type(module) is not torch.nn.Linear:  # exactly torch's Linear: a LoRA or quantized one keeps its forward
            continue
        leaf = name.rsplit(".", 1)[-1]
        why = _why_bf16(leaf, module, linears)
        if why:
            report.bf16[leaf] = why
        else:
            chosen.add(name)
            report.fp8[leaf] += 1
    if not chosen:
        # e.g. an MoE model with no dense MLP under the default fp8.linears=mlp: its experts are our grouped GEMMs
        fix = "set fp8.linears=all (attention's projections in FP8 too) or " if linears == "mlp" else "set "
        raise UnsupportedError(f"precision=fp8: no decoder linear can run in FP8 (kept in bf16: {report.bf16}; the "
                               f"MoE experts' grouped GEMMs stay bf16); {fix}precision=bf16")
    if recipe == "delayed":
        _bind_delayed(decoder, chosen, report, partitioned, amax_history, device)
        if not chosen:  # every FP8 linear is in a delayed site
            report.compiled = "delayed"
            return report
    convert_to_float8_training(decoder.layers, config=Float8LinearConfig.from_recipe_name(
        "tensorwise" if recipe == "delayed" else recipe), module_filter_fn=lambda module, fqn: fqn in chosen)
    if compile_casts == "false":
        if partitioned:
            # torchao's eager forward saves weight.t(), a view of ZeRO-3's gathered weight, which then outlives the
            # forward; a compiled forward saves the parameter itself, which ZeRO-3 gathers again for the backward
            # (tests/test_fp8.py test_compiled_fp8_linears_under_zero3_keep_no_gathered_weight)
            held = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for n, m in decoder.layers.named_modules()
                       if n in chosen) * 2
            log.warning("precision=fp8 with fp8.compile=false under ZeRO-3: each FP8 linear keeps its gathered bf16 "
                        "weight from its forward to its backward, up to %.3g GiB a rank that bf16 would not hold; "
                        "compiled casts (fp8.compile=auto) do not", held / 2**30)
        return report
    compile_fn = compile_fn or torch.compile
    # the instances share Float8Linear.forward's code, so dynamo keeps one graph per weight shape and grad mode
    # (q/k/v/o/gate/up/down at train and eval: up to 8 at the 1B shape, dynamo's default limit, past which the rest
    # would run eager and slower, with only a warning)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    report.compiled = compile_casts
    for name in chosen:
        module = decoder.layers.get_submodule(name)
        # the instance's forward, compiled: the amax, scale and cast kernels fuse around the GEMMs; ZeRO-3's gather
        # hooks stay outside, on the module's __call__
        module.forward = compile_fn(module.forward)
    if compile_casts in ("mlp", "regions"):
        if partitioned:
            report.per_linear_why = "ZeRO-3 partitions the weights: its gather hooks stay outside each compiled linear"
        else:
            for name, module in decoder.layers.named_modules():
                if is_plain_gated_mlp(module) and all(f"{name}.{p}" in chosen for p in MLP_NAMES):
                    _compile_whole_mlp(module, compile_fn)
                    report.whole_mlps += 1
                if compile_casts == "regions" and all(f"{name}.{p}" in chosen for p in QKV_NAMES):
                    _compile_qkv(module, compile_fn)
                    report.qkv_regions += 1
            if not report.whole_mlps and not report.qkv_regions:
                report.per_linear_why = "no gated MLP of a known class has all three projections in FP8"
        # the log and metrics name the regions that formed, not the setting: `regions` under fp8.linears=mlp forms no
        # q/k/v region, and ZeRO-3's partitions or an unknown MLP class leave each linear alone
        report.compiled = ("regions" if report.qkv_regions else "mlp" if report.whole_mlps else "linear")
    return report


def _bind_delayed(decoder, chosen: set, report: Fp8Report, partitioned: bool, history: int,
                  device: Optional[torch.device]) -> None:
    """fp8.recipe=delayed: bind each site the delayed Functions compute (kernels/fp8_delayed.py), and take its linears
    out of `chosen` (they stay nn.Linear, read by the Function): each gated MLP whose three projections are chosen,
    HF's gated MLP to the bytecode (hf_code.py), with SiLU and no biases; each attention's q/k/v where all three are
    chosen and have no bias (one group: one cast of x); each chosen o_proj without a bias. Refused where MLPs were
    chosen and none qualifies: the user asked for delayed scales, and the MLPs are most of what they buy. A model
    whose every MLP is an MoE block (its experts are not linears) has none to choose: its attention takes the delayed
    scales."""
    from .bind import is_silu
    from .projections import ProjectionGroup
    if partitioned:
        raise UnsupportedError("fp8.recipe=delayed runs each MLP as one function on its three weights, past the "
                               "gather hooks ZeRO-3 puts on each linear's call: set deepspeed.zero_stage to 1 or 2, "
                               "or fp8.recipe=tensorwise")
    sites, why, mlps_chosen = [], set(), False  # (kind, module, linear names)
    for name, module in decoder.layers.named_modules():
        names = [f"{name}.{p}" for p in MLP_NAMES]
        if all(n in chosen for n in names):
            mlps_chosen = True
            if not is_plain_gated_mlp(module):
                why.add(f"{type(module).__name__} is not a known down(act(gate) * up) MLP")
            elif not is_silu(module.act_fn):
                why.add(f"{type(module).__name__}'s activation is not SiLU")
            elif any(getattr(module, p).bias is not None for p in MLP_NAMES):
                why.add("MLP projections with biases")
            else:
                sites.append(("mlp", module, names))
        names = [f"{name}.{p}" for p in QKV_NAMES]
        if all(n in chosen for n in names):
            if any(getattr(module, p).bias is not None for p in QKV_NAMES):
                why.add("q/k/v with biases")
            else:
                sites.append(("qkv", module, names))
        if name.rsplit(".", 1)[-1] == "o_proj" and name in chosen and module.bias is None:
            sites.append(("o_proj", module, [name]))
    if (mlps_chosen or not sites) and not any(kind == "mlp" for kind, _, _ in sites):
        found = "".join(f"; {w}" for w in sorted(why))
        what = "no MLP" if mlps_chosen else "no decoder linear (no dense MLP, no bias-free q/k/v or o_proj in FP8)"
        raise UnsupportedError(f"fp8.recipe=delayed: {what} can take delayed scales (an MLP needs to be a known gated "
                               f"one with SiLU, no biases and its three projections in FP8{found}): set "
                               f"fp8.recipe=tensorwise")
    device = device or next(sites[0][1].parameters()).device
    # q/k/v and o_proj share a kind of scale row: the q/k/v group casts its weights with one scale (fp8_delayed.py)
    report.scales = state = DelayedScales(["mlp" if kind == "mlp" else "linears" for kind, _, _ in sites], history,
                                          device)
    for row, (kind, module, names) in enumerate(sites):
        chosen.difference_update(names)
        if kind == "mlp":
            bind_delayed_mlp(module, state, row)
            report.delayed_mlps += 1
        elif kind == "qkv":
            members = [getattr(module, p) for p in QKV_NAMES]
            ProjectionGroup(members, node=delayed_linears(module, members, state, row)).bind()
            report.delayed_qkv += 1
        else:
            node = delayed_linears(module, [module], state, row)
            module.forward = lambda x, node=node: node(x)[0]
            report.delayed_o += 1
    report.dynamic_why = "; ".join(sorted(why))


def _compile_whole_mlp(mlp: torch.nn.Module, compile_fn: Callable) -> None:
    """One compiled region for down(act(gate(x)) * up(x)) with its three Float8Linear: one amax and cast of x feeds
    gate and up, and the activation and product fuse with the cast of down's input (one MLP on an H200, 1B shape, 16k
    tokens, tensorwise: 1.31x bf16 against 1.18x with each linear compiled alone; scripts/bench/bench_fp8_mlp.py).
    The region is the class's own forward: what it computes is HF's. It stays a plain MLP to the memory policies:
    `act_mul` tells the selective recompute which product to recompute (as kernels/bind.py's fused MLP does), and it
    then calls the projections itself, each compiled alone."""
    region = compile_fn(type(mlp).forward.__get__(mlp))
    region.act_mul = lambda gate, up: mlp.act_fn(gate) * up
    mlp.forward = region


def _qkv(attn: torch.nn.Module, x: torch.Tensor) -> tuple:
    """The q/k/v region's body: each projection's own Float8Linear forward, on one input."""
    return tuple(type(m).forward(m, x) for m in (getattr(attn, n) for n in QKV_NAMES))


def _compile_qkv(attn: torch.nn.Module, compile_fn: Callable) -> None:
    """q, k and v of one attention module as one compiled region, bound as a projection group (kernels/projections.py:
    the first projection's call runs the region, the other two take their outputs). Per linear, FP8 lost what the bf16
    group has: each linear cast x on its own, and autograd summed their three input gradients in separate bf16 adds;
    in one region x's amax and cast can be shared and the sum fuses into the backward's kernels. The region computes
    all three also inside the except_attention replay, where the bf16 group skips the unused ones (a cost in time
    only). Where the group cannot run (autocast), each projection runs its own compiled forward."""
    from .projections import ProjectionGroup
    members = [getattr(attn, n) for n in QKV_NAMES]
    ProjectionGroup(members, node=compile_fn(_qkv.__get__(attn))).bind()
