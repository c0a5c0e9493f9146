"""The per-token ops as HF's eager modules compute them: the reference every fused provider is checked against,
and the functions `compile` mode compiles.

Shapes: x [..., H], weight [H] -> [..., H]; gate, up [..., I] -> [..., I].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """Llama / Qwen / Mistral (weight_in_fp32=False): normalise in fp32, cast back, then scale. GPT-OSS
    (weight_in_fp32=True): scale in fp32, then cast back."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight * h).to(dtype)
    return weight * h.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
