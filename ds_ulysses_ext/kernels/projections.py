"""Sibling projections: the linears of one module that read the same input (q/k/v, gate/up), run as one autograd node.

Shapes: x [..., H]; member i: weight W_i [O_i, H], bias b_i [O_i] or none -> y_i [..., O_i]. Backward: dx [..., H] =
sum_i dy_i W_i, dW_i = dy_i^T x, db_i = sum over tokens of dy_i.

Why not autograd's own linears. Each nn.Linear returns its own input gradient, which autograd then sums in bf16 with
a separate add kernel per extra sibling: two adds of [T, H] per attention and one per MLP, 3 x 40 us a layer on the
1B shape at 16k (docs/benchmarks.md BA counts 5.5 ms of adds in the step). One node adds them in cuBLAS's epilogue
instead (addmm with beta 1 into the first product), which also rounds the sum to bf16 once instead of at each add.
Fusing the GEMMs themselves into one [sum O_i, H] GEMM measured no faster (bench_gemm.py, BA), so each member keeps
its own GEMM.

Why the recompute may skip some of them. memory.recompute=except_attention recomputes a layer but replays its core
attention from a record (memory/except_attention.py), so the q/k/v projections' outputs are consumed by nothing that
backward needs: RoPE saves only cos/sin, and the replayed attention ignores its inputs. Their weight and input
gradients need only x and the weights, which this node saves in the recompute as in the forward. So inside that
replay (`outputs_unused()`), the members marked `unused_in_replay` return a tensor of NaN instead of running their
GEMM: 3 of the 6 GEMMs of a Llama layer's recompute (the last, down_proj, is never recomputed: torch's checkpoint
stops once the saved tensors are back). A member whose output something saves (Qwen3's q/k norms save q and k) is
not marked; and were one marked wrongly, the NaN would reach its gradients and the run would stop at the first
step's non-finite norm instead of training a silently wrong model.

Bound by structure at the model's build (kernels/bind.py, with the fused kernels; kernels/fp8.py for FP8 q/k/v):
the first member's forward runs the node and hands each sibling its output, which the sibling's own forward takes
if it is called with the same input tensor (HF's attention calls q, k, v in turn on one hidden state). Any other
call, or weights that ZeRO-3 has partitioned (gathered per module, so a sibling's may not be there yet), runs the
member's own forward.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn.functional as F

_replay = threading.local()  # set while memory/except_attention.py recomputes a layer (autograd's thread)


@contextmanager
def outputs_unused():
    """Inside: members marked unused_in_replay skip their GEMM (module docstring). Only the except_attention replay
    enters it."""
    previous = getattr(_replay, "on", False)
    _replay.on = True
    try:
        yield
    finally:
        _replay.on = previous


def _replaying() -> bool:
    return getattr(_replay, "on", False)


class _SharedInputLinears(torch.autograd.Function):
    """y_i = x W_i^T + b_i for every member; dx summed in the GEMMs' epilogue. `skip[i]`: y_i is NaN, no GEMM."""

    @staticmethod
    def forward(ctx, x, skip, *params):
        ctx.set_materialize_grads(False)  # an output nothing used gets None, not a zero tensor to multiply
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        outs = []
        for w, b, unused in zip(weights, biases, skip):
            if unused:
                outs.append(torch.full((*x.shape[:-1], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device))
            else:
                outs.append(F.linear(x, w, b))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dx = None
        dparams = []
        for i, (g, w, has_bias) in enumerate(zip(grads, weights, ctx.has_bias)):
            w_needs, b_needs = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            if g is None:
                dparams += [None, None]
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = torch.mm(g2, w) if dx is None else dx.addmm_(g2, w)  # beta 1: the sum in the epilogue
            dparams.append(torch.mm(g2.t(), x2) if w_needs else None)
            dparams.append(g2.sum(0) if has_bias and b_needs else None)
        if dx is not None:
            dx = dx.view(x.shape)
        return (dx, None, *dparams)


class ProjectionGroup:
    """Linears reading one input. The first member's forward computes every member; the others take theirs.

    `node(x) -> every member's output` replaces the shared-input node where the members are not plain linears
    (kernels/fp8.py: FP8 q/k/v as one compiled region); it computes every member, the replay's unused ones too.
    Where the group cannot run (ZeRO-3 partitions, autocast), each member runs the forward it had before binding."""

    def __init__(self, members: list, unused_in_replay: Optional[list] = None, node: Optional[Callable] = None) -> None:
        self.members = members
        self.unused_in_replay = unused_in_replay or [False] * len(members)
        self.node = node
        self._own: list = []  # each member's forward before binding
        self._handed: dict = {}  # id(member) -> its output, for the call with the input below
        self._input: Optional[torch.Tensor] = None
        self.fused_calls = 0  # node runs, for tests

    def bind(self) -> None:
        self._own = [m.forward for m in self.members]
        first, *others = self.members
        first.forward = self._first_forward
        for i, member in enumerate(others, start=1):
            member.forward = self._sibling_forward(member, self._own[i])

    def _plain(self) -> bool:
        # ZeRO-3 gathers each module's weights in its own pre-forward hook: a sibling's may be a partition now.
        # Under autocast the linears cast x, and the node would save the uncast one: autograd's linears do it right
        return (torch.is_autocast_enabled(self.members[0].weight.device.type)
                or any(hasattr(m.weight, "ds_id") for m in self.members))

    def _first_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._handed.clear()
        self._input = None
        if self._plain():
            return self._own[0](x)
        if self.node is not None:
            outs = self.node(x)
        else:
            replay = _replaying()
            skip = tuple(replay and unused for unused in self.unused_in_replay)
            params = [t for m in self.members for t in (m.weight, m.bias)]
            outs = _SharedInputLinears.apply(x, skip, *params)
        self.fused_calls += 1
        self._input = x
        for member, out in zip(self.members[1:], outs[1:]):
            self._handed[id(member)] = out
        return outs[0]

    def _sibling_forward(self, member, own: Callable):
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self._handed.pop(id(member), None)
            if out is not None and x is self._input:
                if not self._handed:
                    self._input = None
                return out
            return own(x)
        return forward


def _plain_linear(m) -> bool:
    # exactly torch's Linear: a LoRA wrapper or a quantized linear has its own forward, which must keep running
    return type(m) is torch.nn.Linear and "forward" not in m.__dict__


def _group(module, names: tuple) -> Optional[list]:
    members = [getattr(module, n, None) for n in names]
    if not all(_plain_linear(m) for m in members):
        return None
    if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) != 1:
        return None
    return members


def bind_projection_groups(model: torch.nn.Module) -> int:
    """Bind q/k/v of every attention module and gate/up of every gated MLP that has them as plain linears; returns
    how many groups were bound. q (k) is unused in the replay unless the module normalises it (q_norm, k_norm)."""
    bound = 0
    for module in list(model.modules()):
        attn = _group(module, ("q_proj", "k_proj", "v_proj"))
        if attn is not None:
            unused = [not hasattr(module, "q_norm"), not hasattr(module, "k_norm"), True]
            ProjectionGroup(attn, unused).bind()
            bound += 1
        mlp = _group(module, ("gate_proj", "up_proj"))
        if mlp is not None and hasattr(module, "down_proj"):
            ProjectionGroup(mlp).bind()
            bound += 1
    return bound
