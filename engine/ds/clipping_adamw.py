"""ClippingAdamW: torch's fused AdamW on the parameters and their own .grad, the clip folded into its kernel.

deepspeed=zero0 (one rank, master weights in the model's dtype) hands DeepSpeed this optimizer with ZeRO off, and
the gradients live where autograd puts them, as in a plain torch loop: they grow layer by layer during backward
while the recompute checkpoints are freed. ZeRO-2 on one rank (DeepSpeed 0.19.8) allocates its whole flat gradient
partition at the first gradient of the backward, while every checkpoint is still alive, and copies it once more
into a second flat tensor for the step: on the H200 that put the 16k step's peak 1.5 GiB over HF + Liger's
(docs/benchmarks.md, section AI). No library optimizer clips by the global norm inside its step; DeepSpeed's
non-ZeRO clip (clip_fp32_gradients) is a separate pass over every gradient that reads the norm back to the host.
Here the norm is one multi-tensor pass and the clip coefficient a device scalar that torch's fused AdamW divides
each gradient by in-kernel (`grad_scale`, the hook GradScaler uses), so the step never syncs the host. On CUDA the
step itself runs as engine/ds/adamw_kernel.py's Triton kernel (1.37x torch's fused AdamW on an H200), after a check at
first use against torch's fused kernel on a small tensor; where Triton is missing or the check fails, torch's.

`step_in_backward()` (trainer.optimizer_in_backward) moves the step into backward: a hook on each parameter steps
it the moment autograd has accumulated its gradient, then frees that gradient, so the backward's peak holds no
gradient buffer. The per-element AdamW math is the same kernel on the same inputs (the multi-tensor launch of the
step after backward only groups tensors), so the updates are the same; the global norm, for the log, is summed at
the step from the squares taken as each parameter went: on the Triton step the kernel itself writes them, one fp32
sum per block of the tensor, so the norm costs no pass over the gradients. Without a clip, with one micro-batch and
no skipped steps (configs/trainer.py refuses the rest), nothing else reads the gradients between backward and the
step.
"""
from __future__ import annotations

import logging

import torch

from .adamw_kernel import adamw_step, norm_slots

log = logging.getLogger(__name__)


def squared_norm(grads: list, device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squared L2 norms, an fp32 device scalar, in one multi-tensor pass: fp32 per-tensor
    norms (bf16 ones would round to 8 bits), their squares summed in fp64 as DeepSpeed sums its own."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return _sum_of_squares(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).float()


def _sum_of_squares(norms: list) -> torch.Tensor:
    """The fp64 sum of the squared norms (device scalars)."""
    return torch.stack(norms).double().pow(2).sum()


def clip_divisor(norm: torch.Tensor, clip: float, loss_scale: float = 1.0) -> torch.Tensor:
    """What every gradient is divided by, DeepSpeed's formula as a device scalar: max(1, (norm / loss_scale + 1e-6) /
    clip) x loss_scale. A non-finite norm, or DeepSpeed's -1 sentinel for one, clips as an infinite norm does."""
    norm = norm.to(torch.float32)
    norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm, torch.full_like(norm, float("inf")))
    return (torch.clamp((norm / loss_scale + 1e-6) / clip, min=1.0) * loss_scale).reshape(())


class ClippingAdamW(torch.optim.AdamW):
    """AdamW(fused=True) that clips by the global gradient norm as DeepSpeed does: every gradient divided by
    max(1, (norm + 1e-6) / clip) (a non-finite norm clips as an infinite one); `_global_grad_norm` (before clipping)
    is where DeepSpeed's engine reads the norm after the step. `clip` = 0 turns clipping off.

    `skip_nonfinite` (trainer.on_nonfinite=skip): a step whose norm is inf/NaN changes no weight, moment or step
    count (torch's fused kernel skips on `found_inf`, GradScaler's flag), and `overflow` tells DeepSpeed's engine, as
    its ZeRO optimizers do, so that it counts a skipped step and leaves the lr schedule where it was. That flag is a
    Python bool: one host sync per step, paid only under skip (ZeRO-2's overflow scan syncs too)."""

    def __init__(self, params, clip: float, skip_nonfinite: bool = False, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self.clip = float(clip)
        self.skip_nonfinite = skip_nonfinite
        self._global_grad_norm = None
        if skip_nonfinite:
            self.overflow = False
        self.grad_scale = None  # torch's fused AdamW reads it from here: the clip divisor, set by step()
        self.in_backward = False
        self._group_of: dict = {}  # in backward: id(parameter) -> the index of its param group
        self._norms: list = []  # in backward: the stepped gradients' fp32 norms (device scalars), summed at the step
        # in backward on the Triton step: one fp32 slot per kernel block of every parameter, where the kernel writes
        # that block's squared gradient norm as it steps (no norm pass of its own: 146 launches and ~5 ms of GPU on
        # the 1B shape at 16k, docs/benchmarks.md BA); summed in a fixed order at the step, zeroed for the next
        self._sq_slots: torch.Tensor | None = None  # allocated at the first step, on the parameters' device
        self._slot_of: dict = {}  # id(parameter) -> (first slot, slot count)
        self._n_slots = 0

    def step_in_backward(self) -> None:
        """Step every parameter inside backward, as its gradient is complete (module docstring)."""
        if self.clip > 0.0 or self.skip_nonfinite:
            raise ValueError("a step in backward cannot clip by the global norm nor skip a non-finite step: "
                             f"clip={self.clip}, skip_nonfinite={self.skip_nonfinite}")
        self.in_backward = True
        first = 0
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._group_of[id(p)] = index
                    self._slot_of[id(p)] = (first, norm_slots(p.numel()))
                    first += norm_slots(p.numel())
                    p.register_post_accumulate_grad_hook(self._step_one)
        self._n_slots = first

    @torch.no_grad()
    def _step_one(self, param: torch.Tensor) -> None:
        triton = triton_step_ok(param.device, param.grad.dtype)
        if not triton:
            self._norms += torch._foreach_norm([param.grad], 2.0, dtype=torch.float32)
        groups = self.param_groups
        group = groups[self._group_of[id(param)]]
        # the step of this one tensor: its group's settings, its own state (the optimizer's, keyed by the tensor)
        self.param_groups = [dict(group, params=[param])]
        try:
            if triton:
                adamw_step(self, grad_scale=self.grad_scale, sq_out=[self._slots(param)])
            else:
                super().step()
        finally:
            self.param_groups = groups
        param.grad = None

    def _slots(self, param: torch.Tensor) -> torch.Tensor:
        if self._sq_slots is None:
            self._sq_slots = torch.zeros(self._n_slots, dtype=torch.float32, device=param.device)
        if param.device != self._sq_slots.device:
            raise RuntimeError(f"optimizer_in_backward: parameters on {param.device} and {self._sq_slots.device}; "
                               "deepspeed=zero0 keeps one rank's model on one device")
        first, n = self._slot_of[id(param)]
        return self._sq_slots[first:first + n]

    @torch.no_grad()
    def step(self, closure=None):
        if self.in_backward:  # every parameter was stepped in backward: what is left is the norm for the log
            if closure is not None or any(p.grad is not None for g in self.param_groups for p in g["params"]):
                raise RuntimeError("optimizer_in_backward: a gradient reached the step outside backward (a closure, "
                                   "or a parameter whose gradient was set by hand); its update would be lost")
            norms, self._norms = self._norms, []
            device = self.param_groups[0]["params"][0].device
            sq = _sum_of_squares(norms) if norms else torch.zeros((), dtype=torch.float64, device=device)
            if self._sq_slots is not None:  # the kernel's squares, summed in slot order (deterministic), then zeroed
                sq = sq + self._sq_slots.double().sum()
                self._sq_slots.zero_()
            self._global_grad_norm = sq.float().sqrt()
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        device = self.param_groups[0]["params"][0].device
        norm = squared_norm(grads, device).sqrt()
        self._global_grad_norm = norm
        self.grad_scale = None
        if self.skip_nonfinite:
            self.found_inf = (~torch.isfinite(norm)).float()
            self.overflow = bool(self.found_inf)
        if self.clip > 0.0:
            self.grad_scale = clip_divisor(norm, self.clip)
        if grads and all(triton_step_ok(device, dtype) for dtype in {g.dtype for g in grads}):
            if closure is not None:
                raise ValueError("ClippingAdamW takes no closure")
            if not (self.skip_nonfinite and self.overflow):  # a skipped step changes nothing, as torch's skips
                adamw_step(self, grad_scale=self.grad_scale)
            return None
        return super().step(closure)


_CHECKED: dict = {}


def triton_step_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton AdamW step runs on `device` for `dtype`: CUDA, Triton importable, and two steps (weight
    decay, then a gradient scale) of a 70k-element tensor within `ulps` of torch's fused kernel. Checked
    once per (device, dtype) per process; a failure logs why and keeps torch's kernel."""
    if device.type != "cuda":
        return False
    key = (device, dtype)
    if key not in _CHECKED:
        try:
            _CHECKED[key] = _agrees_with_torch(device, dtype)
            if _CHECKED[key]:
                log.info("AdamW runs as engine/ds/adamw_kernel.py's Triton step on %s in %s (it agreed with torch's "
                         "fused AdamW at first use)", device, dtype)
            else:
                log.warning("the Triton AdamW step disagrees with torch's fused AdamW on %s in %s: torch's runs",
                            device, dtype)
        except Exception as exc:  # Triton missing or failing to build here: torch's kernel, and say why
            log.warning("the Triton AdamW step is unavailable on %s (%s: %s): torch's fused AdamW runs",
                        device, type(exc).__name__, exc)
            _CHECKED[key] = False
    return _CHECKED[key]


def ulps(dtype: torch.dtype) -> int:
    """How far, in the dtype's epsilons of the value, the Triton step may land from torch's: torch does part of its
    fp32 math in double, so fp32 parameters part by a few ulps (2.3 measured); 16-bit ones by one rounding flip."""
    return 2 if torch.finfo(dtype).bits <= 16 else 16


def adopt_state(opt: torch.optim.AdamW, param: torch.Tensor, ref_opt: torch.optim.AdamW, ref: torch.Tensor) -> None:
    """`param` and its moments set to `ref`'s: the next step of both from the same state (one step's rounding
    difference must not compound when two AdamW kernels are compared)."""
    param.data.copy_(ref.data)
    opt.state[param]["exp_avg"].copy_(ref_opt.state[ref]["exp_avg"])
    opt.state[param]["exp_avg_sq"].copy_(ref_opt.state[ref]["exp_avg_sq"])


def _agrees_with_torch(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(70001, generator=gen, device=device, dtype=dtype))
    ours = torch.nn.Parameter(ref.detach().clone())
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    ref_opt, our_opt = torch.optim.AdamW([ref], fused=True, **kw), torch.optim.AdamW([ours], **kw)
    for scale in (None, torch.tensor(3.0, device=device)):
        grad = torch.randn(ref.shape, generator=gen, device=device, dtype=dtype)
        ref.grad, ours.grad = grad.clone(), grad.clone()
        ref_opt.grad_scale = scale  # where torch's AdamW reads a GradScaler's scale
        ref_opt.step()
        adamw_step(our_opt, grad_scale=scale)
        tol = ulps(dtype) * torch.finfo(dtype).eps * ref.detach().float().abs().clamp_min(1e-2)
        if not bool(((ref.detach().float() - ours.detach().float()).abs() <= tol).all()):
            return False
        adopt_state(our_opt, ours, ref_opt, ref)
    return True
