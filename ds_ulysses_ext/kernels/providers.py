"""Who computes the fused ops: Liger-Kernel, torch.compile, or the eager reference; and the first-use check.

Shapes: x [..., H], weight [H] -> [..., H]; gate, up [..., I] -> [..., I]; q [B, Hq, s, D], k [B, Hkv, s, D],
cos, sin [B, s, D] -> q, k rotated; the loss head: hidden [T, H], weight [V, H], labels [T] -> fp32 sum of token
cross-entropies.

Liger is imported lazily (a GPU extra). Its RMSNorm casting modes are the two HF orders of reference.rms_norm:
"llama" casts before the weight, "gemma" (offset 0) scales in fp32. The first call of each op on each input layout
(Checked) runs the provider and the reference on rows cut from that very input, forward and backward, and stops the
run with the fix if they disagree: a wrong kernel must not train silently.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from ..attention.kernel_check import isolated, relative_error
from ..batch import IGNORE_INDEX
from ..errors import UnsupportedError
from . import reference
from .layout_sample import describe, layout_key, relayout, same_layout, sample_rows
from .rms_norm import RMSNorm

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "liger", "compile", "none")
LOSS_HEADS = ("auto", "ours", "liger")  # model.loss_head; auto = ours (docs/benchmarks.md, loss head)
TOLERANCE = 1e-4  # fp32 inputs: a fused kernel differs from the reference by rounding (~1e-6)
HALF_FLOOR = 4e-3  # bf16/fp16 inputs: one rounding (2^-8) is always allowed, where the eager path happens to be exact


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
        # one graph per (shape, dtype, layout): the first-use checks (Checked) add their cut of each input's shape to the
        # run's own, and Qwen3's hidden, q and k norms with their checks passed dynamo's default of 8 (a hard failure
        # under fullgraph, seen on an H200)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
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
    """A provider whose every op is checked against the reference on its first real input of each layout.

    A layout is what a kernel's indexing depends on: dtype, width, the last two strides, whether the leading dims
    merge into rows of one stride, and the storage offset's alignment. A stand-in input (a contiguous randn) once let
    a kernel that read a strided slice as contiguous pass its check and then train MLA models with wrong gradients
    (HF's kv_a_layernorm takes a slice of torch.split): so the check runs on a few rows cut from the input the run
    really hands over, laid out in memory exactly as it is (kernels/layout_sample.py)."""

    def __init__(self, inner: Provider):
        self.inner, self.name, self.fused_head = inner, inner.name, inner.fused_head
        self._seen = set()

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        self._first_use("rms_norm", (x, weight), (eps, weight_in_fp32), grads=2)
        return self.inner.rms_norm(x, weight, eps, weight_in_fp32)

    def silu_mul(self, gate, up):
        self._first_use("silu_mul", (gate, up), (), grads=2)
        return self.inner.silu_mul(gate, up)

    def rope(self, q, k, cos, sin):
        self._first_use("rope", (q, k, cos, sin), (), grads=2)
        return self.inner.rope(q, k, cos, sin)

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        self._first_use("linear_cross_entropy_sum", (hidden, weight, labels), (), grads=2)
        return self.inner.linear_cross_entropy_sum(hidden, weight, labels)

    def _first_use(self, op: str, tensors, args, grads: int) -> None:
        key = (op, args) + tuple(layout_key(t) for t in tensors)
        if key in self._seen:
            return
        _compare(op, self.inner, sample_rows(op, tensors), args, grads)
        self._seen.add(key)


def _compare(op: str, provider, tensors, args, n_grads: int) -> None:
    """The provider's `op` in the run's dtypes against the reference's in the same dtypes and in fp32, forward and
    backward, on `tensors` as they lie in memory (the first n_grads differentiated). The provider may be no further
    from fp32 than twice the eager path in the run's dtypes (fp32 runs: TOLERANCE): the bf16 exactness contract."""
    run_dtype = tensors[0].dtype
    with isolated():
        ref32 = _run(getattr(reference, op), tensors, args, n_grads, torch.float32, None)
        eager = _run(getattr(reference, op), tensors, args, n_grads, None, ref32)
        try:
            got = _run(getattr(provider, op), tensors, args, n_grads, None, ref32)
        except Exception as err:  # a kernel that cannot take this input must not be trusted with it
            raise RuntimeError(f"fused {op} ({provider.name}) fails on the run's input ({describe(tensors[0])}: "
                               f"{type(err).__name__}: {err}); set model.kernels=none (or another provider) and "
                               "report this") from err
    names = [f"output {i}" for i in range(len(ref32) - n_grads)] + [f"input {i}'s gradient" for i in range(n_grads)]
    floor = TOLERANCE if run_dtype == torch.float32 else HALF_FLOOR
    for name, g, e, r in zip(names, got, eager, ref32):
        err, bound = relative_error(name, g, r), max(2 * relative_error(name, e, r), floor)
        if not err <= bound:
            raise RuntimeError(
                f"fused {op} ({provider.name}) disagrees with the eager reference on the run's input "
                f"({describe(tensors[0])}; {name}: relative error to fp32 {err:.2e}, the eager path's "
                f"{relative_error(name, e, r):.2e}); set model.kernels=none (or another provider) and report this")
    log.info("fused %s (%s) checked against the eager reference on the run's input (%s)", op, provider.name,
             describe(tensors[0]))


def _run(fn, tensors, args, n_grads, dtype, upstream_from):
    """fn's outputs, then the gradients of its first n_grads inputs' storage, each input rebuilt with its own strides
    and offset (in `dtype`, or its own when None). The upstream gradient is 1 + the fp32 reference's output, so every
    run is differentiated against the same one."""
    leaves, inputs = [], []
    for i, t in enumerate(tensors):
        base, view = same_layout(t, dtype if t.is_floating_point() else None)
        if i < n_grads:  # differentiate the storage, so the gradient shows where the kernel wrote
            base.requires_grad_()
            view = relayout(base, t)
        leaves.append(base)
        inputs.append(view)
    outs = fn(*inputs, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = upstream_from[:len(outs)] if upstream_from is not None else [o.detach() for o in outs]
    torch.autograd.backward(outs, [(torch.ones_like(u) + u).to(o.dtype) for o, u in zip(outs, ups)])
    return [o.detach() for o in outs] + [leaves[i].grad for i in range(n_grads)]
