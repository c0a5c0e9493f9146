"""A prototype: one SwiGLU MLP in FP8 (tensorwise) with our own cast kernels, each taking its operand's amax in the
same pass as its cast (bench_fp8_mlp.py --variants fp8_mlp_fused).

Shapes: x [T, H] bf16; W_gate, W_up [I, H]; W_down [H, I]; g, u, h [T, I]; y, dy [T, H]. A suffix 8 is float8 (e4m3
for x, h and the weights, e5m2 for gradients), `t` the transposed copy made contiguous ([H, T] for x8t). scales [8]
fp32, float8 max / amax, in the order of NAMES; amax [8] fp32, each entry raised (atomic max) to its operand's amax.

Why: delayed scaling (Transformer Engine's recipe: this step's scales from earlier steps' amaxes) removes the amax
pass before each cast only if the new amax is taken inside the cast. Inductor does not fuse it there: the same MLP
region with fixed scales and the amaxes taken ran as slowly as dynamic scaling (docs/benchmarks.md, 2026-12-07). These
kernels read each operand once for its cast, its transposed copy and its amax, which is what delayed scaling would
run. The scales here are fixed (the caller's); no history, no engine recipe: this measures whether one would pay.

The GEMMs are torchao's: torch._scaled_mm with the reciprocal scales, the first operand row-major and the second
column-major, fast accumulation in the forward only (Float8LinearConfig's tensorwise defaults). The casts round as
inductor's do (fp32 product, clamp to the float8 range, one rounding), and the SwiGLU math is inductor's
(silu = g / (1 + exp(-g)), formed in fp32 without a bf16 rounding in between), so the outputs should match
fp8_mlp_static's, which takes the same scales, up to the rounding of libdevice against Triton's own exp.
"""
from __future__ import annotations

import functools

import torch

NAMES = ("x", "h", "gate", "up", "down", "d_gate", "d_up", "d_down")
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels (fp8_fused_kernels.py, imported on first use: the CPU path needs no Triton)."""
    import fp8_fused_kernels
    return fp8_fused_kernels


def _grid(m: int, n: int):
    from triton import cdiv
    return lambda meta: (cdiv(m, meta["BM"]), cdiv(n, meta["BN"]))


def _f8(v: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference cast on the CPU: fp32 product, clamped to the float8 range, one rounding (torchao's)."""
    from torchao.float8.float8_utils import to_fp8_saturated
    return to_fp8_saturated(v * scale, dtype)


def cast(x: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, i: int):
    """x [M, N] -> (x8 [M, N], x8t [N, M]), float8 of NAMES[i]'s dtype; amax[i] raised to x's."""
    dtype = E5 if NAMES[i].startswith("d_") else E4
    m, n = x.shape
    if x.is_cuda:
        out = torch.empty((m, n), dtype=dtype, device=x.device)
        out_t = torch.empty((n, m), dtype=dtype, device=x.device)
        _kernels().cast[_grid(m, n)](x, scales[i:], amax[i:], out, out_t, m, n, FMAX=torch.finfo(dtype).max)
        return out, out_t
    xf = x.float()
    amax[i] = torch.maximum(amax[i], xf.abs().amax())
    y = _f8(xf, scales[i], dtype)
    return y, y.t().contiguous()


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """g, u [T, I] bf16 -> h8 [T, I] e4m3 with scales[1]; amax[1] raised to h's."""
    m, n = g.shape
    if g.is_cuda:
        h8 = torch.empty((m, n), dtype=E4, device=g.device)
        _kernels().swiglu_fwd[_grid(m, n)](g, u, scales[1:], amax[1:], h8, m, n)
        return h8
    gf = g.float()
    h = gf / (torch.exp(-gf) + 1) * u.float()
    amax[1] = torch.maximum(amax[1], h.abs().amax())
    return _f8(h, scales[1], E4)


def swiglu_bwd(dh, g, u, scales, amax):
    """dh, g, u [T, I] bf16 -> h8t [I, T] e4m3, d_gate8 [T, I], d_gate8t [I, T], d_up8, d_up8t (e5m2); amax[5], amax[6]
    raised to d_gate's and d_up's."""
    m, n = g.shape
    if g.is_cuda:
        ht = torch.empty((n, m), dtype=E4, device=g.device)
        dg, du = (torch.empty((m, n), dtype=E5, device=g.device) for _ in range(2))
        dgt, dut = (torch.empty((n, m), dtype=E5, device=g.device) for _ in range(2))
        _kernels().swiglu_bwd[_grid(m, n)](dh, g, u, scales, amax, ht, dg, dgt, du, dut, m, n)
        return ht, dg, dgt, du, dut
    gf, uf, dhf = g.float(), u.float(), dh.float()
    e = torch.exp(-gf) + 1
    silu, sig = gf / e, 1 / e
    d_up, d_gate = dhf * silu, dhf * uf * sig * (gf * (1 - sig) + 1)
    amax[5] = torch.maximum(amax[5], d_gate.abs().amax())
    amax[6] = torch.maximum(amax[6], d_up.abs().amax())
    dg, du = _f8(d_gate, scales[5], E5), _f8(d_up, scales[6], E5)
    return _f8(silu * uf, scales[1], E4).t().contiguous(), dg, dg.t().contiguous(), du, du.t().contiguous()


def _reciprocals(scales: torch.Tensor) -> list:
    """Each scale's reciprocal as a tensor of its own: cuBLAS refuses (NOT_SUPPORTED) a scale pointer that is a view
    into a vector (8 bytes past an aligned start), which torch._scaled_mm passes on unchecked."""
    return [s.reciprocal() for s in scales.unbind()]


def _mm(a8, b8, inv_a, inv_b, fast: bool) -> torch.Tensor:
    """a8 [M, K] row-major @ b8 [K, N] column-major, dequantised by the reciprocal scales, bf16 out."""
    return torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast)


class FusedFp8Mlp(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with fixed tensorwise scales; amax [8] collects every operand's amax."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, scales, amax):
        inv = _reciprocals(scales)
        x8, x8t = cast(x, scales, amax, 0)
        (wg8, wg8t), (wu8, wu8t), (wd8, wd8t) = (cast(w, scales, amax, i) for i, w in ((2, w_gate), (3, w_up),
                                                                                       (4, w_down)))
        g = _mm(x8, wg8.t(), inv[0], inv[2], True)
        u = _mm(x8, wu8.t(), inv[0], inv[3], True)
        h8 = swiglu_fwd(g, u, scales, amax)
        ctx.save_for_backward(x8t, g, u, wg8t, wu8t, wd8t, scales)
        ctx.amax = amax  # raised in the backward too: kept out of autograd's saved tensors (their version checks)
        return _mm(h8, wd8.t(), inv[1], inv[4], True)

    @staticmethod
    def backward(ctx, dy):
        x8t, g, u, wg8t, wu8t, wd8t, scales = ctx.saved_tensors
        amax = ctx.amax
        inv = _reciprocals(scales)
        dy8, dy8t = cast(dy.contiguous(), scales, amax, 7)
        dh = _mm(dy8, wd8t.t(), inv[7], inv[4], False)
        ht, dg, dgt, du, dut = swiglu_bwd(dh, g, u, scales, amax)
        dx = _mm(dg, wg8t.t(), inv[5], inv[2], False) + _mm(du, wu8t.t(), inv[6], inv[3], False)
        return (dx, _mm(dgt, x8t.t(), inv[5], inv[0], False), _mm(dut, x8t.t(), inv[6], inv[0], False),
                _mm(dy8t, ht.t(), inv[7], inv[1], False), None, None)


def fused_mlp_forward(m: torch.nn.Module, scales: dict, amax: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaMLP `m` (bf16 nn.Linear projections) through FusedFp8Mlp; `scales` by NAMES (bench_fp8_mlp.py's
    static_scales)."""
    s = torch.stack([scales[k].reshape(()).float() for k in NAMES])
    return FusedFp8Mlp.apply(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, s, amax)
