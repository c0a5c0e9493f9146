"""The GPU-only fast paths against their exact references, in bf16 on a CUDA SM90 GPU (skipped elsewhere; run on
the device with `bash scripts/bench/bench_gpu.sh gpu_tests`). Tolerance: 2e-2 relative (bf16 inputs; the kernels agree
to ~1e-3 in practice). Each test also checks that the fast path really ran.

- ring: each fused block kernel (cuDNN's and torch's flash attention, with their log-sum-exp) inside a whole
  simulated ring of 2 and 4 ranks on one GPU (scripts/bench/ring_sim.py), against fp64 full attention;
- packing: long documents' own calls and the short ones' padded, batched causal calls (masks.py);
- sinks: the SDPA sink path (masks.py) against the dense definition;
- flash-attn's and FA4's documents / window / sinks arguments (backends.py), where installed.
- memory.attention_offload: except_attention's attention tensors through pinned host memory, against it off, and a
  lower peak.
"""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                                reason="the fused GPU paths need a CUDA SM90 GPU")
TOL = 2e-2


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _count_fused_calls(blocks_mod, D, monkeypatch, name="_CudaCudnn") -> list:
    """The ring runs only the fused kernel `name` (ring_blocks.CUDA_KERNELS narrowed to it), whose once-per-process
    check against the torch kernel must pass; returns a list that grows by one per fused forward call."""
    kernel = getattr(blocks_mod, name)
    assert blocks_mod._checked(kernel, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, D), \
        f"the fused {name} kernel was left out: see the log line that says why"
    calls = []
    real = kernel.forward
    monkeypatch.setattr(kernel, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
    monkeypatch.setattr(blocks_mod, "CUDA_KERNELS", (kernel,))
    return calls


def test_the_ring_prefers_cudnn_blocks_on_hopper():
    # cuDNN's kernel is the one that meets the ring's overhead target (docs/benchmarks.md): it must be the pick
    import ds_ulysses_ext.attention.ring_blocks as blocks_mod
    q = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert blocks_mod._fused_kernel(q) is blocks_mod._CudaCudnn


def _count_varlen_calls(flash_varlen, monkeypatch) -> list:
    """A list that grows by one per call of torch's varlen flash kernel (flash_varlen.varlen_attention)."""
    calls = []
    real = flash_varlen.varlen_attention
    monkeypatch.setattr(flash_varlen, "varlen_attention", lambda *a, **k_: calls.append(1) or real(*a, **k_))
    return calls


def _ring_inputs(S, D, seed):
    """q, k, v, dout in ring.py's [B h S D] layout: 8 query heads over 2 KV heads, bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("kernel", ["_CudaCudnn", "_CudaFlash"])
@pytest.mark.parametrize("R", [2, 4])
def test_fused_ring_blocks_reassemble_exact_attention(R, kernel, monkeypatch):
    import ds_ulysses_ext.attention.ring_blocks as blocks_mod
    from ring_sim import check_ring
    S, D = 4096, 64
    calls = _count_fused_calls(blocks_mod, D, monkeypatch, kernel)
    q, k, v, dout = _ring_inputs(S, D, seed=0)
    rels = check_ring(q, k, v, dout, R, None, rtol=TOL)
    assert len(calls) == R * R, (calls, rels)  # every rank's every step ran fused


def _docs_reference(q, k, v, lengths):
    out = torch.zeros_like(q, dtype=torch.float64)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        qd, kd, vd = (t[0, sl].transpose(0, 1).double() for t in (q, k, v))
        kd, vd = (t.repeat_interleave(q.shape[2] // k.shape[2], 0) for t in (kd, vd))
        logits = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out[0, sl] = (logits.softmax(-1) @ vd).transpose(0, 1)
        start += n
    return out


def test_packed_documents_through_the_fused_calls():
    from ds_ulysses_ext.attention import masks
    lengths = [3000, 600, 37, 1500, 129, 900, 2100, 20]  # long ones alone, short ones padded to 128s and batched
    S = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, S, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    out = masks.masked_attention(q, k, v, causal=True, cu_seqlens=masks.cu_seqlens_of(pos))
    assert _rel(out, _docs_reference(q, k, v, lengths)) < TOL


def test_sinks_through_sdpa_match_the_definition():
    from ds_ulysses_ext.attention import masks
    g = torch.Generator(device="cuda").manual_seed(2)
    S, h, hkv, D, window = 3000, 8, 2, 64, 128
    q = torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, S, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16)
    out = masks.masked_attention(q, k, v, causal=True, window=window, sinks=sinks)
    qd, kd, vd = (t[0].transpose(0, 1).double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(h // hkv, 0), vd.repeat_interleave(h // hkv, 0)
    logits = (qd @ kd.transpose(-1, -2)) * D ** -0.5
    i = torch.arange(S, device="cuda")
    hidden = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= window)
    logits = logits.masked_fill(hidden, float("-inf"))
    full = torch.cat([logits, sinks.double()[:, None, None].expand(h, S, 1)], dim=-1).softmax(-1)[..., :-1]
    ref = (full @ vd).transpose(0, 1)[None]
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("kernel", ["_CudaCudnn", "_CudaFlash", "varlen"])
def test_fused_ring_with_packed_documents_reassembles_exact_attention(kernel, monkeypatch):
    # the whole simulated ring of 2 ranks with packed documents: one fused call per document part of each block
    import ds_ulysses_ext.attention.ring as ring_mod
    import ds_ulysses_ext.attention.ring_blocks as blocks_mod
    from ring_sim import OneGpuRing, kv_shares
    from ds_ulysses_ext.attention.masks import cu_seqlens_of, document_ids, masked_attention
    R, S, D = 2, 4096, 64
    lengths = [1000, 37, 1500, 600, 959]  # documents that cross the zigzag chunks
    import ds_ulysses_ext.attention.ring_varlen as varlen_mod
    if kernel == "varlen":  # every block one varlen call (ring_varlen._VarlenBlock), whatever its part count
        from ds_ulysses_ext.attention import flash_varlen
        assert varlen_mod._checked_varlen(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, D), \
            "the varlen block kernel was left out: see the log line that says why"
        monkeypatch.setattr(varlen_mod, "VARLEN_PARTS", 0)
        calls, real = [], flash_varlen._AtenFlash.forward
        monkeypatch.setattr(flash_varlen._AtenFlash, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
    else:
        calls = _count_fused_calls(blocks_mod, D, monkeypatch, kernel)
    q, k, v, dout = _ring_inputs(S, D, seed=3)
    cu = cu_seqlens_of(torch.cat([torch.arange(n) for n in lengths])[None].cuda())
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = masked_attention(*(t.transpose(1, 2) for t in (qf, kf, vf)), causal=True, cu_seqlens=cu).transpose(1, 2)
    ref.backward(dout.double())
    all_pos = torch.arange(S, device="cuda")
    doc = document_ids(cu, 1, S)
    shares = kv_shares(k, v, R)
    out, dq = torch.zeros_like(ref), torch.zeros_like(qf)
    dkv = torch.zeros(kf.shape[:3] + (2 * D,), dtype=torch.float64, device="cuda")
    for r in range(R):
        idx = ring_mod.share_positions(all_pos, R, r)
        mask = blocks_mod.BlockMask(True, idx, all_pos, doc, None)
        qr, kr, vr, dr = (t[:, :, idx].contiguous() for t in (q, k, v, dout))
        o, lse = ring_mod._ring_forward(qr, kr, vr, D ** -0.5, mask, OneGpuRing(r, R, shares, False))
        bwd = OneGpuRing(r, R, shares, True, keep=True)
        g_q, _, _ = ring_mod._ring_backward(qr, kr, vr, o.to(q.dtype), lse, dr, None, D ** -0.5, mask, bwd)
        out[:, :, idx], dq[:, :, idx] = o.double(), g_q.double()
        for src, acc in bwd.sent:
            dkv[:, :, ring_mod.share_positions(all_pos, R, src)] += acc.double()
    for name, got, want in (("out", out, ref.detach()), ("dq", dq, qf.grad), ("dk", dkv[..., :D], kf.grad),
                            ("dv", dkv[..., D:], vf.grad)):
        assert _rel(got, want) < TOL, (name, _rel(got, want))
    # the fused path took the blocks: in more than one part where documents meet, or one varlen call per block
    assert len(calls) == R * R if kernel == "varlen" else len(calls) > R * R


@pytest.mark.parametrize("feature", ["documents", "window", "sinks", "documents+window"])
@pytest.mark.parametrize("backend", ["fa4", "flash_attn"])
def test_optional_kernels_take_documents_windows_and_sinks(backend, feature):
    """flash-attn's and FA4's varlen / window / sink arguments as backends.py passes them, forward and backward,
    against masks.py's exact torch path in fp64. Skipped where the optional kernel is not installed."""
    from ds_ulysses_ext.attention import backends, masks
    if backends._optional_func(backend) is None:
        pytest.skip(f"{backend} is not installed here (an optional GPU extra)")
    if not set(feature.split("+")) <= backends._FEATURES[backend]:
        pytest.skip(f"{backend} has no {feature} support: backends.py refuses it by name (tests/test_refusals.py)")
    lengths = [1500, 37, 600, 2000, 959]
    S, h, hkv, D = sum(lengths), 8, 2, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v, dout = (torch.randn(1, S, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (hkv, hkv, h))
    kw = {}
    if "documents" in feature:
        kw["cu_seqlens"] = masks.cu_seqlens_of(torch.cat([torch.arange(n) for n in lengths])[None].cuda())
    if "window" in feature or feature == "sinks":
        kw["window"] = 128
    if feature == "sinks":
        kw["sinks"] = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16)
    grads = []
    for dtype, run in ((torch.bfloat16, None), (torch.float64, masks.masked_attention)):
        qi, ki, vi = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        extra = {n: (t.to(dtype) if n == "sinks" else t) for n, t in kw.items()}
        if run is None:
            if "cu_seqlens" in extra:
                extra["max_seqlen"] = max(lengths)
            out = backends.local_attention(backend, qi, ki, vi, causal=True, **extra)
        else:
            out = run(qi, ki, vi, causal=True, **extra)
        out.backward(dout.to(dtype))
        grads.append([out.detach(), qi.grad, ki.grad, vi.grad])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *grads):
        assert _rel(got, want) < TOL, (backend, feature, name, _rel(got, want))


@pytest.mark.parametrize("feature", ["documents", "window", "sinks", "documents+window+sinks"])
def test_torch_varlen_flash_takes_documents_windows_and_sinks(feature, monkeypatch):
    """The `sdpa` backend's one-call road (flash_varlen.py: torch's varlen flash kernel, the sinks on its
    log-sum-exp), forward and backward, against masks.py's exact torch path in fp64; and it really ran."""
    from ds_ulysses_ext.attention import backends, flash_varlen, masks
    lengths = [1500, 37, 600, 2000, 959]
    S, h, hkv, D = sum(lengths), 8, 2, 64
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert flash_varlen.usable(q), "the varlen flash kernel was left out: see the log line that says why"
    k, v, dout = (torch.randn(1, S, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (hkv, hkv, h))
    sinks = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16) * 2
    kw = {}
    if "documents" in feature:
        kw["cu_seqlens"] = masks.cu_seqlens_of(torch.cat([torch.arange(n) for n in lengths])[None].cuda())
    if "window" in feature or feature == "sinks":
        kw["window"] = 128
    calls = _count_varlen_calls(flash_varlen, monkeypatch)
    grads = []
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        extra = dict(kw, sinks=leaves[3] if "sinks" in feature else None)
        if dtype == torch.bfloat16:
            out = backends.local_attention("sdpa", *leaves[:3], causal=True, **extra)
        else:
            out = masks.masked_attention(*leaves[:3], causal=True, **extra)
        out.backward(dout.to(dtype))
        grads.append([out.detach()] + [t.grad for t in leaves[:3]] + ([leaves[3].grad] if "sinks" in feature else []))
    assert calls == [1]
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), *grads):
        assert _rel(got, want) < TOL, (feature, name, _rel(got, want))


@pytest.mark.parametrize("kernel", ["_CudaCudnn", "_CudaFlash"])
def test_fused_ring_with_sinks_reassembles_exact_attention(kernel, monkeypatch):
    # GPT-OSS's full layers under a ring: every block fused, forward and backward; the backward's fused kernel gets
    # an output lowered by the sinks' log-sum-exp gradient (ring._lowered). A simulated ring of 2 ranks on one GPU
    import ds_ulysses_ext.attention.ring as ring_mod
    import ds_ulysses_ext.attention.ring_blocks as blocks_mod
    from ring_sim import OneGpuRing, kv_shares
    from ds_ulysses_ext.attention.masks import masked_attention
    R, S, D = 2, 4096, 64
    calls = _count_fused_calls(blocks_mod, D, monkeypatch, kernel)
    backward_calls, real_backward = [], getattr(blocks_mod, kernel).backward
    monkeypatch.setattr(getattr(blocks_mod, kernel), "backward",
                        staticmethod(lambda *a: backward_calls.append(1) or real_backward(*a)))
    q, k, v, dout = _ring_inputs(S, D, seed=4)
    sinks = torch.randn(q.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) * 2
    qf, kf, vf, sf = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    ref = masked_attention(*(t.transpose(1, 2) for t in (qf, kf, vf)), causal=True, sinks=sf).transpose(1, 2)
    ref.backward(dout.double())
    all_pos = torch.arange(S, device="cuda")
    shares = kv_shares(k, v, R)
    out, dq = torch.zeros_like(ref), torch.zeros_like(qf)
    dkv = torch.zeros(kf.shape[:3] + (2 * D,), dtype=torch.float64, device="cuda")
    dsinks = torch.zeros_like(sf)
    for r in range(R):
        idx = ring_mod.share_positions(all_pos, R, r)
        mask = blocks_mod.BlockMask(True, idx, all_pos)
        qr, kr, vr, dr = (t[:, :, idx].contiguous() for t in (q, k, v, dout))
        o, lse = ring_mod._ring_forward(qr, kr, vr, D ** -0.5, mask, OneGpuRing(r, R, shares, False))
        o_leaf, lse_leaf, s_leaf = (t.detach().requires_grad_() for t in (o.to(q.dtype), lse, sinks))
        keep = torch.sigmoid(lse_leaf - s_leaf.float()[None, :, None])  # as ring_attention applies them
        final = (o_leaf.float() * keep[..., None]).to(q.dtype)
        final.backward(dr)
        bwd = OneGpuRing(r, R, shares, True, keep=True)
        g_q, _, _ = ring_mod._ring_backward(qr, kr, vr, o_leaf.detach(), lse, o_leaf.grad, lse_leaf.grad, D ** -0.5,
                                            mask, bwd)
        out[:, :, idx], dq[:, :, idx] = final.detach().double(), g_q.double()
        dsinks += s_leaf.grad.double()
        for src, acc in bwd.sent:
            dkv[:, :, ring_mod.share_positions(all_pos, R, src)] += acc.double()
    for name, got, want in (("out", out, ref.detach()), ("dq", dq, qf.grad), ("dk", dkv[..., :D], kf.grad),
                            ("dv", dkv[..., D:], vf.grad), ("dsinks", dsinks, sf.grad)):
        assert _rel(got, want) < TOL, (name, _rel(got, want))
    assert len(calls) == len(backward_calls) == R * R  # every block of every rank ran fused, both ways


@pytest.mark.parametrize("window", [128, 1000])
@pytest.mark.parametrize("R", [2, 4])
def test_ring_with_a_window_through_varlen_calls_reassembles_exact_attention(R, window, monkeypatch):
    # a sliding window under the ring: each block's (query run, key run) pairs within reach as varlen calls with
    # the kernel's own reach (ring_varlen._WindowBlock), the whole simulated ring against fp64
    import ds_ulysses_ext.attention.ring_varlen as varlen_mod
    from ring_sim import check_ring
    from ds_ulysses_ext.attention import flash_varlen
    S, D = 4096, 64
    assert varlen_mod._checked_varlen(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, D), \
        "the varlen block kernel was left out: see the log line that says why"
    calls, real = [], flash_varlen._AtenFlash.forward
    monkeypatch.setattr(flash_varlen._AtenFlash, "forward", staticmethod(lambda *a: calls.append(a[-2:]) or real(*a)))
    q, k, v, dout = _ring_inputs(S, D, seed=7)
    check_ring(q, k, v, dout, R, window, rtol=TOL)
    assert calls and all(left + right == window - 1 for left, right in calls), calls


@pytest.mark.parametrize("weight_in_fp32", [False, True], ids=["llama_order", "gpt_oss_order"])
@pytest.mark.parametrize("name", ["liger", "compile"])
def test_fused_per_token_kernels_match_fp32(name, weight_in_fp32):
    """ds_ulysses_ext.kernels: RMSNorm (width 2048) and the SwiGLU product (width 8192) in bf16, forward and backward,
    through the checked provider, against the reference in fp32."""
    from ds_ulysses_ext.kernels import providers, reference
    if name == "liger" and not providers.liger_available():
        pytest.skip("Liger-Kernel is not installed")
    provider = providers.provider_for(name, torch.device("cuda"))
    assert provider.name == name
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 1024, 2048, device="cuda", generator=gen)
    w = 1 + 0.2 * torch.randn(2048, device="cuda", generator=gen)
    gate, up = (torch.randn(4, 1024, 8192, device="cuda", generator=gen) for _ in range(2))
    for op, inputs in (("rms_norm", (x, w)), ("silu_mul", (gate, up))):
        results = []
        for fn, dtype in ((getattr(provider, op), torch.bfloat16), (getattr(reference, op), torch.float32)):
            leaves = [t.to(dtype).requires_grad_() for t in inputs]
            out = fn(*leaves, 1e-5, weight_in_fp32) if op == "rms_norm" else fn(*leaves)
            out.backward(torch.ones_like(out))
            results.append([out] + [t.grad for t in leaves])
        for got, ref in zip(*results):
            assert got.dtype == torch.bfloat16
            assert _rel(got, ref) < TOL, (op, _rel(got, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [False, True], ids=["llama_order", "gpt_oss_order"])
def test_rms_norm_backward_kernel_against_fp64(dtype, weight_in_fp32):
    """kernels/rms_norm.py's backward (the Liger provider's norm) against the reference's autograd in fp64: the widths
    of Qwen3's q/k norms (128, tiles of 64 rows), Llama-3.2-1B (2048) and GPT-OSS (2880, no power of two), with
    row counts that leave a partial tile and give each program several tiles (its weight-gradient partial sums)."""
    from ds_ulysses_ext.kernels import reference
    from ds_ulysses_ext.kernels.rms_norm import RMSNorm, rms_norm_backward
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T, H in ((70001, 128), (16387, 2048), (9001, 2880)):
        x = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64)
        w = 1 + 0.2 * torch.randn(H, device="cuda", generator=gen, dtype=torch.float64)
        dy = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        reference.rms_norm(xl, wl, 1e-5, weight_in_fp32).backward(dy)
        xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        y = RMSNorm.apply(xs, ws, 1e-5, weight_in_fp32)
        y.backward(dy.to(dtype))
        tol = 1e-5 if dtype == torch.float32 else TOL
        for name, got, ref in (("y", y, reference.rms_norm(x, w, 1e-5, weight_in_fp32)), ("dx", xs.grad, xl.grad),
                               ("dw", ws.grad, wl.grad)):
            assert got.dtype == dtype and _rel(got, ref) < tol, (T, H, name, _rel(got, ref))
        rstd = torch.rsqrt(x.to(dtype).float().pow(2).mean(-1) + 1e-5)  # the kernel alone, non-contiguous dy
        dx, dw = rms_norm_backward(dy.to(dtype).t().contiguous().t(), x.to(dtype), w.to(dtype), rstd,
                                   not weight_in_fp32)
        assert _rel(dx, xl.grad) < tol and _rel(dw, wl.grad) < tol, (T, H)


@pytest.mark.parametrize("name", ["liger", "compile"])
def test_fused_rope_matches_fp32(name):
    """ds_ulysses_ext.kernels: RoPE as HF's attention hands it over (q, k [B, H, s, D] views of [B, s, H, D]), bf16,
    forward and backward, through the checked provider, against the reference in fp32; Llama-3.2-1B's head shape
    and MLA's shared one-head k (GLM-4.7-Flash's rope part, D 64)."""
    from ds_ulysses_ext.kernels import providers, reference
    if name == "liger" and not providers.liger_available():
        pytest.skip("Liger-Kernel is not installed")
    provider = providers.provider_for(name, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for Hq, Hkv, D in ((32, 8, 64), (20, 1, 64)):
        q = torch.randn(1, 2048, Hq, D, device="cuda", generator=gen).transpose(1, 2)
        k = torch.randn(1, 2048, Hkv, D, device="cuda", generator=gen).transpose(1, 2)
        angle = torch.arange(2048, device="cuda")[:, None] * 500000.0 ** -torch.linspace(0, 1, D // 2, device="cuda")
        emb = torch.cat((angle, angle), -1)[None]
        results = []
        for fn, dtype in ((provider.rope, torch.bfloat16), (reference.rope, torch.float32)):
            leaves = [t.to(dtype).requires_grad_() for t in (q, k)]
            outs = fn(*leaves, emb.cos().to(dtype), emb.sin().to(dtype))
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            results.append(list(outs) + [t.grad for t in leaves])
        for got, ref in zip(*results):
            assert got.dtype == torch.bfloat16 and got.shape == ref.shape
            assert _rel(got, ref) < TOL, (Hq, Hkv, _rel(got, ref))


def test_moe_block_at_ep1_never_syncs_the_host():
    """The MoE block's forward and backward at ep=1 (grouped experts, bf16) under CUDA's sync debug mode: any
    device-to-host read (a count, an item) raises; the output against the same block run outside the mode (an
    fp32 copy is no reference here: its top-k picks other experts for near ties, 6% off in the first run)."""
    from ds_ulysses_ext.moe import MoEBlock, MoESpec
    torch.manual_seed(0)
    block = MoEBlock(MoESpec(2048, 128, 8, 768, norm_topk_prob=True)).cuda()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    block = block.to(torch.bfloat16)
    x = torch.randn(1, 4096, 2048, device="cuda")
    xb = x.to(torch.bfloat16).requires_grad_()
    out_ref = block(xb.detach().clone())  # the same block outside the debug mode (an fp32 block routes differently)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = block(xb)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _rel(out, out_ref) < 1e-3, _rel(out, out_ref)  # the same computation: equal up to kernel order


@pytest.mark.parametrize("feature", ["none", "documents", "window"])
def test_mla_head_dims_through_the_gpu_kernels(feature, monkeypatch):
    """MLA's q/k head dim (nope + rope, 192) wider than v's (128): the plain SDPA call takes both, the varlen
    flash road (documents, a window) gets v zero-padded (backends.local_attention); bf16 forward and backward
    against masks.py's exact torch path in fp64."""
    from ds_ulysses_ext.attention import backends, flash_varlen, masks
    lengths = [1500, 37, 600, 959]
    S, h, Dqk, Dv = sum(lengths), 8, 192, 128
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k = (torch.randn(1, S, h, Dqk, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v, dout = (torch.randn(1, S, h, Dv, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    # the kernel's first-use check at this head dim runs here, not inside the counted calls below
    assert flash_varlen.usable(q), "the varlen flash kernel was left out at head dim 192: see the log line"
    kw = {}
    if feature == "documents":
        kw["cu_seqlens"] = masks.cu_seqlens_of(torch.cat([torch.arange(n) for n in lengths])[None].cuda())
    if feature == "window":
        kw["window"] = 128
    calls = _count_varlen_calls(flash_varlen, monkeypatch)
    grads = []
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        if dtype == torch.bfloat16:
            out = backends.local_attention("sdpa", *leaves, causal=True, **kw)
        else:  # the dense definition: causal, within a document, within the window
            i = torch.arange(S, device="cuda")
            doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths).cuda())
            allowed = (i[None, :] <= i[:, None]) & ((doc[:, None] == doc[None, :]) if "cu_seqlens" in kw else True)
            if "window" in kw:
                allowed &= i[:, None] - i[None, :] < kw["window"]
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in leaves), attn_mask=allowed, scale=Dqk ** -0.5).transpose(1, 2)
        assert out.shape[-1] == Dv
        out.backward(dout.to(dtype))
        grads.append([out.detach()] + [t.grad for t in leaves])
    assert calls == ([] if feature == "none" else [1])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *grads):
        assert _rel(got, want) < TOL, (feature, name, _rel(got, want))


def offload_test_model(layers: int, S: int = 32768):
    """(HF model, CPCausalLM, local batch): a bf16 Llama of `layers` 1024-wide layers at S tokens on one GPU, cp 1, for
    the offload tests (here and tests/test_gpu_offload.py)."""
    from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
    from tiny_models import tiny_model
    topo = init_topology(1)
    hf = tiny_model("llama", num_hidden_layers=layers, hidden_size=1024, intermediate_size=2048, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=1024, max_position_embeddings=S)
    hf = enable_context_parallel(hf.to("cuda", torch.bfloat16), topo)
    ids = torch.randint(0, 1024, (1, S), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    return hf, CPCausalLM(hf, loss_chunk_size=4096), shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)


def test_attention_offload_on_cuda_matches_and_lowers_the_peak():
    # memory.attention_offload on the real path: pinned host copies on the side stream, events, the one-layer-ahead
    # prefetch. Six layers at 32k tokens in bf16 against except_attention without it: the same loss
    # and gradients (bytes are only moved; bf16 attention backward kernels may order their sums differently), and a
    # lower peak, by at least half of what all but two layers' attention tensors take
    from ds_ulysses_ext.memory import ExceptAttentionRecompute
    layers = 6
    hf, lm, local = offload_test_model(layers)

    def step(offload):
        policy = ExceptAttentionRecompute(offload=offload).apply(hf)
        lm.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_sum, count = lm(**local)
        (loss_sum / count).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        stats = dict(policy.offload.stats) if offload else None
        policy.remove()
        return (loss_sum / count).detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}, peak, stats

    step(False)  # warm-up: the kernels' first-call workspaces are not the policy's
    loss_off, grads_off, peak_off, _ = step(False)
    loss_on, grads_on, peak_on, stats = step(True)
    assert (stats["offloaded"], stats["reloaded"], stats["prefetched"], stats["released"]) == (
        layers, layers, layers - 1, layers), stats
    assert _rel(loss_on, loss_off) < 1e-3
    for n, g in grads_on.items():
        assert _rel(g, grads_off[n]) < TOL, (n, _rel(g, grads_off[n]))
    per_layer = stats["offloaded_bytes"] / layers
    assert peak_on < peak_off - 0.5 * (layers - 2) * per_layer, (peak_on / 2**20, peak_off / 2**20, per_layer / 2**20)

