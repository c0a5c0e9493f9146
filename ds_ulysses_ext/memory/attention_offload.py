"""except_attention's kept attention tensors in pinned host memory (memory.attention_offload=true).

memory.recompute=except_attention keeps what the core attention saves for its backward (q, k, v, out, logsumexp)
and the recorded output it replays in the recompute (its own tensor at cp > 1, a view of `out` at cp = 1) on the
GPU, for every layer. With this option each core-attention call gets an `AttentionStash`:

- forward: the kernel runs under the stash's saved-tensor hooks (innermost, so no checkpoint sees them); `pack`
  returns a small handle per saved tensor, and the recorded output is packed the same way. As soon as the call
  returns, `offload` copies the bytes those tensors cover, one span per device storage (k and v sharing one
  exchange buffer, or the recorded output a view of `out`, travel once), to pinned host memory on the side
  stream (offload.py's HostLink: after the producing work, an event per copy, record_stream), and drops its
  references: the device blocks are free once the copies have read them, while the rest of the layer (o_proj,
  the MLP) and the next layers run.
- backward: the layer's recompute is the first thing its backward does, and it calls `begin_backward`: this
  stash's spans are copied back on the side stream (unless the layer above already started that) and the
  previous (earlier) layer's stash is prefetched, so its copy runs behind this layer's backward. Each unpack
  waits on its span's event and rebuilds the saved tensor with its original dtype, offset, size and strides
  over the reloaded bytes. Once every handle of the stash was unpacked, the stash drops its device copies
  (autograd holds what it still needs); an unpack after that (a second backward through a retained graph)
  loads again.

Exact by construction: bytes are moved, never recomputed. On CPU the host and device copies are clones, so tests
run the same hooks, order and prefetches. Parameters (GPT-OSS's sinks) are never moved.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .offload import HostLink, _is_parameter

_ALIGN = 16  # a span starts on a 16-byte boundary of its storage, so rebuilt views keep their alignment


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) in bytes of the storage that the strided tensor t reads."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


class _Span:
    """The bytes of one device storage that a stash's saved tensors read, and their host / reloaded copies."""
    __slots__ = ("source", "device", "lo", "hi", "host", "copied", "loaded", "ready")

    def __init__(self, t: torch.Tensor) -> None:
        # a uint8 view of the whole storage: keeps it (and its address, the dedupe key) alive until the copy
        self.source: Optional[torch.Tensor] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage())
        self.device = t.device
        self.lo, self.hi = _extent(t)
        self.host: Optional[torch.Tensor] = None
        self.copied = None   # CUDA event: the host copy is complete
        self.loaded: Optional[torch.Tensor] = None  # device copy of [lo, hi) in backward
        self.ready = None    # CUDA event: the device copy is complete

    def __del__(self) -> None:
        # reloaded, but the graph was freed before every handle was unpacked
        if getattr(self, "loaded", None) is not None:
            HostLink.settle(self.loaded, self.ready)

    def cover(self, t: torch.Tensor) -> None:
        start, end = _extent(t)
        self.lo, self.hi = min(self.lo, start), max(self.hi, end)


class _Saved:
    """What the pack hook returns for one saved tensor: its span and how to rebuild it over the span's bytes."""
    __slots__ = ("stash", "span", "dtype", "start", "size", "stride")

    def __init__(self, stash: "AttentionStash", span: _Span, t: torch.Tensor) -> None:
        self.stash, self.span, self.dtype = stash, span, t.dtype
        self.start = t.storage_offset() * t.element_size()  # bytes into the storage
        self.size, self.stride = tuple(t.shape), tuple(t.stride())


class AttentionStash:
    """The saved tensors of one core-attention call: packed in forward, on the host between, reloaded in backward."""

    def __init__(self, offload: "AttentionOffload") -> None:
        self.offload_policy = offload
        self._by_storage: dict[int, _Span] = {}  # while packing: storage address -> span
        self.spans: list[_Span] = []
        self.handles = 0     # _Saved handles given out
        self.unpacked = 0    # of them unpacked since the last load
        self.on_host = False
        self.loading = False  # the spans' device copies exist (started or done)
        self.begun = False   # backward reached this stash (it never needs prefetching again)

    # -- forward ----------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if self.on_host:
            raise RuntimeError("attention offload: a tensor was saved into a stash that is already on the host")
        if _is_parameter(t) or t.layout != torch.strided:
            return t
        key = t.untyped_storage().data_ptr()
        span = self._by_storage.get(key)
        if span is None or span.device != t.device:
            span = self._by_storage[key] = _Span(t)
            self.spans.append(span)
        else:
            span.cover(t)
        self.handles += 1
        return _Saved(self, span, t)

    def unpack(self, saved):
        return saved if isinstance(saved, torch.Tensor) else self.get(saved)

    def offload(self) -> None:
        """Start every span's copy to the host; from here on the device copies are the autograd graph's no more."""
        link, stats = self.offload_policy.link, self.offload_policy.stats
        total = 0
        for span in self.spans:
            span.lo -= span.lo % _ALIGN
            total += span.hi - span.lo
        if any(span.device.type == "cuda" for span in self.spans):
            link.reserve(total)  # at most max_inflight_bytes, or this one stash, waiting on copies
        for span in self.spans:
            span.host, span.copied = link.to_host(span.source[span.lo:span.hi])
            span.source = None
        self._by_storage.clear()
        self.on_host = True
        stats["offloaded"] += 1
        stats["offloaded_bytes"] += total

    # -- backward ---------------------------------------------------------------------------------
    def load(self, prefetch: bool) -> None:
        link, stats = self.offload_policy.link, self.offload_policy.stats
        for span in self.spans:
            span.loaded, span.ready = link.to_device(span.host, span.device, span.copied)
        self.loading = True
        stats["reloaded"] += 1
        stats["prefetched" if prefetch else "loaded_on_demand"] += 1

    def begin_backward(self) -> None:
        """This layer's backward starts: bring this stash back (if the layer above did not) and prefetch the one below."""
        if not self.on_host or self.begun:
            return
        self.begun = True
        if not self.loading:
            self.load(prefetch=False)
        self.offload_policy.prefetch_before(self)

    def get(self, saved: _Saved) -> torch.Tensor:
        if not self.loading:
            if not self.begun:
                self.begin_backward()
            else:
                self.load(prefetch=False)  # a second backward through a retained graph
        span = saved.span
        if span.ready is not None:
            torch.cuda.current_stream(span.device).wait_event(span.ready)
        itemsize = torch.empty(0, dtype=saved.dtype).element_size()
        with torch.no_grad():
            out = torch.empty(0, dtype=saved.dtype, device=span.device).set_(
                span.loaded.untyped_storage(), (saved.start - span.lo) // itemsize, saved.size, saved.stride)
        self.unpacked += 1
        if self.unpacked >= self.handles:  # every handle rebuilt: autograd holds what it still needs
            self.release()
        return out

    def release(self) -> None:
        for span in self.spans:
            span.loaded = span.ready = None
        self.loading = False
        self.unpacked = 0
        self.offload_policy.stats["released"] += 1


class AttentionOffload:
    """The stashes of the running forwards (in call order, weakly), the host link and the counters."""

    def __init__(self, link: Optional[HostLink] = None) -> None:
        self.link = link or HostLink()
        self._order: list[weakref.ref] = []
        self.stats = dict.fromkeys(
            ("offloaded", "offloaded_bytes", "reloaded", "prefetched", "loaded_on_demand", "released"), 0)

    def new_stash(self) -> AttentionStash:
        stash = AttentionStash(self)
        self._order = [ref for ref in self._order if ref() is not None]  # freed graphs' stashes are gone
        self._order.append(weakref.ref(stash))
        return stash

    def prefetch_before(self, stash: AttentionStash) -> None:
        """Start loading the nearest earlier stash that backward has not reached yet (one layer ahead)."""
        stashes = [ref() for ref in self._order]
        for i in range(len(stashes) - 1, -1, -1):
            if stashes[i] is stash:
                for earlier in reversed(stashes[:i]):
                    if earlier is not None and earlier.on_host and not earlier.begun:
                        if not earlier.loading:
                            earlier.load(prefetch=True)
                        return
                return

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)
