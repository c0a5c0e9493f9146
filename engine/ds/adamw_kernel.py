"""AdamW's step as one Triton kernel launch per parameter tensor: ClippingAdamW's step on CUDA.

Why not torch's fused AdamW (`_fused_adamw_`): it walks every tensor in 64k-element chunks through
multi_tensor_apply, and on an H200 it moves the 4-layer Qwen3-30B-A3B shape's 3.1B bf16 parameters at 2.6 TB/s
(16.6 ms), where a plain copy of as many bytes runs at 4.2 TB/s; this kernel streams each tensor with wide blocks at
3.6 TB/s (12.1 ms, docs/benchmarks.md AO). It keeps torch's AdamW semantics and state layout (a float32 `step`
tensor per parameter on its device, `exp_avg` and `exp_avg_sq` in the parameter's dtype), so checkpoints and
`load_state_dict` are torch's. As torch's kernel does: the math in fp32, rounded to the parameter's dtype at the
store; weight decay first (p *= 1 - lr * wd); the bias corrections in double, cast to fp32 once; then

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

with g = grad / grad_scale where a scale (a device scalar: no host sync) is given. The step count t lives on the
host as well as in the state, so the bias corrections need no device read: it is read from the state once per step
tensor (after a load, say) and counted on the host from then on. Tested against torch's fused AdamW in
tests/test_zero0.py (on CUDA).
"""
from __future__ import annotations

import math
import weakref

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the kernel is for CUDA devices only
    triton = None

BLOCK = 4096

if triton is not None:
    @triton.jit
    def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, sq_ptr, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
               HAS_SCALE: tl.constexpr, HAS_SQ: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SQ:  # this block's share of the gradient's squared norm, before any scale: one slot per block
            tl.store(sq_ptr + tl.program_id(0), tl.sum(g * g, axis=0))
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

# id(step tensor) -> (a weak reference to it, its count on the host); an entry leaves with its tensor. Not a
# WeakKeyDictionary: that compares keys with the tensors' own ==, an elementwise op and a host sync per lookup
# (measured: 22 ms per step for 47 tensors)
_HOST_STEPS: dict = {}


def _remember(step: torch.Tensor, t: int) -> None:
    key = id(step)
    _HOST_STEPS[key] = (weakref.ref(step, lambda _, key=key: _HOST_STEPS.pop(key, None)), t)


def _host_step(step: torch.Tensor) -> int:
    """The count of `step` after this step's add: one more than the host's, or read once (a new or loaded state)."""
    entry = _HOST_STEPS.get(id(step))
    t = entry[1] + 1 if entry is not None and entry[0]() is step else int(step.item())
    _remember(step, t)
    return t


def norm_slots(n: int) -> int:
    """How many kernel blocks step a tensor of n elements: the slots its squared norm takes in `sq_out`."""
    return triton.cdiv(n, BLOCK) if triton is not None else -(-n // BLOCK)


def adamw_step(optimizer: torch.optim.AdamW, grad_scale: torch.Tensor | None = None,
               sq_out: list | None = None) -> None:
    """One AdamW step of `optimizer`'s parameters that have a gradient, in its own state (created as torch creates
    it on the first step); each step count advances by one, as torch's does. `sq_out`: one fp32 tensor of
    `norm_slots(numel)` slots per stepped parameter, in their order, where the kernel writes the gradient's squared norm
    block by block (summed in a fixed order by the caller: the norm costs no pass of its own)."""
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("adamw_step implements AdamW without amsgrad and maximize")
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        steps = []
        for p in params:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _remember(state["step"], 0)
            steps.append(state["step"])
        torch._foreach_add_(steps, 1.0)  # the state's counts, for checkpoints; the kernel reads the host's
        sq = iter(sq_out) if sq_out is not None else None
        for p, step in zip(params, steps):
            state = optimizer.state[p]
            t = _host_step(step)
            if not (p.is_contiguous() and p.grad.is_contiguous() and state["exp_avg"].is_contiguous()
                    and state["exp_avg_sq"].is_contiguous()):
                raise RuntimeError("adamw_step needs contiguous parameters, gradients and moments")
            n = p.numel()
            slots = next(sq) if sq is not None else None
            if slots is not None and (slots.dtype != torch.float32 or slots.numel() != norm_slots(n)):
                raise ValueError(f"sq_out: {norm_slots(n)} fp32 slots for a tensor of {n} elements, "
                                 f"got {tuple(slots.shape)} {slots.dtype}")
            _adamw[(norm_slots(n),)](
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], grad_scale if grad_scale is not None else step,
                slots if slots is not None else step,
                n, beta1, beta2, eps, 1.0 - lr * wd, lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t),
                HAS_SCALE=grad_scale is not None, HAS_SQ=slots is not None, BLOCK=BLOCK, num_warps=8)
