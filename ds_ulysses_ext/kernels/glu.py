"""SwiGLU of the grouped experts' stacked projection, one kernel each way: act = silu(gate) * up.

Legend: N expert slots (rows), I expert intermediate size.

    forward:   h [N, 2I] (gate columns first, then up: HF Qwen3-MoE's gate_up_proj)  ->  act [N, I]
    backward:  grad_act [N, I], h  ->  grad_h [N, 2I]

fp32 inside, one rounding to h's dtype at each store (the torch path, moe/experts.py `_swiglu`, rounds silu(gate)
to the dtype before the product: in fp32 the two agree to rounding, in bf16 this one is the closer to the fp32
value). Only h is kept for backward.

Why our own: the torch path is four kernels forward and backward (silu, product; their backwards and a cat of the
two halves' gradients), keeps silu(gate) [N, I] alive until backward (192 MiB per layer at 16k tokens of the
Qwen3-30B-A3B shape) and cost 1.4 ms of the block's 11.7 ms on an H200. Liger-Kernel's SiLU-and-multiply takes
gate and up as two contiguous tensors, which the stacked projection's halves are not.
"""
from __future__ import annotations

import functools

import torch

from .first_use import agrees

BLOCK = 1024
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative, norm-wise; 16 bits: ~1 ulp


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def glu_fwd(h_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(h_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * I + offs, act.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def glu_bwd(g_ptr, h_ptr, gh_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(g_ptr + row * I + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(gh_ptr + row * 2 * I + offs, d_gate.to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh_ptr + row * 2 * I + I + offs, (g * silu).to(gh_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def glu_weighted_bwd(u_ptr, h_ptr, w_ptr, gh_ptr, gw_ptr, wact_ptr, I, BLOCK: tl.constexpr):
        # one row: grad_act = w * u; the row's <u, act> summed over every column block in fp32
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, I, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < I
            u = tl.load(u_ptr + row * I + offs, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(h_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            act = (silu * up).to(h_ptr.dtype.element_ty).to(tl.float32)  # the act the forward stored
            acc += u * act
            grad_act = w * u
            tl.store(gh_ptr + row * 2 * I + offs, (grad_act * up * sig * (1.0 + gate * (1.0 - sig))).to(
                gh_ptr.dtype.element_ty), mask=mask)
            tl.store(gh_ptr + row * 2 * I + I + offs, (grad_act * silu).to(gh_ptr.dtype.element_ty), mask=mask)
            tl.store(wact_ptr + row * I + offs, (w * act).to(wact_ptr.dtype.element_ty), mask=mask)
        tl.store(gw_ptr + row, tl.sum(acc, 0))

    return glu_fwd, glu_bwd, glu_weighted_bwd


def _grid(h_N2I: torch.Tensor) -> tuple[int, int]:
    return h_N2I.shape[0], -(-(h_N2I.shape[1] // 2) // BLOCK)


def glu_forward(h_N2I: torch.Tensor) -> torch.Tensor:
    N, I2 = h_N2I.shape
    out = torch.empty(N, I2 // 2, dtype=h_N2I.dtype, device=h_N2I.device)
    if N:
        _kernels()[0][_grid(h_N2I)](h_N2I, out, I2 // 2, BLOCK=BLOCK, num_warps=4)
    return out


def glu_backward(grad_NI: torch.Tensor, h_N2I: torch.Tensor) -> torch.Tensor:
    grad_h = torch.empty_like(h_N2I)
    if h_N2I.shape[0]:
        _kernels()[1][_grid(h_N2I)](grad_NI.contiguous(), h_N2I, grad_h, h_N2I.shape[1] // 2, BLOCK=BLOCK,
                                    num_warps=4)
    return grad_h


def glu_weighted_backward(u_NI: torch.Tensor, h_N2I: torch.Tensor, w_N: torch.Tensor):
    """The lean expert pass's backward through the SwiGLU with the routing weight after the down projection
    (moe/lean_pass.py): u [N, I] = grad_y @ down before the weight, h [N, 2I], w [N] ->
    (grad_h [N, 2I] for grad_act = w * u, grad_w [N] fp32 = <u, act>, w * act [N, I]), act recomputed from h as the
    forward rounded it."""
    N, I2 = h_N2I.shape
    grad_h = torch.empty_like(h_N2I)
    grad_w = torch.empty(N, dtype=torch.float32, device=h_N2I.device)
    wact = torch.empty(N, I2 // 2, dtype=h_N2I.dtype, device=h_N2I.device)
    if N:
        block = min(BLOCK, 1 << max(I2 // 2 - 1, 1).bit_length())
        _kernels()[2][(N,)](u_NI.contiguous(), h_N2I.contiguous(), w_N.contiguous(), grad_h, grad_w, wact, I2 // 2,
                            BLOCK=block, num_warps=4)
    return grad_h, grad_w, wact


def reference_glu_weighted_backward(u_NI: torch.Tensor, h_N2I: torch.Tensor, w_N: torch.Tensor):
    """glu_weighted_backward's values in torch, all three in fp32 (what CPU runs, in the caller's dtype, and what the
    kernel is checked against): act as the forward rounded it, grad_act = w * u."""
    gate, up = h_N2I.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    act = (gate * sig * up).to(h_N2I.dtype).float()
    u, w = u_NI.float(), w_N.float()[:, None]
    grad_act = w * u
    grad_h = torch.cat([grad_act * up * sig * (1 + gate * (1 - sig)), grad_act * gate * sig], dim=-1)
    return grad_h, (u * act).sum(-1), w * act


class FusedSwiGLU(torch.autograd.Function):
    """act = silu(gate) * up of a contiguous [N, 2I] h, keeping only h for backward."""

    @staticmethod
    def forward(ctx, h_N2I):
        h_N2I = h_N2I.contiguous()
        ctx.save_for_backward(h_N2I)
        return glu_forward(h_N2I)

    @staticmethod
    def backward(ctx, grad_NI):
        h_N2I, = ctx.saved_tensors
        return glu_backward(grad_NI, h_N2I)


@functools.lru_cache(maxsize=None)
def glu_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Checked once per (device, dtype): forward and backward against the fp32 formula on a width that is no
    multiple of BLOCK. A failure or a disagreement logs a warning and the caller keeps the torch path."""
    if device.type != "cuda":
        return False

    def pairs():
        # no autograd here: the first call may come inside a checkpointed layer's forward, whose recomputation
        # must save exactly the tensors the forward saved
        with torch.no_grad():
            gen = torch.Generator(device=device).manual_seed(0)
            h = (2 * torch.randn(29, 2 * 1100, device=device, generator=gen)).to(dtype)
            g = torch.randn(29, 1100, device=device, generator=gen).to(dtype)
            gate, up = h.float().chunk(2, dim=-1)
            sig = torch.sigmoid(gate)
            ref = gate * sig * up
            ref_grad = torch.cat([g.float() * up * sig * (1 + gate * (1 - sig)), g.float() * gate * sig], dim=-1)
            w = torch.rand(29, device=device, generator=gen).to(dtype)
            tol = TOLERANCE[dtype]
            weighted = zip(glu_weighted_backward(g, h, w), reference_glu_weighted_backward(g, h, w))
            return (("forward", glu_forward(h), ref, tol), ("backward", glu_backward(g, h), ref_grad, tol),
                    *((f"weighted backward {i}", got, want, tol) for i, (got, want) in enumerate(weighted)))
    return agrees("MoE experts: the Triton SwiGLU kernels", device, dtype, pairs)
