"""Who computes the fused ops: Liger-Kernel, torch.compile, or the eager reference; and the first-use check.

Shapes: x [..., H], weight [H] -> [..., H]; gate, up [..., I] -> [..., I]; q [B, Hq, s, D], k [B, Hkv, s, D],
cos, sin [B, s, D] -> q, k rotated; the loss head: hidden [T, H], weight [V, H], labels [T] -> fp32 sum of token
cross-entropies.

Liger is imported lazily (a GPU extra). Its RMSNorm casting modes are the two HF orders of reference.rms_norm:
"llama" casts before the weight, "gemma" (offset 0) scales in fp32. The first call of each (op, dtype, width)
runs the provider and the reference in fp32 on a small input of that width, forward and backward, and stops the
run with the fix if they disagree: a wrong kernel must not train silently.
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from ..attention.kernel_check import first_disagreement, isolated
from ..batch import IGNORE_INDEX
from ..errors import UnsupportedError
from . import reference
from .rms_norm import RMSNorm

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "liger", "compile", "none")
LOSS_HEADS = ("auto", "ours", "liger")  # model.loss_head; auto = ours (docs/benchmarks.md, loss head)
TOLERANCE = 1e-4  # fp32 inputs: a fused kernel differs from the reference by rounding (~1e-6)


class Provider:
    name = "reference"
    # whether linear_cross_entropy_sum replaces loss.py's chunked head (ds_ulysses_ext/lm.py HeadLoss); the
    # reference's materialises [T, V] and is only the check's yardstick
    fused_head = False

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        return reference.rms_norm(x, weight, eps, weight_in_fp32)

    def silu_mul(self, gate, up):
        return reference.silu_mul(gate, up)

    def rope(self, q, k, cos, sin):
        return reference.rope(q, k, cos, sin)

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        return reference.linear_cross_entropy_sum(hidden, weight, labels)


class LigerProvider(Provider):
    name = "liger"
    # Liger's fused linear cross-entropy: one Triton kernel per chunk computes the loss and writes the logits'
    # gradient over the 16-bit logits in place, where loss.py's torch path makes fp32 passes over [C, V]. Measured
    # on an H200 (docs/benchmarks.md, loss head): 16k tokens x 128k vocabulary 54 ms and 1.5 GiB against 62 ms and
    # 3.5 GiB, the same weight-gradient error
    fused_head = True

    def __init__(self):
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        self._silu_mul, self._rope = LigerSiLUMulFunction, LigerRopeFunction
        self._flce = LigerFusedLinearCrossEntropyFunction

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        # Liger's forward kernel, our backward (kernels/rms_norm.py: Liger's walks rows one by one per SM, 2.6x the
        # bytes' time on an H200); never in place: the input is the residual stream, which the decoder still adds to
        return RMSNorm.apply(x, weight, eps, weight_in_fp32)

    def silu_mul(self, gate, up):
        return self._silu_mul.apply(gate, up)

    def rope(self, q, k, cos, sin):
        return self._rope.apply(q, k, cos, sin)  # position_ids None, unsqueeze_dim 1: reference.rope's form

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
        # softcap, return_z_loss, accum_dtype): the weight gradient summed over chunks in fp32 (accum_dtype), as
        # loss.py's is; Liger's default sums it in bf16, with twice the error (bench_loss.py). The first output is
        # the loss. Liger rounds that gradient to the weight dtype in forward and scales it in backward (loss.py
        # scales in fp32, then rounds): at most one more bf16 rounding of the lm_head gradient
        return self._flce.apply(hidden, weight, labels, None, None, IGNORE_INDEX, 0.0, 0.0, "sum", None, False,
                                torch.float32)[0]


class CompileProvider(Provider):
    name = "compile"

    def __init__(self):
        self._norm = torch.compile(reference.rms_norm, dynamic=False, fullgraph=True)
        self._silu_mul = torch.compile(reference.silu_mul, dynamic=False, fullgraph=True)
        self._rope = torch.compile(reference.rope, dynamic=False, fullgraph=True)

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        return self._norm(x, weight, eps, weight_in_fp32)

    def silu_mul(self, gate, up):
        return self._silu_mul(gate, up)

    def rope(self, q, k, cos, sin):
        return self._rope(q, k, cos, sin)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def provider_for(mode: str, device: torch.device):
    """None: keep HF's modules. CPU always does (the reference path); `liger` without Liger is refused."""
    if mode == "none" or device.type != "cuda":
        return None
    if mode == "liger" or (mode == "auto" and liger_available()):
        if not liger_available():
            raise UnsupportedError("model.kernels=liger needs Liger-Kernel (pip install liger-kernel==0.8.5); "
                                   "or set model.kernels=compile or model.kernels=none")
        return Checked(LigerProvider())
    return Checked(CompileProvider())


class Checked(Provider):
    """A provider whose every (op, dtype, width) is checked once against the reference before it is used."""

    def __init__(self, inner: Provider):
        self.inner, self.name, self.fused_head = inner, inner.name, inner.fused_head

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        _check_norm(self.inner, x.device, x.dtype, x.shape[-1], weight.dtype, eps, weight_in_fp32)
        return self.inner.rms_norm(x, weight, eps, weight_in_fp32)

    def silu_mul(self, gate, up):
        _check_silu_mul(self.inner, gate.device, gate.dtype, gate.shape[-1])
        return self.inner.silu_mul(gate, up)

    def rope(self, q, k, cos, sin):
        _check_rope(self.inner, q.device, q.dtype, q.shape[-1], q.shape[1], k.shape[1])
        return self.inner.rope(q, k, cos, sin)

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        _check_head(self.inner, hidden.device, hidden.dtype, hidden.shape[-1])
        return self.inner.linear_cross_entropy_sum(hidden, weight, labels)


@functools.lru_cache(maxsize=None)
def _check_norm(provider, device, dtype, H, wdtype, eps, weight_in_fp32) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, H, device=device, generator=gen)
    w = 1 + 0.1 * torch.randn(H, device=device, generator=gen)
    _compare("rms_norm", provider, (x, w), (eps, weight_in_fp32), device, H, dtype)


@functools.lru_cache(maxsize=None)
def _check_silu_mul(provider, device, dtype, I) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    gate, up = torch.randn(64, I, device=device, generator=gen), torch.randn(64, I, device=device, generator=gen)
    _compare("silu_mul", provider, (gate, up), (), device, I, dtype)


@functools.lru_cache(maxsize=None)
def _check_rope(provider, device, dtype, D, Hq, Hkv) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = torch.randn(2, Hq, 8, D, device=device, generator=gen), torch.randn(2, Hkv, 8, D, device=device, generator=gen)
    angle = torch.arange(8, device=device)[:, None] * torch.rand(D // 2, device=device, generator=gen)
    emb = torch.cat((angle, angle), dim=-1).expand(2, 8, D)
    _compare("rope", provider, (q, k, emb.cos(), emb.sin()), (), device, D, dtype, grads=2)


@functools.lru_cache(maxsize=None)
def _check_head(provider, device, dtype, H) -> None:
    # a vocabulary that is no power of two, some tokens ignored: the kernel's tails and its ignore_index
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, weight = torch.randn(96, H, device=device, generator=gen), torch.randn(1000, H, device=device, generator=gen)
    labels = torch.randint(0, 1000, (96,), device=device, generator=gen)
    labels[::7] = IGNORE_INDEX
    _compare("linear_cross_entropy_sum", provider, (hidden, weight / H ** 0.5, labels), (), device, H, dtype, grads=2)


def _compare(op: str, provider, tensors, args, device, width: int, dtype, grads: int = None) -> None:
    """The provider's `op` against the reference's, forward and backward, in fp32 on `tensors` (+ plain `args`)."""
    n_grads = grads or len(tensors)  # the first n_grads tensors are differentiated
    with isolated():
        res = []
        for fn in (getattr(provider, op), getattr(reference, op)):
            leaves = [t.clone().requires_grad_(i < n_grads) for i, t in enumerate(tensors)]
            outs = fn(*leaves, *args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, [torch.ones_like(o) + o.detach() for o in outs])
            res.append([o.detach() for o in outs] + [t.grad for t in leaves if t.requires_grad])
    names = [f"output {i}" for i in range(len(res[0]) - n_grads)] + [f"input {i}'s gradient" for i in range(n_grads)]
    bad = first_disagreement(zip(names, *res), TOLERANCE)
    if bad is not None:
        raise RuntimeError(f"fused {op} ({provider.name}) disagrees with the eager reference ({bad[0]}: relative error "
                           f"{bad[1]:.2e}); set model.kernels=none (or another provider) and report this")
    log.info("fused %s (%s) checked against the eager reference on %s (width %d; runs in %s)",
             op, provider.name, device, width, dtype)
