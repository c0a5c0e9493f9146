"""The casts of a delayed-scaling FP8 MLP (fp8.recipe=delayed): each operand cast to float8 with a scale it is handed,
its transposed copy, and its amax raised, in one pass; the SwiGLU product formed and cast the same way.

Legend: an operand [M, N] bf16; T tokens, H hidden, I intermediate; a suffix 8 is float8 (e4m3 for x, h and the
weights, e5m2 for gradients), `t` the transposed copy made contiguous. scales, amax: fp32 [8], one slot per operand
in the order of SLOTS[kind]; every op reads its slots' scales and raises its slots' amax (a max: running an op twice
on the same input leaves the same amax).

    cast(x [M, N], slot, dtype)     ->  x8 [M, N], x8t [N, M]
    swiglu_fwd(g, u [T, I])         ->  h8 [T, I],  h = silu(g) * u in fp32
    swiglu_bwd(dh, g, u [T, I])     ->  h8t [I, T], d8 [T, 2I] = [dg8 du8], d8t [2I, T]

The torch path here is the reference: the CPU runs it, and on CUDA the Triton kernels (kernels/fp8_cast_kernels.py)
replace it only after they agreed with it on first use (kernels/first_use.py). Both round as torchao's casts do:
fp32 product, clamp to the float8 range, one rounding; SiLU as g / (1 + exp(-g)), as inductor forms it.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple, Optional

import torch

from .first_use import agrees

# the row of slots a delayed site owns (kernels/fp8_scales.py), by kind: a gated MLP ("mlp"), or linears reading one
# input ("linears": q/k/v, o_proj alone); None: a slot the kind does not use. Linears that read one input share one
# scale for their weights and one for their outputs' gradients (gate with up, q with k and v), as a fused QKV or fc1
# weight's do, so their input gradient is one GEMM (kernels/fp8_delayed.py says why). Activations and weights cast to
# e4m3, gradients to e5m2 (range over precision)
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
WIDTH = 8
X, H, W_GU, W_DOWN, D_GU, DY = 0, 1, 2, 4, 5, 7  # the MLP's slots
LW, LDY = 1, 4  # the linears' slots: their weights', their outputs' gradients'
SLOTS = {"mlp": ("x", "h", "w_gate_up", None, "w_down", "d_gate_up", None, "dy"),
         "linears": ("x", "w", None, None, "dy", None, None, None)}
# a joint slot and the per-linear slots it replaced (kernels/fp8_scales.py maps an older checkpoint's history)
JOINED = {"w_gate_up": ("w_gate", "w_up"), "d_gate_up": ("d_gate", "d_up"), "w": ("w0", "w1", "w2"),
          "dy": ("dy0", "dy1", "dy2")}
DTYPES = {"mlp": (E4,) * 5 + (E5,) * 3, "linears": (E4,) * 4 + (E5,) * 3 + (E4,)}


def _f8(v: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import to_fp8_saturated
    return to_fp8_saturated(v * scale, dtype)


def _raise(amax: torch.Tensor, slot: int, v: torch.Tensor) -> None:
    amax[slot] = torch.maximum(amax[slot], v.abs().amax())


# how the e5m2 operands' transposed copies are made (fp8_cast_kernels.py says why there are three ways), in the order
# the first-use check tries them: in the casting kernel from integer-formed bytes, by the byte-transpose kernel after
# it, by torch's copy after it
E5_WAYS = ("bits", "bytes", "torch")
_E5_WORDS = {"bits": "in the casting kernels (integer-formed bytes)", "bytes": "by the byte-transpose kernel",
             "torch": "by torch's copy"}


class Launch(NamedTuple):
    """How the Triton kernels run (the `kernel` argument of the ops here; False: the torch path)."""
    e5: str  # one of E5_WAYS
    tile: Optional[tuple] = None  # (BM, BN, warps) of fp8_cast_kernels.TILE_SHAPES; None: autotuned


def _launch(name: str, m: int, n: int, kernel: Launch, *args, **consts):
    """Kernel `name` over an [m, n] operand: autotuned, or on the tile `kernel` names (the first-use check runs
    each)."""
    from triton import cdiv
    tuned = getattr(_kernels(), name)
    if kernel.tile is None:
        return tuned[lambda meta: (cdiv(m, meta["BM"]), cdiv(n, meta["BN"]))](*args, **consts)
    bm, bn, warps = kernel.tile
    return tuned.fn[(cdiv(m, bm), cdiv(n, bn))](*args, **consts, BM=bm, BN=bn, num_warps=warps)


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import fp8_cast_kernels
    return fp8_cast_kernels


def cast(x: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, slot: int, dtype: torch.dtype, kernel,
         out: Optional[torch.Tensor] = None, out_t: Optional[torch.Tensor] = None):
    """x [M, N] -> (x8 [M, N], x8t [N, M]), written into `out` and `out_t` where both are given: slices of wider
    buffers whose rows are contiguous (the joint casts of kernels/fp8_delayed.py: several operands cast into one
    GEMM's operand)."""
    m, n = x.shape
    if kernel:
        given = out is not None
        out = out if given else torch.empty((m, n), dtype=dtype, device=x.device)
        bits = dtype == E5 and kernel.e5 == "bits"
        cols = dtype == E4 or bits  # else e5m2 is transposed afterwards: fp8_cast_kernels.py says why
        if not given:
            out_t = torch.empty((n, m), dtype=dtype, device=x.device) if cols else out
        _launch("cast", m, n, kernel, x, scales[slot:], amax[slot:], out, out_t.view(torch.uint8) if bits else out_t,
                m, n, out.stride(0), out_t.stride(0), FMAX=torch.finfo(dtype).max, COLS=cols, BITS=bits)
        if cols:
            return out, out_t
        made = _transposed(out.contiguous(), kernel)
        return out, out_t.copy_(made) if given else made
    xf = x.float()
    _raise(amax, slot, xf)
    y = _f8(xf, scales[slot], dtype)
    yt = y.t().contiguous()
    return (out.copy_(y), out_t.copy_(yt)) if out is not None else (y, yt)


def _transposed(y8: torch.Tensor, kernel: Launch) -> torch.Tensor:
    """An e5m2 operand's transposed copy, contiguous: by the byte-transpose kernel where the first-use check chose it,
    else by torch's copy (an unvectorised elementwise kernel for float8: 1.0 ms against 0.05-0.09 ms at [16384, 8192]
    on an H100)."""
    if kernel.e5 == "torch":
        return y8.t().contiguous()
    m, n = y8.shape
    out = torch.empty((n, m), dtype=y8.dtype, device=y8.device)
    _launch("transpose_bytes", m, n, kernel, y8.view(torch.uint8), out.view(torch.uint8), m, n)
    return out


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, kernel):
    m, n = g.shape
    if kernel:
        h8 = torch.empty((m, n), dtype=E4, device=g.device)
        _launch("swiglu_fwd", m, n, kernel, g, u, scales[H:], amax[H:], h8, m, n)
        return h8
    gf = g.float()
    h = gf / (torch.exp(-gf) + 1) * u.float()
    _raise(amax, H, h)
    return _f8(h, scales[H], E4)


def swiglu_bwd(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor,
               kernel):
    """-> h8t [I, T], d8 [T, 2I] = [dg8 du8] and d8t [2I, T]: gate's and up's output gradients as one operand, cast
    with the one scale they share (slot D_GU)."""
    m, n = g.shape
    if kernel:
        bits = kernel.e5 == "bits"
        ht = torch.empty((n, m), dtype=E4, device=g.device)
        d8 = torch.empty((m, 2 * n), dtype=E5, device=g.device)
        d8t = torch.empty((2 * n, m), dtype=E5, device=g.device) if bits else d8
        into = d8t.view(torch.uint8) if bits else d8t
        _launch("swiglu_bwd", m, n, kernel, dh, g, u, scales[H:], scales[D_GU:], scales[D_GU:], amax[D_GU:],
                amax[D_GU:], ht, d8, into[:n] if bits else into, d8[:, n:], into[n:] if bits else into, m, n, 2 * n,
                BITS=bits)
        return ht, d8, d8t if bits else _transposed(d8, kernel)
    gf, uf, dhf = g.float(), u.float(), dh.float()
    e = torch.exp(-gf) + 1
    silu, sig = gf / e, 1 / e
    d = torch.cat([dhf * uf * sig * (gf * (1 - sig) + 1), dhf * silu], 1)  # [d_gate, d_up]
    _raise(amax, D_GU, d)
    d8 = _f8(d, scales[D_GU], E5)
    return _f8(silu * uf, scales[H], E4).t().contiguous(), d8, d8.t().contiguous()


# every kernel output the checks compare (here on first use, tests/test_gpu_fp8_delayed.py at training sizes). Each
# cast runs at a scale slot whose pointer is 16-byte aligned and at one that is not: Triton compiles a kernel for each
# (it specialises pointers on that alignment), and a miscompiled store is a property of the compiled kernel
# (`@slices`: cast into slices of wider buffers, as the joint casts of gate/up's weights and of q/k/v's weights and
# gradients write, at row strides other than the operand's own)
CHECKED_OUTPUTS = ("x8", "x8t", "x8 @w_gate_up", "x8t @w_gate_up", "dy8", "dy8t", "dy8 @w_down", "dy8t @w_down",
                   "x8 @slices", "x8t @slices", "dy8 @slices", "dy8t @slices", "h8", "h8t", "d8", "d8t")
# the SiLU products among them: libdevice's exp against torch's can move one across a float8 rounding boundary; the
# casts must agree exactly
SILU_OUTPUTS = ("h8", "d8")


def checked_outputs(x, g, u, dh, scales, amax, kernel) -> tuple:
    """The outputs named by CHECKED_OUTPUTS, from operands [M, N] bf16 (scales, amax: [WIDTH])."""
    return (*cast(x, scales, amax, X, E4, kernel), *cast(x, scales, amax, W_GU, E4, kernel),
            *cast(dh, scales, amax, DY, E5, kernel), *cast(dh, scales, amax, W_DOWN, E5, kernel),
            *_cast_into_slices(x, scales, amax, LW, E4, kernel), *_cast_into_slices(dh, scales, amax, LDY, E5, kernel),
            swiglu_fwd(g, u, scales, amax, kernel), *swiglu_bwd(dh, g, u, scales, amax, kernel))


def _cast_into_slices(x, scales, amax, slot, dtype, kernel) -> tuple:
    """x [M, N] cast into columns 16.. of an [M, N + 32] buffer and its transpose into columns 16.. of an [N, M + 32]
    one: both row strides differ from the operand's (a joint weight's transpose and a joint gradient take one each)."""
    m, n = x.shape
    wide = torch.empty((m, n + 32), dtype=dtype, device=x.device)
    wide_t = torch.empty((n, m + 32), dtype=dtype, device=x.device)
    return cast(x, scales, amax, slot, dtype, kernel, wide[:, 16:16 + n], wide_t[:, 16:16 + m])


@functools.lru_cache(maxsize=None)
def kernels_ok(device: torch.device):
    """How the Triton kernels run on `device` (a Launch), or False for the torch path: once per device, the kernels
    against the torch path on every tile the autotuner may choose, with the e5m2 transposed copies made each way of
    E5_WAYS in turn until one agrees (fp8_cast_kernels.py says why)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    for e5 in E5_WAYS:
        what = f"fp8.recipe=delayed: the Triton casts, their e5m2 transposes {_E5_WORDS[e5]}"
        if agrees(what, device, torch.bfloat16, functools.partial(_check_pairs, device, e5)):
            return Launch(e5)
    return False


def _check_pairs(device: torch.device, e5: str):
    """The first-use check's pairs, at a shape with partial tiles in both directions and large enough for every tile to
    run many programs (on an H100 the SwiGLU backward's e5m2 transposed copies came out a quarter wrong at 1024 x 1024
    and above while 200 x 136 agreed: docs/precision.md). The casts must agree exactly (the same fp32 product, clamp
    and rounding) and so must every amax; the SiLU outputs within a float8 step here and there (libdevice's exp
    against torch's can move a product across a rounding boundary: 1e-2 norm-wise is about one element in a hundred a
    step apart)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: (3 * torch.randn(*s, device=device, generator=gen)).to(torch.bfloat16)  # noqa: E731
    m, n = 1040, 1056  # not multiples of any tile, and over 1024 each way
    x, g, u, dh = rand(m, n), rand(m, n), rand(m, n), rand(m, n)
    scales = torch.rand(WIDTH, device=device, generator=gen) * 8 + 1
    names = CHECKED_OUTPUTS
    exact = {name for name in names if not name.startswith(SILU_OUTPUTS)}

    def run(kernel):
        amax = torch.zeros(WIDTH, device=device)
        return checked_outputs(x, g, u, dh, scales, amax, kernel), amax
    ref, ref_amax = run(False)
    kept = []  # every tile's outputs stay allocated: a later tile's unwritten bytes must not find an earlier one's
    for tile in _kernels().TILE_SHAPES:
        got, got_amax = run(Launch(e5, tile))
        kept.append(got)
        yield from ((f"{name} {tile}", a, b, 0.0 if name in exact else 1e-2) for name, a, b in zip(names, got, ref))
        yield f"amax {tile}", got_amax, ref_amax, 1e-5
