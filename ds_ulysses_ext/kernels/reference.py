"""The per-token ops as HF's eager modules compute them: the reference every fused provider is checked against,
and the functions `compile` mode compiles.

Shapes: x [..., H], weight [H] -> [..., H]; gate, up [..., I] -> [..., I]; q [B, Hq, s, D], k [B, Hkv, s, D],
cos, sin [B, s, D] -> q, k rotated. Loss head: hidden [T, H], weight [V, H], labels [T] -> fp32 scalar.
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama's apply_rotary_pos_emb (unsqueeze_dim=1): the form bind.py requires of a family before it swaps in a
    fused one."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's loss head, summed over tokens: logits in the weight dtype, cross-entropy in fp32, label -100 ignored.
    Materialises [T, V]: the first-use check's reference on a small case, not a training path."""
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
