"""DeepEPDispatcher: DeepEP's V1 `deep_ep.Buffer` in normal (intranode) mode, with the AllToAllDispatcher's interface.

Legend: T tokens on this rank, D token width, k top-k, El local experts, N received slots.

Optional GPU extra, imported lazily: the package is not on PyPI in a working form (deep-ep 1.0.0's sdist does not
build), so it is built from DeepEP's repository (its 1.x line, the V1 `Buffer` API) by those who want it.
Normal mode exists for 2, 4 and 8 ranks in one NVLink node; at ep=1 nothing is exchanged and the all-to-all
dispatcher's local permute is used instead (DeepEP has no one-rank normal-mode config). Low-latency mode is not
used: its buffer is sized for decoding (a few hundred tokens per rank), not for long-context training.

Shapes: dispatch takes x [T, D] bf16, topk_idx [T, k] int64, topk_weights [T, k] fp32; DeepEP returns the
received tokens rank-major with `recv_topk_idx` holding local expert ids (-1: not this rank's). We expand them to
one row per (token, local expert) slot, grouped by local expert, run the experts, weight each slot by its
routing weight, sum a token's slots, and hand that to DeepEP's combine, which sums over source ranks in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dispatch import Handle

_NORMAL_MODE_RANKS = (2, 4, 8)
_BUFFER_BYTES = 1 << 30


def deepep_unavailable_reason(ep_size: int):
    """None when DeepEP's normal mode can serve this EP group, else why not (for the log or the refusal)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if ep_size not in _NORMAL_MODE_RANKS:
        return f"ep={ep_size}: DeepEP's normal mode needs 2, 4 or 8 ranks in one node"
    try:
        import deep_ep  # noqa: F401
    except ImportError as err:
        return f"the deep_ep package does not import ({err}); build DeepEP's 1.x line to use it"
    return None


class DeepEPDispatcher:
    name = "deepep"

    def __init__(self, num_experts: int, ep_group):
        import deep_ep
        self.group, self.ep = ep_group, dist.get_world_size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep
        self.buffer = deep_ep.Buffer(ep_group, num_nvl_bytes=_BUFFER_BYTES, explicitly_destroy=True)

    def dispatch(self, x_TD: torch.Tensor, experts_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        x_ND, weights_N, handle = _DeepEPDispatch.apply(x_TD, experts_Tk, weights_Tk, self)
        handle.weights_N = weights_N
        return x_ND, handle

    def combine(self, y_ND: torch.Tensor, handle: Handle) -> torch.Tensor:
        return _DeepEPCombine.apply(y_ND, handle.weights_N, handle, self)

    def destroy(self) -> None:
        self.buffer.destroy()


class _DeepEPDispatch(torch.autograd.Function):
    """x [T, D], weights [T, k] -> received slots x [N, D] and their weights [N] (both differentiable)."""

    @staticmethod
    def forward(ctx, x_TD, experts_Tk, weights_Tk, disp: DeepEPDispatcher):
        buf = disp.buffer
        idx = experts_Tk.to(torch.int64)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, disp.num_experts)
        recv_x, recv_idx, recv_w, _, deep_handle, _ = buf.dispatch(
            x_TD, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights_Tk.float())
        # one row per (received token, local expert) slot, grouped by local expert
        rows, slots = torch.nonzero(recv_idx >= 0, as_tuple=True)
        order = torch.argsort(recv_idx[rows, slots], stable=True)
        rows, slots = rows[order], slots[order]
        counts = torch.bincount(recv_idx[rows, slots], minlength=disp.num_local).tolist()
        ctx.save_for_backward(rows, slots)
        ctx.disp, ctx.num_recv, ctx.k = disp, recv_x.shape[0], recv_idx.shape[1]
        handle = Handle(num_tokens=x_TD.shape[0], token_of_slot_N=rows, weights_N=None, local_counts=counts)
        handle.deep_handle, handle.num_recv = deep_handle, recv_x.shape[0]
        ctx.deep_handle = deep_handle
        return recv_x[rows], recv_w[rows, slots].float(), handle

    @staticmethod
    def backward(ctx, grad_ND, grad_w_N, _):
        rows, slots = ctx.saved_tensors
        # dispatch's adjoint is a combine along the same routes: token rows summed back to their source, and the
        # weight gradients put back in their [token, k] slots (combine sums those too)
        grad_recv = grad_ND.new_zeros(ctx.num_recv, grad_ND.shape[1]).index_add(0, rows, grad_ND)
        grad_w_recv = torch.zeros(ctx.num_recv, ctx.k, dtype=torch.float32, device=grad_ND.device)
        if grad_w_N is not None:
            grad_w_recv[rows, slots] = grad_w_N.float()
        grad_x, grad_w, _ = ctx.disp.buffer.combine(grad_recv.to(torch.bfloat16), ctx.deep_handle,
                                                     topk_weights=grad_w_recv)
        return grad_x.to(grad_ND.dtype), None, grad_w, None


class _DeepEPCombine(torch.autograd.Function):
    """Slots y [N, D] (weighted here, in fp32) -> out [T, D] on the tokens' own ranks."""

    @staticmethod
    def forward(ctx, y_ND, weights_N, handle: Handle, disp: DeepEPDispatcher):
        weighted = y_ND.float() * weights_N[:, None]
        per_token = weighted.new_zeros(handle.num_recv, y_ND.shape[1]).index_add(0, handle.token_of_slot_N, weighted)
        out, _, _ = disp.buffer.combine(per_token.to(torch.bfloat16), handle.deep_handle)
        ctx.save_for_backward(y_ND, weights_N, handle.token_of_slot_N)
        ctx.handle, ctx.disp = handle, disp
        return out.to(y_ND.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, weights_N, rows = ctx.saved_tensors
        # combine's adjoint is a dispatch of the output gradient along the same routes (the cached handle)
        grad_recv, _, _, _, _, _ = ctx.disp.buffer.dispatch(grad_TD.to(torch.bfloat16), handle=ctx.handle.deep_handle)
        g_slot = grad_recv[rows].float()
        grad_y = (g_slot * weights_N[:, None]).to(y_ND.dtype)
        grad_w = (g_slot * y_ND.float()).sum(-1)
        return grad_y, grad_w, None, None
