"""Bind the fused per-token ops to a model's modules, instance by instance (HF's classes stay untouched).

Shapes: RMSNorm x [..., H] -> [..., H]; MLP x [B, s, H] -> gate, up [B, s, I] -> down [B, s, H].

What is bound, by structure rather than by class name, so every family with these modules gets them:
- an RMSNorm: a module with `weight` [H] and `variance_epsilon` (HF's norms, Qwen3's q/k norms, the final norm);
  GPT-OSS's scales in fp32 before the cast (`FP32_WEIGHT_NORMS`), the others cast first;
- a dense SwiGLU MLP: `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn` (MoE experts are our own kernels).
Anything else keeps its eager forward; the report counts both, and the run logs it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .providers import provider_for

log = logging.getLogger(__name__)

FP32_WEIGHT_NORMS = ("GptOssRMSNorm",)  # (weight * h).to(dtype): the weight multiplies in fp32


@dataclass
class KernelReport:
    provider: str = "none"
    norms: int = 0
    mlps: int = 0
    skipped_mlps: list = field(default_factory=list)  # class names of MLPs left eager (not SiLU-gated)

    def __str__(self) -> str:
        if self.provider == "none":
            return "per-token kernels: eager (HF's modules)"
        skipped = f"; left eager: {sorted(set(self.skipped_mlps))}" if self.skipped_mlps else ""
        return f"per-token kernels: {self.provider} for {self.norms} RMSNorms and {self.mlps} SwiGLU MLPs{skipped}"


def apply_fused_kernels(model: torch.nn.Module, mode: str, device: torch.device, provider=None) -> KernelReport:
    """`provider`: tests hand a stand-in to exercise the binding on CPU."""
    provider = provider or provider_for(mode, device)
    report = KernelReport()
    if provider is None:
        return report
    report.provider = provider.name
    for module in model.modules():
        if _is_rms_norm(module):
            _bind_norm(module, provider)
            report.norms += 1
        elif _is_gated_mlp(module):
            if _is_silu(module.act_fn):
                _bind_mlp(module, provider)
                report.mlps += 1
            else:
                report.skipped_mlps.append(type(module).__name__)
    log.info("%s", report)
    return report


def _is_rms_norm(m) -> bool:
    return (isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")
            and not list(m.children()) and "forward" not in m.__dict__)


def _is_gated_mlp(m) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and hasattr(m, "act_fn") and "forward" not in m.__dict__


def _is_silu(act) -> bool:
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
    mlp.forward = forward
