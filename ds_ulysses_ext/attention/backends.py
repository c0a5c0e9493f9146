"""Local (single-rank) attention kernels that Ulysses runs on the head-sharded, full-sequence tensors.

Legend: B batch, S sequence, hq query heads, hkv key/value heads (hq % hkv == 0), D head dim of q and k, Dv of v.
Every backend takes and returns the [B, S, h, D] layout and handles GQA natively (no repeat_kv).

v's head dim may differ from q/k's (MLA: DeepSeek-V3 192 / 128): SDPA takes that as it is. Every other path (the
flash kernels, torch's varlen kernel, masks.py) gets v padded with zeros to D and its output cut back to Dv: zero
value columns add exact zeros to the output and nothing to any gradient, so it is exact whatever the kernel
supports, at (D - Dv) / Dv more value bytes inside the kernel (none on the wire: the exchange moves Dv). A v wider
than q/k pads q and k instead (zero coordinates add to no logit; the scale stays that of D).

- `sdpa`: torch scaled_dot_product_attention. On Hopper it dispatches to cuDNN attention for these
  shapes; on CPU it runs the math kernel.
- `flash_attn`: flash-attn 2/3 `flash_attn_func`, imported lazily (a GPU-only optional extra).
- `fa4`: FlashAttention-4 (`flash_attn.cute.flash_attn_func`, package flash-attn-4; Hopper/Blackwell), lazily;
  faster than cuDNN attention at long context on an H200, most at head dim 64. Measured speeds of every kernel:
  docs/benchmarks.md (section A), where the numbers are kept up to date.
- `auto`: on CUDA in bf16/fp16 the first that imports of fa4, flash_attn, else sdpa; sdpa on CPU and in fp32.
The choice is logged once per process per (backend, device type).

Packed documents (`cu_seqlens`, flat [N+1] int32 over the B * S tokens), a sliding `window` and learned
`sinks` ([h], this tensor's query heads) go to the varlen / windowed kernels where the chosen one has them
(flash_attn: documents and windows; fa4: documents, windows and sinks), and otherwise to torch's own: on CUDA in
bf16/fp16 its varlen flash kernel, all three in one call per layer (flash_varlen.py, checked at first use), else
the exact torch path (masks.masked_attention, the reference). `sdpa` with any of them is torch's own. A kernel
named explicitly that lacks a feature the model uses is refused; `auto` falls back to torch's own and logs it once.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from . import flash_varlen
from .kernel_check import HALF
from .masks import masked_attention

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

# the optional kernels' varlen entry points, and which features each kernel has
_VARLEN = {"flash_attn": ("flash_attn", "flash_attn_varlen_func"), "fa4": ("flash_attn.cute", "flash_attn_varlen_func")}
_FEATURES = {"flash_attn": {"documents", "window"}, "fa4": {"documents", "window", "sinks"}}


def _varlen_func(backend: str) -> Callable:
    _require(backend)
    module, name = _VARLEN[backend]
    return getattr(importlib.import_module(module), name)


def _kernel_kwargs(backend, causal, softmax_scale, window, sinks) -> dict:
    kwargs = {"causal": causal}
    if softmax_scale is not None:
        kwargs["softmax_scale"] = softmax_scale
    if window is not None:  # HF's window sees q - k < window: the kernels' left reach is window - 1
        kwargs["window_size"] = (window - 1, 0)
    if sinks is not None:
        kwargs["learnable_sink"] = sinks
    return kwargs


def _kernel_with_features(backend, q_BShD, k_BShD, v_BShD, *, causal, softmax_scale, cu_seqlens, max_seqlen,
                          window, sinks):
    kwargs = _kernel_kwargs(backend, causal, softmax_scale, window, sinks)
    if cu_seqlens is None:
        out = _require(backend)(q_BShD, k_BShD, v_BShD, **kwargs)
    else:
        B, S = q_BShD.shape[:2]
        flat = [t.reshape(B * S, *t.shape[2:]) for t in (q_BShD, k_BShD, v_BShD)]  # [B*S h D]: THD layout
        out = _varlen_func(backend)(*flat, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                    max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, **kwargs)
    out = out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
    return out.reshape(q_BShD.shape)


def _needed(cu_seqlens, window, sinks) -> set:
    return {name for name, value in (("documents", cu_seqlens), ("window", window), ("sinks", sinks))
            if value is not None}


@functools.lru_cache(maxsize=None)
def _log_fallback(name: str, missing: tuple) -> None:
    log.info("attention backend %s lacks %s: those layers run torch's own (flash_varlen.py on CUDA, else masks.py)",
             name, ", ".join(missing))


# the flash kernels take half precision only; an fp32 run (exactness checks on GPU) must not pick them
_FLASH_DTYPES = HALF


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
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                    max_seqlen: Optional[int] = None, window: Optional[int] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact attention over the whole (local) sequence with the named backend.

    cu_seqlens / max_seqlen: packed documents (masks.py); window: HF's sliding_window; sinks: [h].
    """
    name = resolve_backend(backend, q_BShD.device.type, q_BShD.dtype)
    needed = _needed(cu_seqlens, window, sinks)
    if not needed and name == "sdpa":
        return sdpa_attention(q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale)
    D, Dv = k_BShD.shape[-1], v_BShD.shape[-1]
    if Dv != D:  # the smaller of the two padded with zeros (a wider v: q and k, whose zeros add to no logit)
        Dp = max(D, Dv)
        q_p, k_p, v_p = (F.pad(t, (0, Dp - t.shape[-1])) for t in (q_BShD, k_BShD, v_BShD))
        out = local_attention(backend, q_p, k_p, v_p, causal=causal,
                              softmax_scale=D ** -0.5 if softmax_scale is None else softmax_scale,
                              cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, sinks=sinks)
        return out[..., :Dv]
    if not needed:
        return _IMPLS[name](q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale)
    if name != "sdpa":
        missing = tuple(sorted(needed - _FEATURES[name]))
        if not missing:
            if cu_seqlens is not None and max_seqlen is None:
                raise ValueError("a varlen kernel needs max_seqlen with cu_seqlens (the longest document)")
            return _kernel_with_features(name, q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale,
                                         cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, sinks=sinks)
        if backend != "auto":
            raise UnsupportedError(f"attention backend {name!r} has no {', '.join(missing)} support, which this "
                                   "model's attention needs; set model.attn_backend=auto or model.attn_backend=sdpa")
        _log_fallback(name, missing)
    if flash_varlen.usable(q_BShD):
        scale = q_BShD.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return flash_varlen.varlen_attention(q_BShD, k_BShD, v_BShD, causal=causal, scale=scale,
                                             cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, sinks=sinks)
    return masked_attention(q_BShD, k_BShD, v_BShD, causal=causal, softmax_scale=softmax_scale,
                            cu_seqlens=cu_seqlens, window=window, sinks=sinks)
