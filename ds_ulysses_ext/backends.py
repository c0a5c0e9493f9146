"""Local (single-rank) attention kernels that Ulysses runs on the head-sharded, full-sequence tensors.

Legend: B batch, S sequence, hq query heads, hkv key/value heads (hq % hkv == 0), D head dim.
Every backend takes and returns the [B, S, h, D] layout and handles GQA natively (no repeat_kv).

- `sdpa`: torch scaled_dot_product_attention. On Hopper it dispatches to cuDNN attention for these
  shapes (539 TFLOP/s fwd+bwd at 128k, research/gpu_baseline.md); on CPU it runs the math kernel.
- `flash_attn`: flash-attn 2/3 `flash_attn_func`, imported lazily (a GPU-only optional extra).
- `fa4`: FlashAttention-4 (`flash_attn.cute.flash_attn_func`, package flash-attn-4; Hopper/Blackwell), lazily;
  at 128k on an H200, 629 TFLOP/s fwd+bwd against cuDNN's 546 at head dim 128 and 542 against 434 at head
  dim 64 (docs/benchmarks.md).
- `auto`: on CUDA in bf16/fp16 the first that imports of fa4, flash_attn, else sdpa; sdpa on CPU and in fp32.
The choice is logged once per process per (backend, device type).
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .errors import UnsupportedError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "flash_attn", "fa4")


def sdpa_attention(q_BShD, k_BShD, v_BShD, *, causal: bool, softmax_scale: Optional[float]):
    # SDPA wants [B h S D]; transposed views are what HF passes too, and the fused kernels accept them
    out_BhSD = F.scaled_dot_product_attention(
        q_BShD.transpose(1, 2), k_BShD.transpose(1, 2), v_BShD.transpose(1, 2),
        is_causal=causal, scale=softmax_scale, enable_gqa=q_BShD.shape[2] != k_BShD.shape[2])
    return out_BhSD.transpose(1, 2)


# optional GPU kernels: (module, function, what to install), imported on first use
_OPTIONAL = {"flash_attn": ("flash_attn", "flash_attn_func", "flash-attn (the 'gpu' extra)"),
             "fa4": ("flash_attn.cute", "flash_attn_func", "flash-attn-4 (flash_attn.cute)")}


@functools.lru_cache(maxsize=None)
def _optional_func(backend: str) -> Optional[Callable]:
    module, name, _ = _OPTIONAL[backend]
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # ImportError, or a broken CUDA build: both mean "not usable here"
        return None


def _require(backend: str) -> Callable:
    fn = _optional_func(backend)
    if fn is None:
        raise UnsupportedError(f"attention backend {backend!r} requested but {_OPTIONAL[backend][2]} is not "
                               "importable; install it on the GPU machine or set model.attn_backend=sdpa")
    return fn


def flash_attention(q_BShD, k_BShD, v_BShD, *, causal: bool, softmax_scale: Optional[float]):
    return _require("flash_attn")(q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale)


def fa4_attention(q_BShD, k_BShD, v_BShD, *, causal: bool, softmax_scale: Optional[float]):
    kwargs = {} if softmax_scale is None else {"softmax_scale": softmax_scale}
    out = _require("fa4")(q_BShD, k_BShD, v_BShD, causal=causal, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)


_IMPLS = {"sdpa": sdpa_attention, "flash_attn": flash_attention, "fa4": fa4_attention}


# the flash kernels take half precision only; an fp32 run (exactness checks on GPU) must not pick them
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def resolve_backend(name: str, device_type: str, dtype: Optional[torch.dtype] = None) -> str:
    """Turn 'auto' into a concrete backend for this device and dtype, and refuse unknown names."""
    if name not in BACKENDS:
        raise UnsupportedError(f"unknown attention backend {name!r}; choose one of {BACKENDS} (model.attn_backend)")
    if name == "auto":
        name = "sdpa"
        if device_type == "cuda" and (dtype is None or dtype in _FLASH_DTYPES):
            name = next((b for b in ("fa4", "flash_attn") if _optional_func(b) is not None), "sdpa")
    _log_choice(name, device_type)
    return name


@functools.lru_cache(maxsize=None)
def _log_choice(name: str, device_type: str) -> None:
    log.info("attention backend: %s on %s", name, device_type)


def local_attention(backend: str, q_BShD, k_BShD, v_BShD, *, causal: bool = True,
                    softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Exact attention over the whole (local) sequence with the named backend."""
    impl = _IMPLS[resolve_backend(backend, q_BShD.device.type, q_BShD.dtype)]
    return impl(q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale)
