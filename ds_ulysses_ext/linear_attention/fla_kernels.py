"""flash-linear-attention's chunked delta rules (fla-core 0.6, Triton): the linear layers' recurrence on the GPU.

Legend: B batch rows, S whole sequence (after the Ulysses exchange), T = B * S flat tokens, h value heads on this
rank, dk / dv key / value head dims, N documents, n tokens of the first-use check's cut.

    q, k [1 T h dk], v [1 T h dv] (model dtype; q and k already repeated to h value heads, as HF does),
    g [1 T h] fp32 (gated DeltaNet) or [1 T h dk] model dtype (KDA), beta [1 T h] model dtype (after the sigmoid),
    cu_seqlens [N+1] int64 over the T tokens   ->   o [1 T h dv] model dtype

One call per layer over every document of the batch: the kernel restarts the state at each cu_seqlens entry, which
is exactly what delta_rule.py does to each document laid out as a row of its own (documents.py). The call is HF's
own (qwen3_5 / qwen3_next `chunk_gated_delta_rule`, bailing_hybrid `chunk_kda`): use_qk_l2norm_in_kernel=True, the
default scale dk^-1/2, no initial state, no final state, [B T H ...] layout (fla 0.6 has no head-first form).

fla imports lazily, on the first CUDA call: it is a GPU extra (Triton), and a CPU run never needs it. Resolution of
model.linear_attn_kernel: `torch` is delta_rule.py; `fla` must run (refused on CPU or without the package);
`auto` runs fla on CUDA in bf16 / fp16 when it imports, else torch. fp32 runs keep torch under auto: the fp32
contract is rounding-exact (1e-5), and Triton's kernels multiply in tf32 unless told otherwise.

A kernel that is wrong on the inputs a run really feeds it must not train silently: on the first call of each
layout (dtypes, head counts and dims, decay kind) `checked_call` runs it and the torch path on a cut of that very
input (its first CUT tokens and a window around the first document start past them, with their document starts),
forward and backward, and stops the run with the fix if the kernel is further from an fp32 torch run than
max(2x the torch path in the run's dtype, a floor). A kernel that raises on that input (fla 0.6 refuses the gated
DeltaNet backward on Hopper with Triton 3.4 to 3.7.0, its issue #640) is an error under `fla` and, under `auto`,
leaves the torch path in place with a warning (flash_varlen.py's rule). The kernel callable is injectable so the
check runs on CPU in tests.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Optional

import torch

from ..attention.kernel_check import HALF, isolated, relative_error
from ..attention.masks import _cached
from ..errors import UnsupportedError
from .delta_rule import CHUNK, chunked_delta_rule
from .documents import per_document

log = logging.getLogger(__name__)

KERNELS = ("auto", "fla", "torch")  # model.linear_attn_kernel
FIX = "set model.linear_attn_kernel=torch"
CUT = 320      # tokens of the check's cut from the start: five 64-token chunks, not a multiple of the chunk
AROUND = 96    # tokens either side of the first document start past CUT, added to the cut
HALF_FLOOR = 2e-2   # bf16 / fp16: kernel_check.TOLERANCE, where the torch path rounds only its output
FP32_FLOOR = 2e-3   # fp32 (only under model.linear_attn_kernel=fla): tf32 products
_GRADS = ("q", "k", "v", "g", "beta")

# (q, k, v, g, beta, cu_seqlens [N+1] int64 on the device, the same on the host) -> o
Kernel = Callable[..., torch.Tensor]


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def fla_kernel(kind: str) -> Kernel:
    """fla's chunked kernel for `kind` ("gated_deltanet" | "kda"), imported now."""
    if kind == "kda":
        from fla.ops.kda import chunk_kda as chunk
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk

    def call(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu):
        o, _ = chunk(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return o
    return call


def resolve(choice: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether fla runs, why) for model.linear_attn_kernel=`choice` on this device and dtype."""
    if choice not in KERNELS:
        raise UnsupportedError(f"model.linear_attn_kernel={choice}: choose one of {KERNELS}")
    if choice == "torch":
        return False, "model.linear_attn_kernel=torch"
    if device.type != "cuda":
        if choice == "fla":
            raise UnsupportedError(f"model.linear_attn_kernel=fla needs CUDA (fla's kernels are Triton), and this "
                                   f"run is on {device.type}; {FIX} or auto")
        return False, f"model.linear_attn_kernel=auto on {device.type}: fla runs on CUDA only"
    if not fla_available():
        if choice == "fla":
            raise UnsupportedError("model.linear_attn_kernel=fla needs flash-linear-attention (pip install "
                                   f"fla-core==0.6.0, with triton); {FIX} or auto")
        return False, "model.linear_attn_kernel=auto: flash-linear-attention (fla-core) is not installed"
    if choice == "auto" and dtype not in HALF:
        return False, f"model.linear_attn_kernel=auto in {str(dtype).replace('torch.', '')}: the torch path keeps " \
                      "fp32 runs rounding-exact (fla's products are tf32)"
    return True, f"model.linear_attn_kernel={choice} on CUDA in {str(dtype).replace('torch.', '')}"


def kernel_cu_seqlens(cu_seqlens: Optional[torch.Tensor], B: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(device, host) int64 [N+1] document starts over the B * S flat tokens, plus the end: the batch's global
    cp_cu_seqlens (masks.py) with empty documents dropped, or, without documents, one per row. Built once per batch
    (masks.py's plan cache): one host copy of the boundaries for every layer."""
    if cu_seqlens is None:
        host = torch.arange(0, B * S + 1, S, dtype=torch.long)
        return host.to(device), host
    return _cached(cu_seqlens, ("fla_cu_seqlens", B * S, device), lambda: _starts(cu_seqlens, B * S, device))


def _starts(cu_seqlens: torch.Tensor, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to the batch's {total} tokens, got {bounds[:1]}..{bounds[-1:]}")
    # an empty document has no token to restart at, and a zero-length sequence is not something fla documents
    host = torch.tensor([0] + [b for a, b in zip(bounds, bounds[1:]) if b > a], dtype=torch.long)
    return host.to(device), host


class DeltaRuleKernel:
    """model.linear_attn_kernel for every linear layer of a model: resolved once per (device, dtype), logged in one
    line, and fla checked on its first input of each layout. `kernel` (tests): a callable to use instead of fla's."""

    def __init__(self, choice: str = "auto", kernel: Optional[Callable[[str], Kernel]] = None):
        if choice not in KERNELS:
            raise UnsupportedError(f"model.linear_attn_kernel={choice}: choose one of {KERNELS}")
        self.choice = choice
        self._kernel_for = kernel
        self._resolved: dict = {}
        self._seen: set = set()

    def uses_fla(self, device: torch.device, dtype: torch.dtype) -> bool:
        key = (device.type, dtype)
        if key not in self._resolved:
            if self._kernel_for is not None:
                fla, why = True, f"model.linear_attn_kernel={self.choice} with an injected kernel"
            else:
                fla, why = resolve(self.choice, device, dtype)
            log.info("linear attention: %s (%s)", "fla's chunked kernels" if fla else "the torch delta rule", why)
            self._resolved[key] = fla
        return self._resolved[key]

    def __call__(self, kind: str, q, k, v, g, beta, cu_seqlens, B: int, S: int) -> torch.Tensor:
        """q, k [B S h dk], v [B S h dv], g [B S h(, dk)], beta [B S h] -> o [B S h dv] through fla, one flat call."""
        kernel = self._kernel_for(kind) if self._kernel_for is not None else fla_kernel(kind)
        cu, cu_host = kernel_cu_seqlens(cu_seqlens, B, S, q.device)
        flat = [t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g, beta)]
        key = (kind,) + tuple((t.dtype, tuple(t.shape[2:])) for t in flat)
        if key not in self._seen:
            try:
                check_kernel(kind, kernel, *flat, cu_host)
            except CannotRun as err:
                if self.choice != "auto":
                    raise
                # auto: a kernel that cannot run here leaves the torch path in place (flash_varlen.py's rule); one
                # that runs and disagrees stays an error
                log.warning("linear attention: the torch delta rule (model.linear_attn_kernel=auto: %s)", err)
                self._resolved[(q.device.type, v.dtype)] = False
                return per_document(chunked_delta_rule, [q, k, v, g, beta], cu_seqlens, CHUNK)
            self._seen.add(key)
        return kernel(*flat, cu, cu_host).reshape(B, S, *v.shape[2:])


class CannotRun(RuntimeError):
    """The kernel raised on the run's input (a Triton build or launch failure, fla refusing its environment)."""


def torch_reference(q, k, v, g, beta, cu_host: torch.Tensor) -> torch.Tensor:
    """The torch path on flat [1 T ...] tensors: delta_rule.py on each document alone (what documents.py gives)."""
    bounds = cu_host.tolist()
    outs = [chunked_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta))) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=1)


def check_cut(cu_host: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices [n] into the T tokens, the cut's own document starts [M+1] int64) for the first-use check: the
    first CUT tokens, and AROUND tokens either side of the first document start past them (so a restart is checked
    even when the first document is long). A span starting mid-document starts a document of the cut: both paths
    see the same cut."""
    bounds = cu_host.tolist()
    spans = [(0, min(CUT, total))]
    later = [b for b in bounds[1:-1] if b > CUT]
    if later:
        b = later[0]
        spans.append((max(CUT, b - AROUND), min(total, b + AROUND)))
    idx, starts, at = [], [], 0
    for a, e in spans:
        idx.append(torch.arange(a, e))
        starts += [at] + [at + c - a for c in bounds if a < c < e]
        at += e - a
    return torch.cat(idx), torch.tensor(starts + [at], dtype=torch.long)


def check_kernel(kind: str, kernel: Kernel, q, k, v, g, beta, cu_host: torch.Tensor) -> None:
    """The kernel against the torch path on a cut of the run's input [1 T ...], forward and the gradients of q, k, v,
    g and beta; raises with the fix when the kernel is further from fp32 torch than max(2x torch in the run's dtypes,
    the floor)."""
    idx, starts = check_cut(cu_host, q.shape[1])
    idx = idx.to(q.device)
    cut = [t.detach().index_select(1, idx).contiguous() for t in (q, k, v, g, beta)]
    run_dtype = v.dtype
    with isolated():
        ref32 = _run(torch_reference, cut, starts, torch.float32, None)
        eager = _run(torch_reference, cut, starts, None, ref32[0])
        try:
            got = _run(lambda *a: kernel(*a[:5], a[5].to(q.device), a[5]), cut, starts, None, ref32[0])
        except Exception as err:  # a kernel that cannot take this input must not be trusted with it
            raise CannotRun(f"fla's {kind} kernel fails on the run's input ({_describe(cut)}: "
                            f"{type(err).__name__}: {err}); {FIX}, or auto") from err
    floor = FP32_FLOOR if run_dtype == torch.float32 else HALF_FLOOR
    for name, a, e, r in zip(("output",) + tuple(f"{n}'s gradient" for n in _GRADS), got, eager, ref32):
        err, eager_err = relative_error(name, a, r), relative_error(name, e, r)
        if not err <= max(2 * eager_err, floor):
            raise RuntimeError(
                f"fla's {kind} kernel disagrees with the torch delta rule on the run's input ({_describe(cut)}; "
                f"{name}: relative error to fp32 {err:.2e}, the torch path's {eager_err:.2e}, allowed "
                f"max(2x that, {floor:.0e})); {FIX} and report this")
    log.info("fla's %s kernel checked against the torch delta rule on the run's input (%s)", kind, _describe(cut))


def _describe(cut) -> str:
    q, v, g = cut[0], cut[2], cut[3]
    return (f"{q.shape[1]} tokens, {q.shape[2]} heads, dk {q.shape[3]} dv {v.shape[3]}, "
            f"{str(v.dtype).replace('torch.', '')}, g {str(g.dtype).replace('torch.', '')}")


def _run(fn, cut, starts, dtype, upstream) -> list:
    """fn's output, then the gradients of its five inputs (in `dtype`, or their own when None). The upstream gradient
    is 1 + the fp32 output, the same for every run."""
    # a copy each run: a leaf shared between runs would sum their gradients
    leaves = [t.to(dtype or t.dtype, copy=True).requires_grad_() for t in cut]
    out = fn(*leaves, starts)
    up = upstream if upstream is not None else out.detach()
    out.backward((torch.ones_like(up) + up).to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]
