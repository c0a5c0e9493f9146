"""The host link of the offloads (memory/offload.py HostLink) on a CUDA GPU (skipped elsewhere; run on the device with
`bash scripts/bench/bench_gpu.sh gpu_tests`). The CPU tests run the same hooks with clones; what only a GPU has is the
side stream, so these tests are about its ordering and about the memory it holds reserved:

- a reloaded tensor dropped before backward read it (a graph freed early) is settled before its block is reused:
  the late copy must not land in the block's next owner;
- with both offloads on (except_attention's attention tensors and the layer inputs), the allocator reserves above the
  allocated peak no more than the in-flight bound and a layer's reloads: no reload waits on the side stream's queue.
"""
import torch

import test_gpu_paths
from test_gpu_paths import _rel

pytestmark = test_gpu_paths.pytestmark  # the same SM90 skip

NUMEL = 3 << 20  # a size of its own (12 MiB of fp32), so the block freed is the block handed out next


def _late_reload(link):
    """[reloaded tensor, its event, the host tensor]: a reload of ones whose copy runs ~50 ms after the compute
    stream could already reuse the block. A list, so that the caller can hand over its only reference."""
    from ds_ulysses_ext.memory.offload import HostLink
    assert isinstance(link, HostLink)
    host, copied = link.to_host(torch.ones(NUMEL, device="cuda"))
    torch.cuda.synchronize()
    side = link.side_stream(torch.device("cuda"))
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # queued before the copy: the copy lands late
    out, ready = link.to_device(host, torch.device("cuda"), copied)
    return [out, ready, host]


def _reused_block_stays_zero(drop) -> None:
    from ds_ulysses_ext.memory.offload import HostLink
    reload = _late_reload(HostLink())
    address = reload[0].data_ptr()
    drop(reload.pop(0), reload[0])  # `drop` holds the only reference to the reloaded tensor, and frees it
    again = torch.zeros(NUMEL, device="cuda")  # on the compute stream, in the block just freed
    assert again.data_ptr() == address, "the allocator handed out another block: the test proves nothing"
    torch.cuda.synchronize()
    assert again.count_nonzero().item() == 0, "the late reload wrote into the block's next owner"


def test_a_prefetched_layer_input_dropped_unread_is_settled():
    from ds_ulysses_ext.memory.offload import _Packed

    def drop(out, ready):
        packed = _Packed(torch.empty(0), torch.device("cuda"), None, 0)
        packed.prefetched, packed.ready = out, ready
        del out, packed  # the graph freed before backward reached it: _Packed.__del__ settles it

    _reused_block_stays_zero(drop)


def test_a_reloaded_attention_span_dropped_unread_is_settled():
    from ds_ulysses_ext.memory.attention_offload import _Span

    def drop(out, ready):
        span = _Span(torch.empty(1, device="cuda"))
        span.loaded, span.ready = out, ready
        del out, span  # _Span.__del__ settles it

    _reused_block_stays_zero(drop)


def test_both_offloads_reserve_at_most_the_bound_above_the_allocated_peak():
    """Six layers at 32k tokens in bf16 with memory=except_attention_offload plus memory.offload_activations=true, the
    in-flight bound at 0.25 GiB: the same loss and gradients as without offload, and the peak reserved memory above
    the peak allocated by at most the bound plus one layer's offloaded bytes and 64 MiB of allocator rounding.
    On an H200: 200 MiB above (a layer's bytes: 279 MiB); with record_stream on the reloads again, each freed reload
    waiting for the side stream's queue, 804 MiB, over the 599 MiB allowed."""
    from configs.memory import MemoryConfig
    from ds_ulysses_ext.memory import apply_memory_policies, remove_all
    layers, bound_gib = 6, 0.25
    hf, lm, local = test_gpu_paths.offload_test_model(layers)

    def step(cfg):
        policies = apply_memory_policies(hf, cfg)
        lm.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        loss_sum, count = lm(**local)
        (loss_sum / count).backward()
        torch.cuda.synchronize()
        peaks = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        offloads = [policies[0].offload, policies[-1]] if cfg.offload_activations else []
        moved = sum(p.stats["offloaded_bytes"] for p in offloads)  # both offloads' bytes, layer inputs included
        remove_all(policies)
        return (loss_sum / count).detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}, peaks, moved

    torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # as every preset runs (memory/allocator.py)
    try:
        plain = MemoryConfig(recompute="except_attention")
        both = MemoryConfig(recompute="except_attention", attention_offload=True, offload_activations=True,
                            offload_inflight_gib=bound_gib)
        step(both)  # warm-up: kernels' workspaces and the pinned host pool are not the policy's
        loss_off, grads_off, _, _ = step(plain)
        loss_on, grads_on, (reserved, allocated), moved = step(both)
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    assert _rel(loss_on, loss_off) < 1e-3
    for n, g in grads_on.items():
        assert _rel(g, grads_off[n]) < test_gpu_paths.TOL, (n, _rel(g, grads_off[n]))
    per_layer = moved / layers
    assert moved > 0
    limit = bound_gib * 2**30 + per_layer + (64 << 20)
    print(f"reserved above allocated {(reserved - allocated) / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB, "
          f"a layer's offloaded bytes {per_layer / 2**20:.0f} MiB")
    assert reserved - allocated <= limit, ((reserved - allocated) / 2**20, limit / 2**20, per_layer / 2**20)
