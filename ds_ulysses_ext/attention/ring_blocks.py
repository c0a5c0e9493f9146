"""The per-block kernels of ring attention (ring.py): one query share against one K|V block, with its log-sum-exp.

Legend: B batch, h query heads, hkv K|V heads, Lq query rows and Lk key rows of a block, D head dim (Dv: v's, which
MLA makes differ; out has Dv), bq query rows of one torch-kernel block (QUERY_BLOCK).

    q [B h Lq D] x k|v [B hkv Lk D] -> out [B h Lq D] fp32, lse [B h Lq] fp32 (-inf: a row that sees no key)

Which keys a row sees comes from GLOBAL positions (BlockMask: causal, packed documents, HF's sliding window), since
the zigzag order is not sequence order. Two kernels: the exact torch kernel (fp32 logits, bq query rows at a time,
with a window only the keys each row block's window reaches), which is the reference and what CPU runs; and on
CUDA in bf16/fp16 a fused kernel with its log-sum-exp (cuDNN's, else torch's flash kernel: CUDA_KERNELS) for every
block whose visibility an is_causal flag says (with packed documents, one call per document part, or with many
of them one varlen call for the block, and with a window varlen calls with the kernel's reach: ring_varlen.py),
each checked once against the torch kernel at first use.
The backward of either takes the MERGED output and log-sum-exp of the whole row, so a block's gradients are its
share of the exact ones.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .kernel_check import first_disagreement, fused_shape_ok, isolated

log = logging.getLogger(__name__)


QUERY_BLOCK = 2048  # query rows per kernel block: bounds the fp32 logits to QUERY_BLOCK x key share

# Block plans that replace this module's kernels for some masks: (q, mask) -> a plan with forward/backward, or
# None. ring_varlen.py registers its varlen calls (packed documents, windows) here: it builds on this module's
# mask and torch kernel, so it sits above it, and a table keeps this module from importing it back.
PLANNERS: list = []


def _planned(q, mask):
    for planner in PLANNERS:
        plan = planner(q, mask)
        if plan is not None:
            return plan
    return None


# --- the per-block kernel: [B h Lq D] x [B hkv Lk D] -> out [B h Lq D] fp32, lse [B h Lq] fp32 ------------


@dataclass
class BlockMask:
    """Which keys a block's queries see, from GLOBAL positions (zigzag order is not sequence order).

    q_pos [Lq] / k_pos [Lk]: the global positions of the block's query / key rows (the ring's own mask, before a
    step picks its share, holds this rank's share as q_pos and arange(Sp) as k_pos); doc [B, Sp]: the document of
    every global position (packed rows; None: one document per row); window: HF's sliding window (k visible when
    q - k < window), or None.
    """
    causal: bool
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    doc: Optional[torch.Tensor] = None
    window: Optional[int] = None
    # what the kernels derived from this mask (their call plans), kept for the backward of the same block
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    def planned(self, key, build):
        """build(), once per mask and key: a block's plan costs host copies, and its backward needs it again."""
        if key not in self.plans:
            self.plans[key] = build()
        return self.plans[key]

    def visible(self, qs: int, qe: int, ks: int = 0, ke: Optional[int] = None) -> Optional[torch.Tensor]:
        """[B|1, 1, bq, Lk] bool for query rows qs..qe and key rows ks..ke, or None when every key is visible."""
        q, k = self.q_pos[qs:qe, None], self.k_pos[None, ks:ke]
        mask = None
        if self.causal:
            mask = k <= q
        if self.window is not None:
            near = q - k < self.window
            mask = near if mask is None else mask & near
        if mask is not None:
            mask = mask[None, None]
        if self.doc is not None:
            same = (self.doc[:, self.q_pos[qs:qe]][:, None, :, None]
                    == self.doc[:, self.k_pos[ks:ke]][:, None, None, :])
            mask = same if mask is None else mask & same
        return mask


def _expand(kv_BhLD: torch.Tensor, h: int) -> torch.Tensor:
    # GQA: query head i reads KV head i // (h / hkv), as repeat_kv does
    hkv = kv_BhLD.shape[1]
    return kv_BhLD if hkv == h else kv_BhLD.repeat_interleave(h // hkv, dim=1)


def _fold(grad_BhLD: torch.Tensor, hkv: int) -> torch.Tensor:
    # the adjoint of _expand: sum the query heads that share a KV head
    B, h, L, D = grad_BhLD.shape
    return grad_BhLD if h == hkv else grad_BhLD.reshape(B, hkv, h // hkv, L, D).sum(2)


def _logits(q, k, scale, mask: BlockMask, qs, ks=0):
    # [B h bq D] x [B h lk D] (keys ks.. of the block) -> [B h bq lk] fp32, -inf where the key is not visible
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    visible = mask.visible(qs, qs + q.shape[2], ks, ks + k.shape[2])
    return logits if visible is None else logits.masked_fill(~visible, float("-inf"))


def _query_blocks(mask: BlockMask, Lq: int, Lk: int) -> list:
    """(qs, qe, ks, ke) per query block of the torch kernel: its rows and the keys it reads.

    Without a window every block reads all Lk keys. With one, a block reads only the keys its window reaches, the
    positions k_pos[ks:ke] in [first query - window + 1, last query]: a superset of what it sees (masked keys add
    exact zeros), far fewer than Lk when the window is short (GPT-OSS: 128 in a share of thousands). For that the
    blocks also break where the query positions jump (a share's two zigzag chunks), so no block spans the gap.
    Both position lists are increasing (zigzag chunks in order; keys out of order are refused); two host syncs
    per call."""
    if mask.window is None:
        return [(qs, min(Lq, qs + QUERY_BLOCK), 0, Lk) for qs in range(0, Lq, QUERY_BLOCK)]
    q = mask.q_pos
    cuts = [0] + ((q[1:] - q[:-1]) != 1).nonzero().flatten().add(1).tolist() + [Lq]
    rows = [(qs, min(qe, qs + QUERY_BLOCK)) for a, qe in zip(cuts[:-1], cuts[1:]) for qs in range(a, qe, QUERY_BLOCK)]
    first = q[torch.tensor([a for a, _ in rows], device=q.device)]
    last = q[torch.tensor([b - 1 for _, b in rows], device=q.device)]
    ks = torch.searchsorted(mask.k_pos, first - mask.window + 1)
    ke = torch.searchsorted(mask.k_pos, last, right=True) if mask.causal else torch.full_like(ks, Lk)
    # the binary search needs increasing keys (out of order it would drop visible ones): checked in the same copy
    unordered = (mask.k_pos[1:] <= mask.k_pos[:-1]).any().reshape(1).to(ks.dtype)
    spans = torch.cat([ks, ke, unordered]).tolist()
    if spans[-1]:
        raise ValueError("ring attention: the block's key positions must increase for the window's key narrowing "
                         "(zigzag shares in chunk order, share_positions)")
    n = len(rows)
    return [(a, b, s, e) for (a, b), s, e in zip(rows, spans[:n], spans[n:2 * n])]


def merge(out, lse, rows, o_b, l_b) -> None:
    """Merge a partial result (o_b [B h r D], l_b [B h r]) into rows `rows` of (out, lse), in place: the fp32 online
    softmax, both rescaled to the merged log-sum-exp (rows that have seen no key yet stay at out 0, lse -inf)."""
    merged = torch.logaddexp(lse[:, :, rows], l_b)
    safe = _finite(merged)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - safe)[..., None]
                       + o_b * torch.exp(l_b - safe)[..., None])
    lse[:, :, rows] = merged


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # a row that sees no key of this block has lse -inf: exponentiate against 0 instead, so its weights are 0, not nan
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _fused(q, mask: BlockMask) -> bool:
    return _planned(q, mask) is not None or _fused_parts(q, mask) is not None


def _pad_v(t, D: int):
    return torch.nn.functional.pad(t, (0, D - t.shape[-1]))


def block_forward(q, k, v, scale: float, mask: BlockMask):
    """Attention of q against one K|V block, with its log-sum-exp (-inf for a row that sees none of its keys).

    v may have a head dim of its own (MLA): the torch kernel takes it; the fused kernels get v padded with zeros to
    q's, which adds exact zeros to the output (cut off here) and nothing to the gradients."""
    Dv = v.shape[-1]
    if Dv != k.shape[-1] and _fused(q, mask):
        out, lse = block_forward(q, k, _pad_v(v, k.shape[-1]), scale, mask)
        return out[..., :Dv], lse
    h = q.shape[1]
    varlen = _planned(q, mask)
    if varlen is not None:  # many packed documents, or a window: varlen calls (ring_varlen.py)
        return varlen.forward(q, k, v, scale)
    k, v = _expand(k, h), _expand(v, h)
    parts = _fused_parts(q, mask)
    if parts is not None and mask.doc is None:  # one call covers the block: no buffers to fill
        out, lse = _fused_kernel(q).forward(q, k, v, scale, parts[0][3])
        return out.float(), lse.float()
    if parts is not None:
        kernel = _fused_kernel(q)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for b, rows, keys, is_causal in parts:  # rows that see no key of this block stay at (0, -inf)
            o, l = kernel.forward(q[b, :, rows], k[b, :, keys], v[b, :, keys], scale, is_causal)
            out[b, :, rows], lse[b, :, rows] = o.float(), l.float()
        return out, lse
    return _torch_block_forward(q, k, v, scale, mask)


def _torch_block_forward(q, k, v, scale: float, mask: BlockMask):
    # the exact kernel: fp32 logits for QUERY_BLOCK query rows at a time (k, v already expanded to q's heads)
    outs, lses = [], []
    for qs, qe, ks, ke in _query_blocks(mask, q.shape[2], k.shape[2]):
        qb = q[:, :, qs:qe]
        if ke <= ks:  # the window reaches no key of this block: an empty share (0, -inf)
            outs.append(torch.zeros(qb.shape, dtype=torch.float32, device=q.device))
            lses.append(torch.full(qb.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))
            continue
        logits = _logits(qb, k[:, :, ks:ke], scale, mask, qs, ks)
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.matmul(torch.exp(logits - _finite(lse)[..., None]), v[:, :, ks:ke].float()))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def block_backward(q, k, v, dout, lse, delta, scale: float, mask: BlockMask, out=None):
    """dq, dk, dv (fp32) of one block, from the MERGED log-sum-exp and delta = rowsum(dout * out) of the whole row
    (`out`: the merged output of these rows, which the fused kernel takes in place of delta)."""
    Dv, D = v.shape[-1], k.shape[-1]
    if Dv != D and out is not None and _fused(q, mask):  # as block_forward: zero columns of v, out and dout
        dq, dk, dv = block_backward(q, k, _pad_v(v, D), _pad_v(dout, D), lse, delta, scale, mask, out=_pad_v(out, D))
        return dq, dk, dv[..., :Dv]
    h, hkv = q.shape[1], k.shape[1]
    varlen = _planned(q, mask) if out is not None else None
    if varlen is not None:
        return varlen.backward(dout, q, k, v, out, lse, scale)
    parts = _fused_parts(q, mask) if out is not None else None
    if parts is not None and mask.doc is None:  # one call covers the block
        dq, dk, dv = _fused_kernel(q).backward(dout, q, _expand(k, h), _expand(v, h), out, lse, scale, parts[0][3])
        return dq.float(), _fold(dk.float(), hkv), _fold(dv.float(), hkv)
    if parts is not None:
        kernel = _fused_kernel(q)
        ke, ve = _expand(k, h), _expand(v, h)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for b, rows, keys, is_causal in parts:
            g_q, g_k, g_v = kernel.backward(dout[b, :, rows], q[b, :, rows], ke[b, :, keys], ve[b, :, keys],
                                            out[b, :, rows], lse[b, :, rows], scale, is_causal)
            dq[b, :, rows] += g_q.float()
            dk[b, :, keys] += g_k.float()
            dv[b, :, keys] += g_v.float()
        return dq, _fold(dk, hkv), _fold(dv, hkv)
    return _torch_block_backward(q, k, v, dout, lse, delta, scale, mask)


def _torch_block_backward(q, k, v, dout, lse, delta, scale: float, mask: BlockMask):
    h, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, h).float(), _expand(v, h).float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)  # v's own head dim (MLA)
    for qs, qe, ks, kend in _query_blocks(mask, q.shape[2], ke.shape[2]):
        if kend <= ks:  # the window reaches no key of this block: no gradient
            continue
        qb, dob = q[:, :, qs:qe].float(), dout[:, :, qs:qe].float()
        kb, vb = ke[:, :, ks:kend], ve[:, :, ks:kend]
        # the merged lse is finite (every row sees itself), so masked keys get exactly 0
        p = torch.exp(_logits(qb, kb, scale, mask, qs, ks) - lse[:, :, qs:qe, None])
        dv[:, :, ks:kend] += torch.matmul(p.transpose(-1, -2), dob)
        ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - delta[:, :, qs:qe, None])
        dq[:, :, qs:qe] = torch.matmul(ds, kb) * scale
        dk[:, :, ks:kend] += torch.matmul(ds.transpose(-1, -2), qb) * scale
    return dq, _fold(dk, hkv), _fold(dv, hkv)


# --- the fused block kernel: flash attention with its log-sum-exp, for the blocks a kernel flag describes -----
#
# A zigzag ring step's block is, without documents or a window, either all visible (an earlier share, or a later
# share seen by the second local chunk) or the local share's causal diagonal (step 0: the two chunks in order
# make "query i sees key j <= i" exact). Those two are what a flash kernel's is_causal flag says, so the block
# can run fused: forward returns (out, lse); backward takes the MERGED out and lse of the whole ring, which makes
# its dq/dk/dv this block's share of the exact gradient (as every flash-based ring does). Other blocks (documents,
# windows) run the masked torch kernel above, which stays the reference. torch's cuDNN and flash ops (aten) carry
# the log-sum-exp, which the public SDPA call does not return: that is why they are called directly, here only.

FUSED_ON_CPU = False  # CPU runs the torch kernel (the reference); tests set this to check the fused path's logic


def _fused_parts(q, mask: BlockMask):
    """The fused kernel calls of one block: [(batch slice, query rows, key rows, is_causal)], or None when the fused
    kernel is not available or some part of the block is a visibility no kernel flag says (then the torch kernel
    runs the whole block). Without documents: the block itself, for every batch row at once. With documents: one
    call per (batch row, document) that has both queries and keys here; both position lists increase, and a
    document is an interval of positions, so its query rows and key rows are contiguous slices."""
    return mask.planned("parts", lambda: _build_fused_parts(q, mask))


def _build_fused_parts(q, mask: BlockMask):
    if mask.window is not None or _fused_kernel(q) is None:
        return None
    if mask.doc is None:
        flag = _fused_flag(mask)
        return None if flag is None else [(slice(None), slice(None), slice(None), flag)]
    parts = []
    for b in range(mask.doc.shape[0]):
        q_doc, k_doc = mask.doc[b, mask.q_pos], mask.doc[b, mask.k_pos]
        q_ids, q_n = torch.unique_consecutive(q_doc, return_counts=True)
        k_ids, k_n = torch.unique_consecutive(k_doc, return_counts=True)
        k_span = {}
        start = 0
        for d, n in zip(k_ids.tolist(), k_n.tolist()):
            k_span[d] = slice(start, start + n)
            start += n
        start = 0
        for d, n in zip(q_ids.tolist(), q_n.tolist()):
            rows = slice(start, start + n)
            start += n
            keys = k_span.get(d)
            if keys is None:
                continue  # this document has no key in the block
            flag = _fused_flag(BlockMask(mask.causal, mask.q_pos[rows], mask.k_pos[keys]))
            if flag is None:
                return None
            parts.append((slice(b, b + 1), rows, keys, flag))
    return parts


def _fused_flag(mask: BlockMask) -> Optional[bool]:
    """is_causal for a fused call (False: every key visible; True: the aligned causal diagonal), else None."""
    if mask.doc is not None or mask.window is not None:
        return None
    if not mask.causal:
        return False
    q, k = mask.q_pos, mask.k_pos  # increasing within a block (zigzag chunks in order)
    if int(k[-1]) <= int(q[0]):
        return False
    if q.shape == k.shape and torch.equal(q, k):
        return True
    return None


class _CpuFlash:
    @staticmethod
    def forward(q, k, v, scale, is_causal):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale, is_causal):
        args = [t.contiguous() for t in (dout, q, k, v, out.to(q.dtype), lse.to(q.dtype))]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, is_causal, scale=scale)


class _CudaFlash:
    @staticmethod
    def forward(q, k, v, scale, is_causal):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, False, scale=scale)[:2]
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale, is_causal):
        # The arguments as the op's own forward hands them to autograd in the dense, dropout-free case: no
        # cumulative lengths (None, an undefined tensor: a defined one selects the varlen kernel, which asks for
        # int32 offsets; measured on the H200) and 0-dim CPU int64 random-state tensors that dropout 0 never reads
        Lq, Lk = q.shape[2], k.shape[2]
        seed, offset = (torch.empty((), dtype=torch.int64) for _ in range(2))
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
            lse.float().contiguous(), None, None, Lq, Lk, 0.0, is_causal, seed, offset, scale=scale)


class _CudaCudnn:
    # cuDNN's fused attention, what SDPA picks on Hopper for these shapes: on an H200 at 128k the ring's blocks
    # through it cost what one full causal call does, where torch's flash kernel (FlashAttention-2) costs ~1.5x
    # (docs/benchmarks.md, the ring's kernel side). Its log-sum-exp comes as [B h Lq 1]; the ring keeps [B h Lq].

    @staticmethod
    def forward(q, k, v, scale, is_causal):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, is_causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, scale, is_causal):
        # no bias, no cumulative lengths (dense), and random-state tensors that dropout 0 never reads (on the
        # GPU here, which cuDNN's op asks for); the merged lse back in the kernel's [B h Lq 1]
        Lq, Lk = q.shape[2], k.shape[2]
        seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))  # cuDNN: on device
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
            lse.float().reshape(*q.shape[:3], 1).contiguous(), seed, offset, None, None, None, Lq, Lk, 0.0,
            is_causal, scale=scale)


CUDA_KERNELS = (_CudaCudnn, _CudaFlash)  # in order of preference: the first that passes _checked on the device


def _fused_kernel(q):
    """The fused block kernel for q's device and dtype, or None (the masked torch kernel)."""
    if not q.is_cuda:
        return _CpuFlash if FUSED_ON_CPU else None
    if not fused_shape_ok(q):
        return None
    return next((kernel for kernel in CUDA_KERNELS if _checked(kernel, q.device, q.dtype, q.shape[-1])), None)


@functools.lru_cache(maxsize=None)
def _checked(kernel, device, dtype, D: int) -> bool:
    """Once per (kernel, device, dtype, head dim): the fused kernel against the torch kernel on a small random
    block, causal and not, forward and backward. A kernel that cannot be called here is logged and the ring
    keeps the torch kernel; one that runs but disagrees is an error, never used."""
    with isolated():  # first use is inside a layer's forward, maybe checkpointed (kernel_check.py)
        return _check(kernel, device, dtype, D)


def _check(kernel, device, dtype, D: int) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 192, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    pos = torch.arange(192, device=device)
    for causal in (False, True):
        mask = BlockMask(causal, pos, pos)
        try:
            out, lse = kernel.forward(q, k, v, D ** -0.5, causal)
            grads = kernel.backward(dout, q, k, v, out, lse.float(), D ** -0.5, causal)
        except (RuntimeError, TypeError) as err:
            log.warning("ring attention: the fused %s kernel cannot run on %s in %s (%s); the ring runs the exact "
                        "torch block kernel", kernel.__name__, device, dtype, str(err).splitlines()[0][:200])
            return False
        if tuple(lse.shape) != tuple(q.shape[:3]) or tuple(out.shape) != tuple(q.shape):
            log.warning("ring attention: the fused %s kernel returns out %s / lse %s for q %s on %s, not the layout "
                        "the ring merges; the ring runs the exact torch block kernel", kernel.__name__,
                        tuple(out.shape), tuple(lse.shape), tuple(q.shape), device)
            return False
        ref_out, ref_lse = _torch_block_forward(q, k, v, D ** -0.5, mask)
        delta = (dout.float() * ref_out).sum(-1)
        ref_grads = _torch_block_backward(q, k, v, dout, ref_lse, delta, D ** -0.5, mask)
        bad = first_disagreement([("out", out, ref_out), ("lse", lse, ref_lse)]
                                 + list(zip(("dq", "dk", "dv"), grads, ref_grads)))
        if bad:
            raise RuntimeError(f"ring attention: the fused {kernel.__name__} kernel disagrees with the exact torch "
                               f"block kernel on {device} in {dtype} ({bad[0]}: error {bad[1]:.2e}, causal="
                               f"{causal}); set parallelism.ring=1 or report this")
    log.info("ring attention: fused %s block kernel checked against the torch kernel on %s in %s", kernel.__name__,
             device, dtype)
    return True

