"""DeepEP dispatchers with the AllToAllDispatcher's interface: `DeepEPDispatcher` (V1 `deep_ep.Buffer`, normal
intranode mode) and `DeepEPLowLatencyDispatcher` (the same Buffer in low-latency mode, for ep=1).

Legend: T tokens on this rank, D token width, k top-k, E experts, El local experts, N received slots,
M max_tokens_per_rank (the low-latency buffer's token capacity per rank), R ranks of the EP group.

Optional GPU extra, imported lazily (never at module import): the package is not on PyPI in a working form
(deep-ep 1.0.0's sdist does not build), so it is built from DeepEP's repository (its 1.x line, the V1 `Buffer`
API) by those who want it. Normal mode exists for 2, 4 and 8 ranks in one NVLink node; it has no one-rank config
(its Buffer refuses to dispatch and aborts at exit), so at ep=1 the low-latency dispatcher is the DeepEP path.

Normal mode. Shapes: dispatch takes x [T, D] bf16, topk_idx [T, k] int64, topk_weights [T, k] fp32; DeepEP
returns the received tokens rank-major with `recv_topk_idx` holding local expert ids (-1: not this rank's). We
expand them to one row per (token, local expert) slot, grouped by local expert, run the experts, weight each slot
by its routing weight, sum a token's slots, and hand that to DeepEP's combine, which sums over source ranks in fp32.

Low-latency mode: see DeepEPLowLatencyDispatcher's docstring.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import UnsupportedError
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


# DeepEP V1's low-latency limits (deep_ep.cpp, kernels/launch.cuh SWITCH_HIDDEN, internode_ll.cu kNumMaxTopK): checked
# here, before any kernel, so a bad shape is refused with a fix instead of a device-side assert
_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
_LL_MAX_TOPK = 11


def _ll_max_tokens_per_rank() -> int:
    # every low-latency call asserts NVSHMEM_QP_DEPTH >= 2 * (max_tokens_per_rank + 1); the Buffer's default depth is 1024
    return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024")) // 2 - 1


def check_low_latency(num_tokens: int, hidden: int, top_k: int, num_experts: int, ep: int,
                      max_tokens_per_rank: int, dtype: torch.dtype) -> None:
    """Refuse, with the fix, every shape DeepEP's low-latency kernels cannot move exactly."""
    fix = "use moe.dispatcher=alltoall"
    if dtype != torch.bfloat16:
        raise UnsupportedError(f"DeepEP low-latency mode moves bf16 tokens only (got {dtype}); run the MoE block in "
                               f"bf16 or {fix}")
    if hidden not in _LL_HIDDEN:
        raise UnsupportedError(f"DeepEP low-latency mode has kernels for token widths {_LL_HIDDEN} only (got {hidden}); "
                               f"{fix}")
    if top_k > _LL_MAX_TOPK:
        raise UnsupportedError(f"DeepEP low-latency mode takes top-k <= {_LL_MAX_TOPK} (got {top_k}); {fix}")
    if num_experts % ep:
        raise UnsupportedError(f"{num_experts} experts do not split over ep={ep}")
    limit = _ll_max_tokens_per_rank()
    if not 1 <= max_tokens_per_rank <= limit or (max_tokens_per_rank * ep) % 4:
        raise UnsupportedError(f"max_tokens_per_rank={max_tokens_per_rank}: DeepEP low-latency mode needs 1 <= it <= "
                               f"{limit} (NVSHMEM_QP_DEPTH / 2 - 1) and max_tokens_per_rank * ep a multiple of 4")
    if num_tokens > max_tokens_per_rank:
        raise UnsupportedError(
            f"{num_tokens} tokens on this rank exceed DeepEP's low-latency buffer ({max_tokens_per_rank} tokens per "
            f"rank; at most {limit}). Low-latency mode is sized for decoding batches, not long context: shorten "
            f"the micro-batch (fewer tokens per rank, e.g. a larger parallelism.cp), raise max_tokens_per_rank up to "
            f"{limit}, or {fix}")


def deepep_ll_unavailable_reason():
    """None when DeepEP's low-latency mode can be built here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import deep_ep  # noqa: F401
    except ImportError as err:
        return f"the deep_ep package does not import ({err}); build DeepEP's 1.x line to use it"
    return None


class DeepEPLowLatencyDispatcher:
    """DeepEP's low-latency (NVSHMEM) dispatch and combine, at ep=1. NOT for long context.

    Its buffer is [El, M * R, D] per call, sized up front for M tokens per rank (a few hundred: M <= 511 with
    NVSHMEM's default queue depth); more tokens than that are refused before any kernel. Tokens move in bf16
    (use_fp8=False: no quantisation), so the moved values are exact copies.

    Order: the kernels place a rank's tokens in an expert's rows in the order of GPU atomics, which changes from
    run to run. Every received set is re-sorted by (expert, source rank, source token) - the all-to-all's order -
    so the experts see the same rows in the same order as with AllToAllDispatcher, and the backward's extra
    dispatches can be matched slot for slot with the forward's.

    Weighting: DeepEP's low-latency combine returns only sum_j w_tj * y_tj, but dL/dw_tj = <g_t, y_tj> needs each
    expert output y_tj on the token's rank, and low-latency dispatch carries no per-slot weight to the expert's
    rank (the normal mode's does). So we weight ourselves: combine runs once per top-k column j with topk_idx masked
    to that column and weight 1, which brings every y_tj home, and the weighted sum is the all-to-all's batched
    GEMM (same rounding), whose autograd gives the weight gradient. Per MoE call: forward 1 dispatch + k combines,
    backward k dispatches (one per column: the adjoint of combine) + 1 combine (the adjoint of dispatch, unit
    weights: the sum of a token's k slot gradients, in fp32).

    Checked at ep=1 only (docs/benchmarks.md, section L); ep > 1 is refused until it is compared with the
    all-to-all on several GPUs.
    """
    name = "deepep_ll"

    def __init__(self, num_experts: int, hidden: int, ep_group=None, max_tokens_per_rank: int = 128):
        reason = deepep_ll_unavailable_reason()
        if reason is not None:
            raise UnsupportedError(f"DeepEP low-latency dispatcher: {reason}; use moe.dispatcher=alltoall")
        import deep_ep
        if ep_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise UnsupportedError("DeepEP's Buffer needs a process group: initialise torch.distributed first "
                                       "(a one-rank group at ep=1) and pass the EP group (topology.ep_group)")
            ep_group = dist.group.WORLD
        self.ep = dist.get_world_size(ep_group)
        if self.ep != 1:
            raise UnsupportedError(f"DeepEP low-latency dispatcher at ep={self.ep}: only ep=1 has been checked against "
                                   "the all-to-all; use moe.dispatcher=alltoall")
        check_low_latency(1, hidden, 1, num_experts, self.ep, max_tokens_per_rank, torch.bfloat16)
        self.num_experts, self.num_local, self.hidden = num_experts, num_experts // self.ep, hidden
        self.max_tokens = max_tokens_per_rank
        nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, self.ep, num_experts)
        # low-latency mode wants one queue pair per local expert
        self.buffer = deep_ep.Buffer(ep_group, 0, nbytes, low_latency_mode=True, num_qps_per_rank=self.num_local,
                                     explicitly_destroy=True)

    def dispatch(self, x_TD: torch.Tensor, experts_Tk: torch.Tensor, weights_Tk: torch.Tensor):
        T, k = experts_Tk.shape
        check_low_latency(T, x_TD.shape[1], k, self.num_experts, self.ep, self.max_tokens, x_TD.dtype)
        idx = experts_Tk.to(torch.int64).contiguous()
        handle = Handle(num_tokens=T, token_of_slot_N=None, weights_N=None, local_counts=[], weights_Tk=weights_Tk)
        x_ND = _LLDispatch.apply(x_TD, idx, handle, self)
        return x_ND, handle

    def combine(self, y_ND: torch.Tensor, handle: Handle) -> torch.Tensor:
        y_TkD = _LLColumns.apply(y_ND, handle, self)
        w_T1k = handle.weights_Tk.to(y_ND.dtype).unsqueeze(1)  # as AllToAllDispatcher.combine: one rounding
        return torch.bmm(w_T1k, y_TkD).squeeze(1)

    def destroy(self) -> None:
        self.buffer.destroy()

    def _send(self, x_TD: torch.Tensor, idx_Tk: torch.Tensor):
        """One low-latency dispatch -> (its rows [El * M * R, D], canonical positions, their keys, counts)."""
        recv, count_El, ll_handle, _, _ = self.buffer.low_latency_dispatch(
            x_TD.to(torch.bfloat16).contiguous(), idx_Tk, self.max_tokens, self.num_experts, use_fp8=False)
        pos_N, keys_N, counts = self._canonical(count_El, ll_handle)
        return recv.view(-1, recv.shape[-1]), pos_N, keys_N, counts, ll_handle

    def _canonical(self, count_El: torch.Tensor, ll_handle):
        """Positions of the valid rows in (expert, source rank, source token) order, with those keys.

        An expert's valid rows are its first count[e]; layout_range[e, r] packs (rows from rank r, first row)."""
        src_info, layout_range = ll_handle[0], ll_handle[1]
        El, MR = src_info.shape
        M = self.max_tokens
        counts = count_El.tolist()  # the experts need host counts (as the all-to-all's); one sync per call
        row = torch.arange(MR, device=src_info.device)
        rank = torch.zeros(El, MR, dtype=torch.int64, device=src_info.device)
        for r in range(1, layout_range.shape[1]):
            num, first = layout_range[:, r] & 0xFFFFFFFF, layout_range[:, r] >> 32
            rank += r * ((row >= first[:, None]) & (row < (first + num)[:, None]))
        expert = torch.arange(El, device=src_info.device)[:, None]
        key = expert * MR + rank * M + src_info.long()
        key = torch.where(row < count_El[:, None].long(), key, El * MR)  # past an expert's count: unused rows
        keys, order = torch.sort(key.view(-1))
        n = sum(counts)
        return order[:n], keys[:n], counts


def _column(idx_Tk: torch.Tensor, j: int) -> torch.Tensor:
    """topk_idx with every choice but column j masked (-1: the kernels skip it)."""
    out = torch.full_like(idx_Tk, -1)
    out[:, j] = idx_Tk[:, j]
    return out


class _LLDispatch(torch.autograd.Function):
    """x [T, D] -> the received slots [N, D] grouped by local expert (fills `handle` for combine)."""

    @staticmethod
    def forward(ctx, x_TD, idx_Tk, handle: Handle, disp: DeepEPLowLatencyDispatcher):
        rows, pos_N, keys_N, counts, ll_handle = disp._send(x_TD, idx_Tk)
        handle.local_counts, handle.ll_handle, handle.idx_Tk = counts, ll_handle, idx_Tk
        handle.pos_N, handle.keys_N = pos_N, keys_N
        handle.token_of_slot_N = ll_handle[0].view(-1)[pos_N].long()  # source token (on its rank) of each slot
        ctx.handle, ctx.disp, ctx.dtype = handle, disp, x_TD.dtype
        return rows[pos_N].to(x_TD.dtype)

    @staticmethod
    def backward(ctx, grad_ND):
        h, disp = ctx.handle, ctx.disp
        # dispatch's adjoint is a combine along the same routes: with unit weights it sums a token's k slot
        # gradients (in fp32, one rounding), as the all-to-all's backward does
        T, k = h.idx_Tk.shape
        out = _rows_to_buffer(grad_ND, h.pos_N, disp)
        ones = torch.ones(T, k, dtype=torch.float32, device=grad_ND.device)
        grad_x, _, _ = disp.buffer.low_latency_combine(out, h.idx_Tk, ones, h.ll_handle)
        return grad_x.to(ctx.dtype), None, None, None


class _LLColumns(torch.autograd.Function):
    """Slots y [N, D] -> y_TkD [T, k, D]: each token's k expert outputs, unweighted, on the token's own rank."""

    @staticmethod
    def forward(ctx, y_ND, handle: Handle, disp: DeepEPLowLatencyDispatcher):
        T, k = handle.idx_Tk.shape
        buf = _rows_to_buffer(y_ND, handle.pos_N, disp)
        ones = torch.ones(T, k, dtype=torch.float32, device=y_ND.device)
        cols = [disp.buffer.low_latency_combine(buf, _column(handle.idx_Tk, j), ones, handle.ll_handle)[0]
                for j in range(k)]
        ctx.handle, ctx.disp, ctx.dtype = handle, disp, y_ND.dtype
        return torch.stack(cols, dim=1).to(y_ND.dtype)

    @staticmethod
    def backward(ctx, grad_TkD):
        h, disp = ctx.handle, ctx.disp
        # the adjoint sends row (t, j) back to slot (t, j): one dispatch per column j, masked to that column;
        # its rows are matched to the forward's slots by their (expert, rank, token) keys, each slot once
        grad_ND = grad_TkD.new_empty(h.pos_N.numel(), grad_TkD.shape[-1])
        for j in range(grad_TkD.shape[1]):
            rows, pos, keys, _, _ = disp._send(grad_TkD[:, j], _column(h.idx_Tk, j))
            grad_ND[torch.searchsorted(h.keys_N, keys)] = rows[pos].to(grad_ND.dtype)
        return grad_ND, None, None


def _rows_to_buffer(rows_ND: torch.Tensor, pos_N: torch.Tensor, disp: DeepEPLowLatencyDispatcher) -> torch.Tensor:
    """Slots in canonical order -> the low-latency layout [El, M * R, D] that combine reads (unused rows zero)."""
    D = rows_ND.shape[-1]
    buf = rows_ND.new_zeros(disp.num_local * disp.max_tokens * disp.ep, D, dtype=torch.bfloat16)
    buf[pos_N] = rows_ND.to(torch.bfloat16)
    return buf.view(disp.num_local, disp.max_tokens * disp.ep, D)
