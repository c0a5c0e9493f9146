"""The lean expert pass: dispatch, the experts and the weighted combine at ep=1 as one autograd function that keeps
only the tokens x, the routing and the experts' first projection h for backward.

With moe.recompute=experts h is not kept either: backward computes it again from x_N (one grouped GEMM).

Legend: T tokens, k top-k, N = T * k expert slots (sorted by expert), D expert width, I expert intermediate size,
El local experts (= E at ep=1).

    forward:   x [T, D], w [T, k], order [N] (sorted slot -> flat slot t * k + j), counts [El]
               x_N = x[order // k]                   (the slot rows, transient)
               h = x_N @ gate_up^T  [N, 2I]          (kept)
               act = silu(gate) * up  [N, I]         (transient)
               y = act @ down^T  [N, D]              (transient)
               out[t] = sum_j w[t, j] * y[pos[t, j]]  [T, D]   (pos: the inverse of order, fp32 sums)
    backward:  g [T, D] -> g_N = g[order // k]; u = g_N @ down [N, I]
               grad_w[slot] = <u, act>;  grad_act = w * u;  grad_h = SwiGLU'(h) grad_act;  d_down = g_N^T (w * act)
               x_N again; d_gate_up = grad_h^T x_N;  grad_x[t] = sum_j (grad_h @ gate_up)[pos[t, j]]

Why its own function: on the three-function path (dispatch.py's expansion, experts.py's grouped GEMMs, dispatch.py's
combine) autograd keeps x_N for the first projection's weight gradient, act for the second's, and y for the routing
weights' gradient: 1.2 GiB per layer at 16k tokens of the Qwen3-30B-A3B shape, 2.4 GiB at 32k, beside h. Here x_N is
gathered again in backward (a copy), act is recomputed from h (elementwise), and y is never needed: <g, y> =
<g, act @ down^T> = <g @ down, act>, and g @ down is the product backward computes anyway once the routing weight is
applied after it instead of before. The same sums as the three-function path up to where the bf16 roundings fall.

Only at ep=1 (the tokens x are local: nothing to exchange again in backward), for Qwen3's layout without biases,
with the fused kernels (model.kernels != none); elsewhere layer.py runs the three functions, which are the
reference. CPU runs this function only in tests (torch's formulas in the kernels' places, loops of matmuls in the
grouped GEMMs' places), against that reference.
"""
from __future__ import annotations

import torch

from ..kernels.glu import glu_forward, glu_weighted_backward, reference_glu_weighted_backward
from ..kernels.slot_sum import reference_slot_sum, slot_sum
from . import grouped
from .dispatch import AllToAllDispatcher
from .grouped import _swiglu


def applies(dispatcher, experts, x_TD: torch.Tensor) -> bool:
    """Whether layer.py runs this pass: the all-to-all dispatcher at ep=1 and the experts both on their fused paths,
    Qwen3's bias-free SwiGLU experts, on a device where the grouped GEMMs and the kernels run (each kernel checked at
    its first use). moe.recompute: `act` recomputes what this pass recomputes anyway; `experts` keeps no h either and
    computes it again in backward (one grouped GEMM: the second projection's output is never needed), unless its
    inputs were asked to wait in host memory (offload_inputs: the three functions do that)."""
    from ..kernels.glu import glu_ok
    from ..kernels.slot_sum import slot_sum_ok
    return (type(dispatcher) is AllToAllDispatcher and dispatcher.ep == 1 and dispatcher.fused and experts.fused
            and experts.recompute in ("none", "act", "experts") and not experts.offload_inputs
            and experts.layout == "qwen3" and not experts.bias
            and experts.activation == "swiglu" and x_TD.is_cuda
            and grouped._grouped_mm_ok(x_TD, experts.gate_up_proj, experts.down_proj)
            and glu_ok(x_TD.device, x_TD.dtype) and slot_sum_ok(x_TD.device, x_TD.dtype))


class LeanExpertPass(torch.autograd.Function):
    """out [T, D] = the weighted combine of the experts' outputs on x's top-k slots; see the module docstring."""

    @staticmethod
    def forward(ctx, x_TD, w_Tk, gate_up, down, order_N, inverse_N, counts_E, kernels: bool, recompute_h: bool):
        T, k = w_Tk.shape
        ops = _Ops(kernels, counts_E)
        token_N = order_N // k
        h = ops.gmm(x_TD[token_N], gate_up.transpose(-2, -1))
        w = w_Tk.to(x_TD.dtype)  # the weights in the activations' dtype, as the combine of dispatch.py takes them
        out = ops.slot_sum(ops.gmm(ops.glu(h), down.transpose(-2, -1)), inverse_N.view(T, k), w)
        ctx.save_for_backward(x_TD, w, gate_up, down, order_N, inverse_N, counts_E, None if recompute_h else h)
        ctx.kernels, ctx.w_dtype = kernels, w_Tk.dtype
        return out

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, w, gate_up, down, order_N, inverse_N, counts_E, h = ctx.saved_tensors
        T, k = w.shape
        ops = _Ops(ctx.kernels, counts_E)
        token_N = order_N // k
        if h is None:  # moe.recompute=experts: the first projection again (the second is never needed)
            h = ops.gmm(x_TD[token_N], gate_up.transpose(-2, -1))
        g_N = g_TD.contiguous()[token_N]
        u = ops.gmm(g_N, down)  # [N, D] x [El, D, I]: the down projection's input gradient before the weight
        grad_h, grad_w_N, wact = ops.glu_backward(u, h, w.reshape(-1)[order_N])
        del u
        grad_down = ops.gmm_weights(g_N, wact)  # [El, D, I] = g_N^T (w * act) per expert
        del g_N, wact
        grad_gate_up = ops.gmm_weights(grad_h, x_TD[token_N])  # [El, 2I, D]
        grad_x = ops.slot_sum(ops.gmm(grad_h, gate_up), inverse_N.view(T, k))
        grad_w = grad_w_N[inverse_N].view(T, k).to(ctx.w_dtype)
        return grad_x, grad_w, grad_gate_up, grad_down, None, None, None, None, None


class _Ops:
    """The pass's primitives: Triton kernels and torch._grouped_mm on CUDA (`kernels`), else torch's formulas and
    per-expert matmuls with the same contractions (the counts read on the host: tests only)."""

    def __init__(self, kernels: bool, counts_E: torch.Tensor):
        self.kernels, self.counts_E = kernels, counts_E
        self._offs = self._host_counts = None

    @property
    def offs(self) -> torch.Tensor:
        if self._offs is None:
            self._offs = self.counts_E.cumsum(0, dtype=torch.int32)
        return self._offs

    def gmm(self, a_N: torch.Tensor, b_GKM: torch.Tensor) -> torch.Tensor:
        """Row group e of a [N, K] times b[e] [K, M] -> [N, M]."""
        if self.kernels:
            return torch._grouped_mm(a_N, b_GKM, offs=self.offs)
        return torch.cat([rows @ b_GKM[e] for e, rows in enumerate(self._split(a_N))])

    def gmm_weights(self, a_NP: torch.Tensor, b_NQ: torch.Tensor) -> torch.Tensor:
        """A weight gradient: per expert e, a's rows of e transposed times b's rows of e -> [El, P, Q]."""
        if self.kernels:
            return torch._grouped_mm(a_NP.t(), b_NQ, offs=self.offs)
        return torch.stack([a.t() @ b for a, b in zip(self._split(a_NP), self._split(b_NQ))])

    def glu(self, h_N2I: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return glu_forward(h_N2I)
        return _swiglu(h_N2I)

    def glu_backward(self, u_NI, h_N2I, w_N):
        """-> (grad_h [N, 2I], grad_w [N] fp32 = <u, act>, w * act [N, I]); grad_act = w * u."""
        if self.kernels:
            return glu_weighted_backward(u_NI, h_N2I, w_N)
        grad_h, grad_w, wact = reference_glu_weighted_backward(u_NI, h_N2I, w_N)
        return grad_h.to(h_N2I.dtype), grad_w, wact.to(h_N2I.dtype)

    def slot_sum(self, y_ND, pos_Tk, w_Tk=None):
        return (slot_sum if self.kernels else reference_slot_sum)(y_ND, pos_Tk, w_Tk)

    def _split(self, rows: torch.Tensor) -> tuple:
        if self._host_counts is None:
            self._host_counts = self.counts_E.tolist()
        return torch.split(rows, self._host_counts)
