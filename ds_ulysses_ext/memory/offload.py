"""Activation offload: tensors saved for backward during the decoder forward live in host memory.

The decoder's forward runs inside `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`. Which
tensors that covers depends on the other policies, because a checkpointed region's own hooks are
innermost and hide its internals: under full recompute it is the layer inputs (what a checkpoint keeps),
under TiledMLP the tile inputs, and with no recompute every saved activation. Only tensors of at least
`min_bytes` move; the rest stay where they are. With `max_host_bytes`, a forward stops offloading once
that many bytes are on the host: the tensors saved after that (the deepest layers, which backward needs
first) stay on the device. That is how a rank whose host memory cannot take every layer input still
offloads as many of them as the host can hold.

On CUDA, pack copies into pinned host memory on a side stream (after the producing work, via
wait_stream) and records an event; `record_stream` keeps the device block from being reused before the
copy has read it. Unpack waits on that event and copies back; a copy back is read only after the compute
stream waited on its event, so its block needs no `record_stream` (HostLink.to_device says why). Tensors are
unpacked in backward in roughly reverse order of packing, so each unpack also starts the host-to-device copy of the next
`prefetch` earlier-packed tensors on the side stream, to overlap with the backward compute.
On CPU a tensor is "offloaded" by a real `.clone()`, so the same code path runs in CPU tests.
The copies go through `HostLink`, which except_attention's attention offload (attention_offload.py) shares.

ZeRO-3: parameters are never moved. A saved tensor that is an `nn.Parameter`, carries DeepSpeed's
`ds_id`/`ds_numel`, or is a view of such a tensor (a linear's transposed weight) is kept as is; moving
it would copy a gathered weight to the host and back on every step. CP needs nothing special: what is
offloaded is this rank's local activations.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Optional

import torch

from .policy import MemoryPolicy, decoder_of


def _is_parameter(t: torch.Tensor) -> bool:
    for x in (t, t._base):
        if x is not None and (isinstance(x, torch.nn.Parameter) or hasattr(x, "ds_id") or hasattr(x, "ds_numel")):
            return True
    return False


DEFAULT_INFLIGHT_BYTES = 512 << 20  # memory.offload_inflight_gib's default


class HostLink:
    """Copies between one device and pinned host memory on a side stream, with a bound on what is in flight.

    Shared by OffloadActivations (saved tensors of the decoder forward) and except_attention's attention offload
    (memory/attention_offload.py). On CUDA, `to_host` copies on the side stream after the work that produced the
    tensor (wait_stream), records an event, and `record_stream` keeps the device block from being reused before
    the copy has read it; `to_device` allocates on the compute stream (so the block returns to its pool) and
    copies on the side stream after the host copy is complete. Any other device: real clones, so CPU tests run
    the same calls. One link serves every offload of a model (memory/build.py), so the bound on copies in flight
    is one bound for all of them, and they share one side stream, as they share one host link.
    """

    def __init__(self, max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        self.max_inflight_bytes = max_inflight_bytes
        self._stream = None
        self._inflight: deque = deque()  # (event, bytes) of device-to-host copies not known to be done
        self._inflight_bytes = 0

    def side_stream(self, device: torch.device):
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def reserve(self, nbytes: int) -> None:
        """Bound the device memory waiting on device-to-host copies; call before `to_host` (CUDA only).

        A packed tensor's block is only reusable once its copy has run (record_stream). If compute
        outruns the host link, the blocks of every "offloaded" tensor pile up as reserved memory.
        On an H200, offloading every activation of a step without this bound reserved more memory than no
        offload at all (docs/memory.md has the measurement with the bound). So once
        more than max_inflight_bytes are queued, the host waits for the oldest copies: offload then
        runs at the speed of the link, as it must. A reservation larger than the bound waits for every
        earlier copy, then proceeds.
        """
        while self._inflight and (self._inflight[0][0].query()
                                  or self._inflight_bytes + nbytes > self.max_inflight_bytes):
            event, done = self._inflight.popleft()
            event.synchronize()
            self._inflight_bytes -= done
        self._inflight_bytes += nbytes

    def to_host(self, t: torch.Tensor):
        """(host copy, event when it is complete, None off CUDA). On CUDA, `reserve` its bytes first."""
        if t.device.type != "cuda":
            return t.detach().clone(), None  # a real copy so the CPU path is the same path
        nbytes = t.numel() * t.element_size()
        host = torch.empty_like(t, device="cpu", pin_memory=True)  # keeps t's strides when t is dense
        if host.stride() != t.stride():
            # a view with gaps: copy_ would stage it through a device temporary allocated on the side
            # stream, whose pool compute-stream allocations cannot reuse; stage it here instead
            t = t.contiguous()
        stream = self.side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written before it is read
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        t.record_stream(stream)  # the allocator must not hand t's block out before the copy has read it
        self._inflight.append((copied, nbytes))
        return host, copied

    def to_device(self, host: torch.Tensor, device: torch.device, copied):
        """(device copy started on the side stream, event when it is complete; None off CUDA).

        Wait on the event (current stream) before reading the copy."""
        if device.type != "cuda":
            return host.clone().to(device), None
        # allocated on the compute stream, so the block comes from (and returns to) its pool; a block
        # allocated on the side stream could only be reused by side-stream allocations
        out = torch.empty_like(host, device=device)
        stream = self.side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the block is free to overwrite
        stream.wait_event(copied)
        with torch.cuda.stream(stream):
            out.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        # No record_stream here. With it, a block freed on the compute stream waits for everything the side
        # stream has queued by then, and prefetches queue ahead of the GPU by as far as the host runs ahead of
        # it in backward: on an H200 that held up to several layers' reloaded tensors as reserved but unusable
        # memory. The block was allocated on the compute stream and every reader there waits on `ready` first
        # (the callers' unpack), so any later compute-stream reuse is ordered after the write. A copy dropped
        # unread must do the same first: `settle`.
        return out, ready

    @staticmethod
    def settle(out: Optional[torch.Tensor], ready) -> None:
        """Order the compute stream after `to_device`'s copy of `out`, which is dropped without being read."""
        if out is not None and ready is not None:
            torch.cuda.current_stream(out.device).wait_event(ready)


class _Packed:
    """A saved tensor's host copy, plus what backward needs to bring it back."""
    __slots__ = ("host", "device", "copied", "prefetched", "ready", "index", "used", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, index: int) -> None:
        self.host = host          # host copy (pinned on CUDA)
        self.device = device      # where it came from and goes back to
        self.copied = copied      # CUDA event: device-to-host copy done (None on CPU)
        self.prefetched: Optional[torch.Tensor] = None  # device copy made ahead of its unpack
        self.ready = None         # CUDA event: prefetch copy done
        self.index = index        # position in pack order
        self.used = False         # unpacked at least once: no point prefetching it again

    def __del__(self) -> None:
        if getattr(self, "prefetched", None) is not None:  # a graph freed before its backward reached this tensor
            HostLink.settle(self.prefetched, self.ready)


class OffloadActivations(MemoryPolicy):
    """Saved activations of the decoder forward go to (pinned) host memory and come back in backward."""

    name = "offload"

    def __init__(self, min_bytes: int = 1 << 20, prefetch: int = 2, max_host_bytes: int = 0,
                 link: Optional[HostLink] = None) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.max_host_bytes = max_host_bytes  # per forward; 0 = no cap
        self.prefetch = prefetch
        self._link = link or HostLink()
        self._packed: list[weakref.ref] = []  # this forward's packed tensors, in pack order
        self.stats = {"offloaded": 0, "offloaded_bytes": 0, "kept_params": 0, "kept_small": 0, "kept_over_cap": 0}
        self._host_full = False  # this forward reached max_host_bytes: nothing more is offloaded

    def _apply(self, model: torch.nn.Module) -> None:
        self._wrap_forward(decoder_of(model), self._with_hooks)

    def _with_hooks(self, forward):
        def wrapper(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            self._packed = []  # weak references: a freed graph frees its host copies
            self.stats = dict.fromkeys(self.stats, 0)
            self._host_full = False
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return forward(*args, **kwargs)
        return wrapper

    # -- pack (forward) --------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if _is_parameter(t):
            self.stats["kept_params"] += 1
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.layout != torch.strided:
            self.stats["kept_small"] += 1
            return t
        # once full, stay full: what stays on the device is the end of the forward, which backward reads first
        self._host_full = self._host_full or (
            self.max_host_bytes > 0 and self.stats["offloaded_bytes"] + nbytes > self.max_host_bytes)
        if self._host_full:
            self.stats["kept_over_cap"] += 1
            return t
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += nbytes
        if t.device.type == "cuda":
            self._link.reserve(nbytes)
        host, copied = self._link.to_host(t)
        packed = _Packed(host, t.device, copied, len(self._packed))
        self._packed.append(weakref.ref(packed))
        return packed

    # -- unpack (backward) -----------------------------------------------------------------------
    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.copied is None:
            return packed.host
        packed.used = True
        current = torch.cuda.current_stream(packed.device)
        if packed.prefetched is not None:
            out, packed.prefetched = packed.prefetched, None
            current.wait_event(packed.ready)
        else:
            current.wait_event(packed.copied)
            out = packed.host.to(packed.device, non_blocking=True)
        self._prefetch_before(packed.index)
        return out

    def _prefetch_before(self, index: int) -> None:
        for i in range(index - 1, max(index - 1 - self.prefetch, -1), -1):
            packed = self._packed[i]() if i < len(self._packed) else None
            if packed is None or packed.copied is None or packed.used or packed.prefetched is not None:
                continue  # a host tensor, already used by backward, or already on its way
            packed.prefetched, packed.ready = self._link.to_device(packed.host, packed.device, packed.copied)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(min_bytes={self.min_bytes}, prefetch={self.prefetch}, "
                f"max_inflight_bytes={self._link.max_inflight_bytes}, max_host_bytes={self.max_host_bytes})")
