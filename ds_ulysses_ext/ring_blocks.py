"""The per-block kernels of ring attention (ring.py): one query share against one K|V block, with its log-sum-exp.

Legend: B batch, h query heads, hkv K|V heads, Lq query rows and Lk key rows of a block, D head dim, bq query rows
of one torch-kernel block (QUERY_BLOCK).

    q [B h Lq D] x k|v [B hkv Lk D] -> out [B h Lq D] fp32, lse [B h Lq] fp32 (-inf: a row that sees no key)

Which keys a row sees comes from GLOBAL positions (BlockMask: causal, packed documents, HF's sliding window), since
the zigzag order is not sequence order. Two kernels: the exact torch kernel (fp32 logits, bq query rows at a time,
with a window only the keys each row block's window reaches), which is the reference and what CPU runs; and on
CUDA in bf16/fp16 a fused kernel with its log-sum-exp (cuDNN's, else torch's flash kernel: CUDA_KERNELS) for every
block whose visibility an is_causal flag says (with packed documents, one call per document part, or with many
of them one varlen call for the block: _VarlenBlock), each checked once against the torch kernel at first use.
The backward of either takes the MERGED output and log-sum-exp of the whole row, so a block's gradients are its
share of the exact ones.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .kernel_check import isolated, relative_error

log = logging.getLogger(__name__)

QUERY_BLOCK = 2048  # query rows per kernel block: bounds the fp32 logits to QUERY_BLOCK x key share


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


def block_forward(q, k, v, scale: float, mask: BlockMask):
    """Attention of q against one K|V block, with its log-sum-exp (-inf for a row that sees none of its keys)."""
    h = q.shape[1]
    varlen = _varlen_block(q, mask) or _window_block(q, mask)
    if varlen is not None:  # many packed documents, or a window: varlen calls
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
    h, hkv = q.shape[1], k.shape[1]
    varlen = (_varlen_block(q, mask) or _window_block(q, mask)) if out is not None else None
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
    dv = torch.zeros_like(dk)
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


# --- packed documents: one varlen call per block --------------------------------------------------------------
#
# With packed documents the per-part calls above cost one kernel launch, a host-side slice and a copy per
# (batch row, document) of every block, every step, every layer: a 128k row of chat samples holds ~130 of them. A
# varlen kernel takes them all at once: segment n of the flat query axis (B * Lq rows) attends to segment n of the
# flat key axis, where the segments are the documents that the block's queries or keys touch, in order (zero rows
# on either side allowed). The block's visibility flag (the diagonal or all-visible, as above) holds within every
# document, since a document is an interval of positions. Rows whose document has no key in the block come back
# as (0, -inf) here whatever the kernel writes for them; keys whose document has no query get zero gradients.
# The varlen kernel is torch's flash kernel (flash_varlen.py), which on an H200 is slower than cuDNN's per call,
# so the per-part calls stay for blocks of few, long documents (VARLEN_PARTS).

VARLEN_PARTS = 8  # a block with more document parts per batch row than this takes the varlen call
VARLEN_ON_CPU = False  # tests set this (with flash_varlen.KERNEL a CPU stand-in) to check the logic in CI


class _VarlenBlock(NamedTuple):
    cu_q: torch.Tensor  # [N+1] int32 segment bounds over the B * Lq query rows
    cu_k: torch.Tensor  # [N+1] int32 over the B * Lk key rows
    max_q: int
    max_k: int
    causal: bool  # the block's flag: its diagonal (True) or all visible (False)
    empty_q: torch.Tensor  # [B*Lq] bool: rows whose document has no key in the block
    empty_k: torch.Tensor  # [B*Lk] bool: keys whose document has no query in the block

    def forward(self, q, k, v, scale):
        from . import flash_varlen
        B, h, Lq, D = q.shape
        out, lse, _ = flash_varlen.KERNEL.forward(_flat(q), _flat(k), _flat(v), self.cu_q, self.cu_k,
                                                  self.max_q, self.max_k, scale, self.causal, -1,
                                                  0 if self.causal else -1)
        out = out.float().masked_fill(self.empty_q[:, None, None], 0.0)
        lse = lse.float().masked_fill(self.empty_q[None], float("-inf"))  # [h B*Lq]
        return (out.reshape(B, Lq, h, D).transpose(1, 2), lse.reshape(h, B, Lq).transpose(0, 1))

    def backward(self, dout, q, k, v, out, lse, scale):
        from . import flash_varlen
        B, h, Lq, D = q.shape
        Lk = k.shape[2]
        lse_hT = lse.float().transpose(0, 1).reshape(h, B * Lq).contiguous()
        dq, dk, dv = flash_varlen.KERNEL.backward(
            _flat(dout.to(q.dtype)), _flat(q), _flat(k), _flat(v), _flat(out.to(q.dtype)),
            lse_hT, self.cu_q, self.cu_k, self.max_q, self.max_k, scale, self.causal, -1, 0 if self.causal else -1)
        dq = dq.float().masked_fill(self.empty_q[:, None, None], 0.0)
        dk, dv = (g.float().masked_fill(self.empty_k[:, None, None], 0.0) for g in (dk, dv))

        def back(g, L):  # [B*L n D] -> [B n L D]
            return g.reshape(B, L, g.shape[1], D).transpose(1, 2)
        return back(dq, Lq), back(dk, Lk), back(dv, Lk)


def _varlen_block(q, mask: BlockMask) -> Optional[_VarlenBlock]:
    """The varlen call of a block with packed documents, or None (no documents, a window, a visibility no flag says,
    at most VARLEN_PARTS document parts per batch row, or no varlen kernel here)."""
    if mask.doc is None or mask.window is not None or not _varlen_usable(q):
        return None
    return _varlen_plan(mask, VARLEN_PARTS * mask.doc.shape[0])


def _varlen_plan(mask: BlockMask, parts_above: int) -> Optional[_VarlenBlock]:
    # the segments of the block's documents, when more than parts_above of them have both queries and keys here;
    # one host copy of their counts
    flag = _fused_flag(BlockMask(mask.causal, mask.q_pos, mask.k_pos))
    if flag is None:
        return None
    # document ids are unique across rows and increase along them, so the flat axes hold them in order
    q_doc, k_doc = mask.doc[:, mask.q_pos].reshape(-1), mask.doc[:, mask.k_pos].reshape(-1)
    docs = torch.unique(torch.cat([q_doc, k_doc]))  # sorted: every segment, in flat order
    n_q = torch.bincount(torch.searchsorted(docs, q_doc), minlength=len(docs))
    n_k = torch.bincount(torch.searchsorted(docs, k_doc), minlength=len(docs))
    parts, max_q, max_k = torch.stack([((n_q > 0) & (n_k > 0)).sum(), n_q.max(), n_k.max()]).tolist()
    if parts <= parts_above:
        return None
    zero = torch.zeros(1, dtype=torch.int32, device=q_doc.device)
    cu_q = torch.cat([zero, n_q.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, n_k.cumsum(0).to(torch.int32)])
    return _VarlenBlock(cu_q, cu_k, max_q, max_k, flag, (n_k == 0).repeat_interleave(n_q),
                        (n_q == 0).repeat_interleave(n_k))


# --- a sliding window: the kernel's own reach, per pair of contiguous runs --------------------------------------
#
# A block's query rows are one or two runs of consecutive positions (a share's zigzag chunks) and so are its keys.
# For one query run against one key run, the window is a band: query p sees keys p - window + 1 .. p. Trimmed to
# the queries that reach some key of the run and the keys some query reaches, the band is what the flash kernel's
# (left, right) reach says around its bottom-right aligned diagonal (right = last query - last key, left = window
# - 1 - right), so each pair is one varlen call with every batch row a segment, and the pairs merge like ring steps.


class _WindowBlock(NamedTuple):
    pairs: list  # [(query rows qs:qe, key rows ks:ke, left, right)], block-local

    def forward(self, q, k, v, scale):
        from . import flash_varlen
        B, h, Lq, D = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for qs, qe, ks, ke, left, right in self.pairs:
            cu_q, cu_k = (_rows(B, n, q.device) for n in (qe - qs, ke - ks))
            o, l, _ = flash_varlen.KERNEL.forward(*(_flat(t) for t in (q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke])),
                                                  cu_q, cu_k, qe - qs, _max_k(ke - ks, left, right), scale, False,
                                                  left, right)
            merge(out, lse, slice(qs, qe), _unflat(o.float(), B), l.float().reshape(h, B, qe - qs).transpose(0, 1))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale):
        from . import flash_varlen
        B, h, Lq, D = q.shape
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for qs, qe, ks, ke, left, right in self.pairs:
            cu_q, cu_k = (_rows(B, n, q.device) for n in (qe - qs, ke - ks))
            lse_hT = lse[:, :, qs:qe].float().transpose(0, 1).reshape(h, -1).contiguous()
            g_q, g_k, g_v = flash_varlen.KERNEL.backward(
                _flat(dout[:, :, qs:qe].to(q.dtype)), _flat(q[:, :, qs:qe]), _flat(k[:, :, ks:ke]),
                _flat(v[:, :, ks:ke]), _flat(out[:, :, qs:qe].to(q.dtype)), lse_hT, cu_q, cu_k, qe - qs,
                _max_k(ke - ks, left, right), scale, False, left, right)
            dq[:, :, qs:qe] += _unflat(g_q.float(), B)
            dk[:, :, ks:ke] += _unflat(g_k.float(), B)
            dv[:, :, ks:ke] += _unflat(g_v.float(), B)
        return dq, dk, dv


def _max_k(Lk, left, right):
    # the max_seqlen_k to hand flash: its entry points read a reach of at least max_seqlen_k as unbounded, which
    # changes the band where a pair has more queries than keys (a window longer than a zigzag chunk: measured on
    # the H200 at ring 4, window 1000, chunks of 512); an upper bound above both reaches keeps them as given
    return max(Lk, left + 1, right + 1)


def _flat(t):  # [B n L D] -> [B*L n D]: the varlen kernel's token-major layout, every batch row a segment
    B, n, L, D = t.shape
    return t.transpose(1, 2).reshape(B * L, n, D).contiguous()


def _unflat(t, B):  # [B*L n D] -> [B n L D]
    return t.reshape(B, -1, t.shape[1], t.shape[2]).transpose(1, 2)


def _rows(B, n, device):  # [B+1] int32 segment bounds: every batch row one segment of n rows
    return torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)


def _runs(pos) -> list:
    # [(start index, end index, first position)] of the runs of consecutive positions
    cuts = [0] + ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist() + [len(pos)]
    firsts = pos[torch.tensor(cuts[:-1], device=pos.device)].tolist()
    return [(a, b, p) for a, b, p in zip(cuts[:-1], cuts[1:], firsts)]


def _window_block(q, mask: BlockMask) -> Optional[_WindowBlock]:
    """The windowed block as varlen calls, one per (query run, key run) pair the window connects, or None (no
    window, documents too, or no varlen kernel here)."""
    if mask.window is None or mask.doc is not None or not mask.causal or not _varlen_usable(q):
        return None
    return _window_plan(mask)


def _window_plan(mask: BlockMask) -> _WindowBlock:
    w, pairs = mask.window, []
    for qa, qb, pq in _runs(mask.q_pos):
        for ka, kb, pk in _runs(mask.k_pos):
            # positions: queries at or after the run's first key, keys at or before the last query, queries whose
            # window reaches the last such key, keys some such query reaches
            q0 = max(pq, pk)
            k1 = min(pk + kb - ka, pq + qb - qa)
            q1 = min(pq + qb - qa, k1 - 1 + w)
            k0 = max(pk, q0 - w + 1)
            if q0 >= q1 or k0 >= k1:
                continue  # the window connects no query of this run to a key of that one
            right = q1 - k1
            pairs.append((qa + q0 - pq, qa + q1 - pq, ka + k0 - pk, ka + k1 - pk, w - 1 - right, right))
    return _WindowBlock(pairs)


def _varlen_usable(q) -> bool:
    from . import flash_varlen
    if not q.is_cuda:
        return VARLEN_ON_CPU
    D = q.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16) or D % 8 or D > 256:
        return False
    return flash_varlen.KERNEL is not flash_varlen._AtenFlash or _checked_varlen(q.device, q.dtype, D)


@functools.lru_cache(maxsize=None)
def _checked_varlen(device, dtype, D: int) -> bool:
    """Once per (device, dtype, head dim): the varlen block against the torch kernel on small blocks of packed
    documents (the diagonal and an all-visible block, documents without keys or queries there), forward and
    backward. Cannot run: logged, False (the per-part calls stay). Disagrees: an error."""
    with isolated():
        return _check_varlen(device, dtype, D)


def _check_varlen(device, dtype, D: int) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    S = 400
    ends = torch.tensor([150, 187, 260, 300, 400], device=device)  # documents of 150, 37, 73, 40, 100 tokens
    doc = torch.searchsorted(ends, torch.arange(S, device=device), right=True)[None]
    pos = torch.arange(S, device=device)
    share = torch.cat([pos[:100], pos[300:]])  # two runs, as a zigzag share's chunks
    masks = [BlockMask(True, pos, pos, doc), BlockMask(True, pos[280:], pos[:280], doc),  # documents: the diagonal,
             BlockMask(True, share, share, window=40),  # later queries seeing earlier keys whole; a window: the
             BlockMask(True, share, pos[100:300], window=40),  # diagonal of a share, a share against a later run,
             BlockMask(True, pos[300:], pos[280:300], window=40)]  # a window longer than the key run (_max_k)
    for mask in masks:
        q, dout = (torch.randn(1, 4, len(mask.q_pos), D, device=device, dtype=dtype, generator=g) for _ in range(2))
        k, v = (torch.randn(1, 2, len(mask.k_pos), D, device=device, dtype=dtype, generator=g) for _ in range(2))
        try:
            block = _varlen_plan(mask, 0) if mask.doc is not None else _window_plan(mask)
            out, lse = block.forward(q, k, v, D ** -0.5)
            ref_out, ref_lse = _torch_block_forward(q, _expand(k, 4), _expand(v, 4), D ** -0.5, mask)
            # the backward's lse is the ring's merged one, finite: check it with a row's own finite lse
            merged = torch.where(torch.isinf(ref_lse), torch.zeros_like(ref_lse), ref_lse)
            delta = (dout.float() * ref_out).sum(-1)
            grads = block.backward(dout, q, k, v, ref_out, merged, D ** -0.5)
        except (RuntimeError, TypeError) as err:
            log.warning("ring attention: the varlen block kernel cannot run on %s in %s (%s); packed documents "
                        "take one fused call per document part, windows the torch kernel", device, dtype,
                        str(err).splitlines()[0][:200])
            return False
        ref_grads = _torch_block_backward(q, k, v, dout, merged, delta, D ** -0.5, mask)
        seen = ~torch.isinf(ref_lse)
        pairs = [("out", out, ref_out), ("lse", lse.masked_fill(~seen, 0), ref_lse.masked_fill(~seen, 0))]
        for name, got, ref in pairs + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
            err = relative_error(name, got, ref)
            if not err < 2e-2:
                raise RuntimeError(f"ring attention: the varlen block kernel disagrees with the exact torch "
                                   f"block kernel on {device} in {dtype} ({name}: error {err:.2e}, window="
                                   f"{mask.window}); set parallelism.ring=1 or report this")
        if not torch.equal(torch.isinf(lse), ~seen):
            raise RuntimeError("ring attention: the varlen block kernel marks other rows empty than the torch "
                               "kernel does; set parallelism.ring=1 or report this")
    log.info("ring attention: varlen block kernel checked against the torch kernel on %s in %s", device, dtype)
    return True


def _fused_kernel(q):
    """The fused block kernel for q's device and dtype, or None (the masked torch kernel)."""
    if not q.is_cuda:
        return _CpuFlash if FUSED_ON_CPU else None
    D = q.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16) or D % 8 or D > 256:
        return None
    return next((kernel for kernel in CUDA_KERNELS if _checked(kernel, q.device, q.dtype, D)), None)


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
        for name, got, ref in [("out", out, ref_out), ("lse", lse, ref_lse)] + list(zip(("dq", "dk", "dv"), grads,
                                                                                          ref_grads)):
            err = relative_error(name, got, ref)  # bf16 inputs: the kernels differ by rounding only (~1e-3)
            if not err < 2e-2:
                raise RuntimeError(f"ring attention: the fused {kernel.__name__} kernel disagrees with the exact torch "
                                   f"block kernel on {device} in {dtype} ({name}: error {err:.2e}, causal="
                                   f"{causal}); set parallelism.ring=1 or report this")
    log.info("ring attention: fused %s block kernel checked against the torch kernel on %s in %s", kernel.__name__,
             device, dtype)
    return True
