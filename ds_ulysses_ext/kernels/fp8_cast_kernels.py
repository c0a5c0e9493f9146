"""Triton kernels of the delayed-scaling casts (kernels/fp8_casts.py holds the torch path they are checked against).

Legend: an operand [M, N] row-major bf16; T tokens, I the MLP's intermediate size; a suffix 8 is float8, `t` the
transposed copy made contiguous ([N, M]). scale and amax: pointers to one fp32 each (a slot of the MLP's [8]).

    cast:        x [M, N]                  ->  x8 [M, N], and x8t [N, M] where COLS;  amax raised to max|x|; each
                                               output may be a slice of a wider buffer: row strides LD (x8) and LDT
                                               (x8t), for the joint casts of kernels/fp8_delayed.py
    swiglu_fwd:  g, u [T, I]               ->  h8 [T, I], h = silu(g) * u;    amax raised to max|h|
    swiglu_bwd:  dh, g, u [T, I]           ->  h8t [I, T] (h again, for down's weight gradient),
                                               dg8, du8 [T, I] (e5m2; row stride LD: the two halves of one
                                               [T, 2I] operand), and dg8t, du8t [I, T] where BITS;
                                               amax raised for dg, du
    transpose_bytes: a [M, N] 1-byte       ->  its [N, M] copy (the e5m2 operands' transposed copies)

The transposed copies: an e4m3 tile goes through tl.trans in the cast that writes it. An e5m2 tile converted by
Triton's float8 conversion and transposed inside the SwiGLU backward came out with a quarter of its bytes never
written on an H100 (Triton of torch 2.11, dg8t and du8t at 1024 x 1024 and above; docs/precision.md), by tl.trans and
also stored at the transposed addresses (the workaround reported for triton-lang issue 11111, a transposed 1-byte store
mis-lowered), while the same stores in a kernel of one output agreed on every tile (2026-12-07). Two ways around it,
tried in this order by kernels/fp8_casts.py's first-use check on every tile:
- BITS: the e5m2 byte formed by integer arithmetic (_e5m2_bits, no float8 conversion) and stored through a uint8 view
  of the transposed copy, in the kernel that casts;
- transpose_bytes: the e5m2 operand written row-major by the cast and copied transposed as bytes afterwards, a second
  pass over a quarter of the operand's bytes (0.05-0.09 ms per [16384, 8192] more than the cast, where torch's copy of
  a float8 tensor, an unvectorised elementwise kernel, took 1.0 ms).

Each reads its operands once: the cast, its transposed copy and the amax come from one pass (an e5m2 copy by
transpose_bytes is a second pass over the cast's bytes, a quarter of the operand's). That is what delayed scaling
needs to pay: inductor ran every amax as a reduction kernel of its own, as slow as dynamic scaling's
(docs/precision.md). The casts round as inductor's and torchao's do: fp32 product, clamp to the float8 range, one
rounding.
"""
import triton
import triton.language as tl
from torch._inductor.runtime.triton_helpers import libdevice


@triton.jit
def _e5m2_bits(v):
    """The e5m2 byte of each fp32 in v (already clamped to +-57344), rounded to nearest even as the float8 conversion
    rounds, by integer arithmetic: v is rounded to e5m2's spacing at its binade (2^(e-2), at least 2^-16, the
    subnormals' spacing) with exact power-of-two scalings, which leaves a value fp16 holds exactly, and e5m2 is fp16's
    top byte (same exponent bias). Checked against torch's conversion on every float8 midpoint and its neighbours."""
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased fp32 exponent
    spacing = tl.maximum(e, 113) - 2  # biased: 113 is 2^-14, e5m2's least normal binade
    r = libdevice.rint(v * ((254 - spacing) << 23).to(tl.float32, bitcast=True)) * (spacing << 23).to(tl.float32,
                                                                                                     bitcast=True)
    return ((r.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0xFF).to(tl.uint8)


# A NaN operand stays NaN, in its cast and in its amax, as on the torch path (torch.clamp and amax keep it). Triton's
# min, max and max-reduction drop NaN by default: a NaN would be cast as -float8 max and left out of the amax, so one
# born just before a cast (in attention's output, say, ahead of o_proj) could leave the loss finite where the torch
# path's, and bf16's, turns non-finite and trainer.on_nonfinite stops the run; fp8_nonfinite_amax would not count it.
@triton.jit
def _store_cast(v, scale, fmax, out_ptr, out_t_ptr, rm, rn, LD, LDT, mask, ROWS: tl.constexpr, COLS: tl.constexpr,
                BITS: tl.constexpr = False):
    """ROWS: store the [M, N] cast (row stride LD); COLS: its [N, M] transposed copy (row stride LDT), by Triton's
    conversion (e4m3), or where BITS by _e5m2_bits into out_t_ptr, a uint8 view (e5m2: the module docstring says
    why)."""
    c = tl.minimum(tl.maximum(v * scale, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                   propagate_nan=tl.PropagateNan.ALL)
    if ROWS:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * LD + rn[None, :], c.to(out_ptr.dtype.element_ty), mask=mask)
    if COLS:  # transposed after the rounding: a quarter of the shared memory an fp32 tile would take
        y = _e5m2_bits(c) if BITS else c.to(out_t_ptr.dtype.element_ty)
        tl.store(out_t_ptr + rn[:, None].to(tl.int64) * LDT + rm[None, :], tl.trans(y), mask=tl.trans(mask))


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's tile of an [M, N] row-major tensor: its rows, its columns, the in-bounds mask, the offsets."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return rm, rn, (rm[:, None] < M) & (rn[None, :] < N), rm[:, None].to(tl.int64) * N + rn[None, :]


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(v, amax_ptr):
    # |NaN| is a NaN with its sign bit clear, which Triton's float atomic_max (an integer max on non-negative values)
    # keeps over every finite amax and inf
    tl.atomic_max(amax_ptr, tl.reduce(tl.reduce(tl.abs(v), 1, _max_keeping_nan), 0, _max_keeping_nan))


# the tile, chosen per (M, N) on first use; re-running a kernel while tuning is harmless (its outputs are overwritten
# and an atomic max of the same values is the same max). kernels/fp8_casts.py's first-use check runs every one.
# (32, 128, 4): the SwiGLU backward's fastest of 15 tiles at [32768, 8192], 1.39 ms against the autotuner's 1.53 from
# the first four (H100, scripts/bench/bench_fp8_casts.py, docs/benchmarks.md)
TILE_SHAPES = ((64, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8), (32, 128, 4))  # (BM, BN, warps)
TILES = [triton.Config({"BM": bm, "BN": bn}, num_warps=w) for bm, bn, w in TILE_SHAPES]


@triton.autotune(configs=TILES, key=["M", "N"])
@triton.jit
def cast(x_ptr, scale_ptr, amax_ptr, out_ptr, out_t_ptr, M, N, LD, LDT, FMAX: tl.constexpr, COLS: tl.constexpr,
         BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, mask, offs = _tile(M, N, BM, BN)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _amax(x, amax_ptr)
    _store_cast(x, tl.load(scale_ptr), FMAX, out_ptr, out_t_ptr, rm, rn, LD, LDT, mask, True, COLS, BITS)


@triton.autotune(configs=TILES, key=["M", "N"])
@triton.jit
def swiglu_fwd(g_ptr, u_ptr, scale_ptr, amax_ptr, h_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, mask, offs = _tile(M, N, BM, BN)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g / (libdevice.exp(-g) + 1.0) * u
    _amax(h, amax_ptr)
    _store_cast(h, tl.load(scale_ptr), 448.0, h_ptr, h_ptr, rm, rn, N, M, mask, True, False)


@triton.autotune(configs=TILES, key=["M", "N"])
@triton.jit
def swiglu_bwd(dh_ptr, g_ptr, u_ptr, h_scale_ptr, dg_scale_ptr, du_scale_ptr, dg_amax_ptr, du_amax_ptr, ht_ptr,
               dg_ptr, dgt_ptr, du_ptr, dut_ptr, M, N, LD, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, mask, offs = _tile(M, N, BM, BN)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = libdevice.exp(-g) + 1.0
    silu = g / e
    sig = 1.0 / e
    d_up = dh * silu
    d_gate = dh * u * sig * (g * (1.0 - sig) + 1.0)
    _amax(d_gate, dg_amax_ptr)
    _amax(d_up, du_amax_ptr)
    # h = silu * u again, transposed, for down's weight gradient (recomputed rather than kept from the forward)
    _store_cast(silu * u, tl.load(h_scale_ptr), 448.0, ht_ptr, ht_ptr, rm, rn, N, M, mask, False, True)
    _store_cast(d_gate, tl.load(dg_scale_ptr), 57344.0, dg_ptr, dgt_ptr, rm, rn, LD, M, mask, True, BITS, True)
    _store_cast(d_up, tl.load(du_scale_ptr), 57344.0, du_ptr, dut_ptr, rm, rn, LD, M, mask, True, BITS, True)


@triton.autotune(configs=TILES, key=["M", "N"])
@triton.jit
def transpose_bytes(src_ptr, dst_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn, mask, offs = _tile(M, N, BM, BN)
    b = tl.load(src_ptr + offs, mask=mask, other=0)
    tl.store(dst_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(b), mask=tl.trans(mask))
