"""Bind the fused per-token ops to a model's modules, instance by instance (HF's classes stay untouched).

Shapes: RMSNorm x [..., H] -> [..., H]; MLP x [B, s, H] -> gate, up [B, s, I] -> down [B, s, H]; RoPE q [B, Hq, s, D],
k [B, Hkv, s, D], cos, sin [B, s, D].

What is bound, by structure rather than by class name, so every family with these modules gets them:
- an RMSNorm: a module with `weight` [H] and `variance_epsilon` (HF's norms, Qwen3's q/k norms, the final norm);
  GPT-OSS's scales in fp32 before the cast (`FP32_WEIGHT_NORMS`), the others cast first;
- a dense SwiGLU MLP: `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn`, whose class's forward is HF's gated MLP
  to the bytecode (hf_code.py; MoE experts are our own kernels);
- the sibling projections, q/k/v and gate/up, as one autograd node each (kernels/projections.py: their input
  gradients summed in cuBLAS's epilogue; under except_attention the replay skips the unused q/k/v GEMMs);
- RoPE, in an attention module whose forward calls its modeling file's `apply_rotary_pos_emb` and whose function is
  Llama's to the bytecode (Llama, Mistral, Qwen2/3, Qwen3-MoE; not GPT-OSS's half-width cos/sin, GLM's partial
  rotation; DeepSeek-V3's default rope_interleave calls HF's interleaved function, which stays eager though the
  module counts as bound). HF's forward calls that function from its module's globals, so the instance gets
  HF's own forward code over a copy of those globals with the fused function in its place: nothing process-wide
  changes, and no attention forward is rewritten here. The copy is taken when the model is built (later
  reassignments of that module's globals are not seen; ours never make any).
Anything else keeps its eager forward; the report counts both, and the run logs it.
"""
from __future__ import annotations

import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..hf_code import is_plain_gated_mlp, same_code
from .projections import bind_projection_groups
from .providers import provider_for

log = logging.getLogger(__name__)

FP32_WEIGHT_NORMS = ("GptOssRMSNorm",)  # (weight * h).to(dtype): the weight multiplies in fp32


@dataclass
class KernelReport:
    provider: str = "none"
    norms: int = 0
    mlps: int = 0
    ropes: int = 0
    projection_groups: int = 0  # q/k/v and gate/up run as one node each (kernels/projections.py)
    skipped_mlps: list = field(default_factory=list)  # class names of MLPs left eager (not HF's SiLU-gated form)
    skipped_norms: list = field(default_factory=list)  # shaped like an RMSNorm, computing something else: eager
    # the provider's fused loss head, (hidden [T, H], weight [V, H], labels [T]) -> fp32 sum, for CPCausalLM's
    # HeadLoss to run in place of loss.py's chunked one; None: loss.py's
    head: object = field(default=None, repr=False)

    def __str__(self) -> str:
        if self.provider == "none":
            return "per-token kernels: eager (HF's modules)"
        eager = sorted(set(self.skipped_mlps + self.skipped_norms))
        skipped = f"; left eager: {eager}" if eager else ""
        head = ", and the loss head" if self.head is not None else ""
        return (f"per-token kernels: {self.provider} for {self.norms} RMSNorms, {self.mlps} SwiGLU MLPs and "
                f"{self.ropes} RoPEs{head}; {self.projection_groups} projection groups{skipped}")


def apply_fused_kernels(model: torch.nn.Module, mode: str, device: torch.device, provider=None,
                        loss_head: str = "auto", projections: bool = True) -> KernelReport:
    """`provider`: tests hand a stand-in to exercise the binding on CPU. `loss_head` (model.loss_head): `liger` takes
    the provider's fused head in place of loss.py's, and is refused where the provider has none. `projections`: bind
    the projection groups too (off: the per-token ops alone, which a reference provider binds bitwise HF's; the groups'
    summed input gradients round differently, tests/test_projections.py bounds them)."""
    provider = provider or provider_for(mode, device)
    report = KernelReport()
    if provider is None:
        if mode in ("liger", "compile") or loss_head == "liger":  # asked for by name: say what runs instead
            log.warning("model.kernels=%s, model.loss_head=%s: the fused kernels run on CUDA only, and this run is on "
                        "%s: HF's eager modules and loss.py's head run instead (the reference path)", mode, loss_head,
                        device.type)
        return report
    report.provider = provider.name
    if loss_head == "liger":
        if not provider.fused_head:
            raise UnsupportedError(f"model.loss_head=liger: the {provider.name} kernels have no fused loss head (is "
                                   "Liger-Kernel installed?); set model.kernels=liger, or model.loss_head=auto")
        report.head = provider.linear_cross_entropy_sum
    agrees = {}
    for module in model.modules():
        if _is_rms_norm(module):
            key = (type(module), module.weight.shape, float(module.variance_epsilon))
            if key not in agrees:
                agrees[key] = _norm_is_rms_norm(module, provider, device)
            if agrees[key]:
                _bind_norm(module, provider)
                report.norms += 1
            else:
                report.skipped_norms.append(type(module).__name__)
        elif _is_gated_mlp(module):
            # the fused forward computes down(silu(gate) * up): a module of those names computing anything else
            # (a clamp, a norm on the product) keeps its own forward
            if is_silu(module.act_fn) and is_plain_gated_mlp(module):
                _bind_mlp(module, provider)
                report.mlps += 1
            else:
                report.skipped_mlps.append(type(module).__name__)
        elif _llama_rope_caller(module):
            _bind_rope(module, provider)
            report.ropes += 1
    if projections:
        report.projection_groups = bind_projection_groups(model)
    log.info("%s", report)
    return report


def _is_rms_norm(m) -> bool:
    """Looks like an RMSNorm: a weight, variance_epsilon, no children, a forward of the input alone (a gated norm's
    forward(hidden_states, gate) is not one). Whether it computes one is _norm_is_rms_norm's to say."""
    if not (isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")
            and not list(m.children()) and "forward" not in m.__dict__):
        return False
    try:
        params = list(inspect.signature(type(m).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _norm_is_rms_norm(norm, provider, device) -> bool:
    """The provider's RMSNorm against this class's own forward, fp32, on a small input and a weight away from 1. A
    module shaped like an RMSNorm that computes something else keeps its own forward: Cohere's mean-centred LayerNorm
    (weight and variance_epsilon too) was bound as an RMSNorm and gave wrong logits, with a first-use check that
    compared the kernel with an RMSNorm and so agreed."""
    width = norm.weight.ds_shape[-1] if hasattr(norm.weight, "ds_shape") else norm.weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, width, generator=gen).to(device)
    w = (1 + 0.2 * torch.randn(width, generator=gen)).to(device)
    weight_in_fp32 = type(norm).__name__ in FP32_WEIGHT_NORMS
    try:
        with torch.no_grad():
            own = torch.func.functional_call(norm, {"weight": w}, (x,))
            fused = provider.rms_norm(x, w, float(norm.variance_epsilon), weight_in_fp32)
        err = float((own.float() - fused.float()).norm() / own.float().norm())
    except Exception as e:  # its own forward does not take this: it is not the norm the kernel computes
        log.info("%s left eager: its forward on a plain input failed (%s: %s)", type(norm).__name__, type(e).__name__, e)
        return False
    if not err < 1e-4:
        log.info("%s left eager: it is not an RMSNorm (relative %.2e from the fused RMSNorm on the same input)",
                 type(norm).__name__, err)
    return err < 1e-4


def _is_gated_mlp(m) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and hasattr(m, "act_fn") and "forward" not in m.__dict__


def is_silu(act) -> bool:
    # HF's ACT2FN["silu"] is transformers.activations.SiLUActivation (F.silu); torch's own nn.SiLU is the same op
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def _bind_norm(norm, provider) -> None:
    weight_in_fp32 = type(norm).__name__ in FP32_WEIGHT_NORMS
    eps = float(norm.variance_epsilon)

    def forward(hidden_states):
        return provider.rms_norm(hidden_states, norm.weight, eps, weight_in_fp32)
    norm.forward = forward


def _bind_mlp(mlp, provider) -> None:
    def forward(x):
        return mlp.down_proj(provider.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    # still down(act_mul(gate(x), up(x))): memory/recompute.py's selective policy reads this to recompute only the
    # product, as it does for HF's own MLPs (without it, it met a patched forward it could not see into, and refused)
    forward.act_mul = provider.silu_mul
    mlp.forward = forward


def _llama_rope_caller(m) -> bool:
    """An attention module whose class forward calls a module-level apply_rotary_pos_emb of Llama's form."""
    fn = getattr(type(m), "forward", None)
    code = getattr(fn, "__code__", None)
    if code is None or "forward" in m.__dict__ or "apply_rotary_pos_emb" not in code.co_names:
        return False
    from transformers.models.llama import modeling_llama
    return (same_code(fn.__globals__.get("apply_rotary_pos_emb"), modeling_llama.apply_rotary_pos_emb)
            and same_code(fn.__globals__.get("rotate_half"), modeling_llama.rotate_half))


def _bind_rope(attn, provider) -> None:
    fn = type(attn).forward

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:  # the callers bound here pass the default; anything else takes HF's function
            return fn.__globals__["apply_rotary_pos_emb"](q, k, cos, sin, unsqueeze_dim)
        return provider.rope(q, k, cos, sin)

    scope = dict(fn.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb)
    forward = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    forward.__kwdefaults__ = fn.__kwdefaults__
    attn.forward = types.MethodType(forward, attn)
