"""Ring attention simulated on one GPU (or CPU): ring.py's own forward and backward of one ring rank, with a stand-in
ring that hands over the other ranks' K|V shares instead of communicating. scripts/bench/bench_attn_features.py times
it; tests/test_gpu_paths.py and --check use `check_ring`: every simulated rank together must give exact attention.

Shapes: q, k, v, dout [B, h, S, D] (ring.py's layout); a rank's share [B, h, L, D] with L = S / R; a packed K|V share
[B, hkv, L, 2D].
"""
import torch
import torch.nn.functional as F

import ds_ulysses_ext.attention.ring as ring_mod
import ds_ulysses_ext.attention.ring_blocks as blocks_mod
from ds_ulysses_ext.attention.masks import masked_attention
from ds_ulysses_ext.attention.ring import share_positions
from ds_ulysses_ext.attention.ring_blocks import BlockMask


class OneGpuRing:
    """Stands in for ring.py's _Ring: ring rank `rank` of `size`, no communication.

    ring.py calls start() in a fixed order: forward, once per step t < size - 1 with K|V; backward, per step t
    K|V (t < size - 1) then the dK|dV accumulator. A K|V "received" for step t + 1 is the share of ring rank
    (rank - t - 1) mod size; a dK|dV accumulator received is zeros (the other ranks' contributions are not computed
    here), and with keep=True each sent accumulator (this rank's contribution to that share) is kept, so that
    --check can sum every rank's contributions. If ring.py changes that order, --check fails."""

    def __init__(self, rank, size, shares, backward, keep=False):
        self.rank, self.size, self.shares, self.backward, self.keep = rank, size, shares, backward, keep
        self.calls, self.sent = 0, []

    def start(self, t):
        i, self.calls = self.calls, self.calls + 1
        step, is_kv = (i // 2, i % 2 == 0 and i < 2 * (self.size - 1)) if self.backward else (i, True)
        if is_kv:
            return self.shares[(self.rank - step - 1) % self.size], []
        if self.keep:
            self.sent.append(((self.rank - step) % self.size, t.clone()))
        return torch.zeros_like(t), []

    @staticmethod
    def wait(pending):
        return pending[0]


def kv_shares(k, v, R):
    """Every ring rank's packed K|V share [B hkv L 2D], what ring.py passes around."""
    all_pos = torch.arange(k.shape[2], device=k.device)
    return [torch.cat([k[:, :, share_positions(all_pos, R, s)], v[:, :, share_positions(all_pos, R, s)]],
                      dim=-1).contiguous() for s in range(R)]


def rank_inputs(q, k, v, dout, R, r, window, shares=None, doc=None):
    """Ring rank r's share (ring.py's [B h L D] layout), its mask, and every rank's packed K|V share."""
    S = q.shape[2]
    all_pos = torch.arange(S, device=q.device)
    idx = share_positions(all_pos, R, r)
    shares = kv_shares(k, v, R) if shares is None else shares
    mask = BlockMask(True, idx, all_pos, doc, window)
    mine = [t[:, :, idx].contiguous() for t in (q, k, v, dout)]
    return mine, mask, shares, idx


def ring_rank(q, k, v, dout, R, r, window=None, keep=False, prepared=None):
    """ring.py's forward + backward of ring rank r: (out, dq, dk, dv, sent accumulators)."""
    (qr, kr, vr, dr), mask, shares, _ = prepared or rank_inputs(q, k, v, dout, R, r, window)
    scale = q.shape[-1] ** -0.5
    steps = {}  # as _RingAttention keeps the step masks (and their kernel plans) from forward to backward
    out, lse = ring_mod._ring_forward(qr, kr, vr, scale, mask, OneGpuRing(r, R, shares, False), steps)
    out = out.to(q.dtype)  # as _RingAttention.forward keeps it
    bwd = OneGpuRing(r, R, shares, True, keep)
    dq, dk, dv = ring_mod._ring_backward(qr, kr, vr, out, lse, dr, None, scale, mask, bwd, steps)
    return out, dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), bwd.sent


def fused_sdpa_only(device):
    """On CUDA, SDPA without its math fallback: a block shape no fused kernel takes fails instead of materialising
    [h, Lq, Lk] logits (137 GB for a 64k x 32k block of 32 heads)."""
    import contextlib
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def ring_sdpa_blocks(q, k, v, dout, R, prepared):
    """Projection: every rank's zigzag blocks through SDPA (fwd + bwd) + the fp32 merge on stand-in lse."""
    with fused_sdpa_only(q.device):
        _ring_sdpa_blocks(q, k, v, dout, R, prepared)


def _ring_sdpa_blocks(q, k, v, dout, R, prepared):
    D = q.shape[-1]
    for r in range(R):
        (qr, _, _, dr), _, shares, _ = prepared[r]
        L = qr.shape[2]
        qr = qr.detach().requires_grad_()
        out = torch.zeros(qr.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qr.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        outs, grads = [], []
        for t in range(R):
            src = (r - t) % R
            rows, keys = ring_mod._step_slices(t, src, r, L, True)
            kv = shares[src][:, :, keys].detach().requires_grad_()
            kb, vb = kv[..., :D].contiguous(), kv[..., D:].contiguous()  # as a flash ring would unpack them
            o_b = F.scaled_dot_product_attention(qr[:, :, rows], kb, vb, is_causal=t == 0,
                                                 enable_gqa=qr.shape[1] != kb.shape[1])
            with torch.no_grad():  # ring.py's merge, on a stand-in for the block's log-sum-exp
                l_b = torch.randn(o_b.shape[:3], device=q.device)
                merged = torch.logaddexp(lse[:, :, rows], l_b)
                safe = blocks_mod._finite(merged)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - safe)[..., None]
                                   + o_b.float() * torch.exp(l_b - safe)[..., None])
                lse[:, :, rows] = merged
            outs.append(o_b)
            grads.append(dr[:, :, rows])
        torch.autograd.backward(outs, grads)


def check_ring(q, k, v, dout, R, window, rtol=1e-5):
    """Every simulated rank together must give exact attention: out, dq, dk, dv."""
    S, D = q.shape[2], q.shape[-1]
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    if window is None:
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
    else:
        ref = masked_attention(*(t.transpose(1, 2) for t in (qf, kf, vf)), causal=True, window=window).transpose(1, 2)
    ref.backward(dout.double())
    out, dq = torch.zeros_like(ref), torch.zeros_like(qf)
    dkv = torch.zeros(kf.shape[:3] + (2 * D,), dtype=torch.float64, device=q.device)
    all_pos = torch.arange(S, device=q.device)
    for r in range(R):
        o, g_q, _, _, sent = ring_rank(q, k, v, dout, R, r, window, keep=True)
        idx = share_positions(all_pos, R, r)
        out[:, :, idx], dq[:, :, idx] = o.double(), g_q.double()
        for src, acc in sent:
            dkv[:, :, share_positions(all_pos, R, src)] += acc.double()
    got = {"out": (out, ref.detach()), "dq": (dq, qf.grad), "dk": (dkv[..., :D], kf.grad),
           "dv": (dkv[..., D:], vf.grad)}
    rels = {n: ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for n, (a, b) in got.items()}
    if max(rels.values()) > rtol:
        raise AssertionError(f"ring {R} simulation (window {window}) is not exact: {rels}")
    return rels
