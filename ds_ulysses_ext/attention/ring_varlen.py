"""The ring's varlen block calls (ring_blocks.py's other fused path): packed documents and sliding windows.

Legend: B batch, h query heads, hkv K|V heads, Lq / Lk query / key rows of a block, D head dim; Tq = B * Lq and
Tk = B * Lk rows of the flat (token-major) axes the varlen kernel takes, N segments.

    q [B h Lq D] x k|v [B hkv Lk D] -> out [B h Lq D] fp32, lse [B h Lq] fp32 (-inf: a row that sees no key)
    through  q [Tq h D], k|v [Tk hkv D], cu_q / cu_k [N+1] int32 -> out [Tq h D], lse [h Tq]

The kernel is torch's varlen flash kernel behind flash_varlen.KERNEL (a CPU stand-in of its contract in the tests);
each block kind here is checked once against ring_blocks' exact torch kernel at first use.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional

import torch

from . import flash_varlen
from .kernel_check import first_disagreement, fused_shape_ok, isolated
from .ring_blocks import PLANNERS, BlockMask, _expand, _fused_flag, _torch_block_backward, _torch_block_forward, merge

log = logging.getLogger(__name__)

# --- packed documents: one varlen call per block --------------------------------------------------------------
#
# With packed documents ring_blocks' per-part calls cost one kernel launch, a host-side slice and a copy per
# (batch row, document) of every block, every step, every layer: a 128k row of chat samples holds ~130 of them. A
# varlen kernel takes them all at once: segment n of the flat query axis (B * Lq rows) attends to segment n of the
# flat key axis, where the segments are the documents that the block's queries or keys touch, in order (zero rows
# on either side allowed). The block's visibility flag (the diagonal or all-visible: ring_blocks._fused_flag) holds
# within every document, since a document is an interval of positions. Rows whose document has no key in the
# block come back as (0, -inf) here whatever the kernel writes for them; keys whose document has no query get zero
# gradients.
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
        B, h, Lq, D = q.shape
        out, lse, _ = flash_varlen.KERNEL.forward(_flat(q), _flat(k), _flat(v), self.cu_q, self.cu_k,
                                                  self.max_q, self.max_k, scale, self.causal, -1,
                                                  0 if self.causal else -1)
        out = out.float().masked_fill(self.empty_q[:, None, None], 0.0)
        lse = lse.float().masked_fill(self.empty_q[None], float("-inf"))  # [h B*Lq]
        return (out.reshape(B, Lq, h, D).transpose(1, 2), lse.reshape(h, B, Lq).transpose(0, 1))

    def backward(self, dout, q, k, v, out, lse, scale):
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


def varlen_block(q, mask: BlockMask) -> Optional[_VarlenBlock]:
    """The varlen call of a block with packed documents, or None (no documents, a window, a visibility no flag says,
    at most VARLEN_PARTS document parts per batch row, or no varlen kernel here)."""
    if mask.doc is None or mask.window is not None or not _varlen_usable(q):
        return None
    parts_above = VARLEN_PARTS * mask.doc.shape[0]
    return mask.planned(("varlen", parts_above), lambda: _varlen_plan(mask, parts_above))


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


def window_block(q, mask: BlockMask) -> Optional[_WindowBlock]:
    """The windowed block as varlen calls, one per (query run, key run) pair the window connects, or None (no
    window, documents too, or no varlen kernel here)."""
    if mask.window is None or mask.doc is not None or not mask.causal or not _varlen_usable(q):
        return None
    return mask.planned("window", lambda: _window_plan(mask))


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
    if not q.is_cuda:
        return VARLEN_ON_CPU
    if not fused_shape_ok(q):
        return False
    return flash_varlen.KERNEL is not flash_varlen._AtenFlash or _checked_varlen(q.device, q.dtype, q.shape[-1])


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
        bad = first_disagreement(pairs + list(zip(("dq", "dk", "dv"), grads, ref_grads)))
        if bad:
            raise RuntimeError(f"ring attention: the varlen block kernel disagrees with the exact torch block kernel "
                               f"on {device} in {dtype} ({bad[0]}: error {bad[1]:.2e}, window={mask.window}); set "
                               "parallelism.ring=1 or report this")
        if not torch.equal(torch.isinf(lse), ~seen):
            raise RuntimeError("ring attention: the varlen block kernel marks other rows empty than the torch "
                               "kernel does; set parallelism.ring=1 or report this")
    log.info("ring attention: varlen block kernel checked against the torch kernel on %s in %s", device, dtype)
    return True


# checked in this order: a many-document block takes the varlen call before its window is looked at
PLANNERS.extend((varlen_block, window_block))
