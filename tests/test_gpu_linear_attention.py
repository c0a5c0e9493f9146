"""flash-linear-attention's chunked kernels (fla_kernels.py) against the torch delta rule, on a CUDA GPU with fla-core
installed (skipped elsewhere). Real head shapes: Qwen3.5-MoE's gated DeltaNet (transformers' Qwen3_5MoeTextConfig: 16
key heads read by 32 value heads, dk = dv = 128; q and k repeated to 32 as HF does) and Ling-3.0's KDA (a per-channel
decay bounded by kda_lower_bound = -5, 16 heads of 128 here). Packed documents of uneven lengths (one of 37 tokens,
none a multiple of the 64-token chunk) over two rows, in bf16.

Bound, for the output and the gradients of q, k, v, g and beta: relative error (norm) to an fp32 torch run no larger
than max(2x the bf16 torch path's own, TOL), the first-use check's rule (fla_kernels.HALF_FLOOR). The torch path in
bf16 computes in fp32 and rounds its inputs' gradients and its output only, so TOL is what fla's bf16 products get.
"""
import pytest
import torch

from ds_ulysses_ext.linear_attention import fla_kernels
from ds_ulysses_ext.linear_attention.fla_kernels import (HALF_FLOOR, DeltaRuleKernel, fla_available, fla_kernel,
                                                        kernel_cu_seqlens, torch_reference)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()),
                                reason="fla's kernels need CUDA and fla-core (with triton)")
TOL = HALF_FLOOR
DOCS = [[1000, 37, 1011], [611, 1437]]  # two rows of 2048 tokens
NAMES = ("output", "q's gradient", "k's gradient", "v's gradient", "g's gradient", "beta's gradient")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _cu_seqlens():
    starts = [row * 2048 + sum(lengths[:i]) for row, lengths in enumerate(DOCS) for i in range(len(lengths))]
    return torch.tensor(starts + [2 * 2048], dtype=torch.int32, device="cuda")


def _inputs(kind, h=32, hk=16, d=128):
    """[2 2048 ...] bf16 tensors shaped as the layer hands them (after the conv and the gates), HF's init ranges."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S = 2, 2048
    if kind == "kda":
        h = hk
    q, k = (torch.nn.functional.silu(torch.randn(B, S, hk, d, generator=g, device="cuda"))
            .repeat_interleave(h // hk, dim=2).bfloat16() for _ in range(2))
    v = torch.nn.functional.silu(torch.randn(B, S, h, d, generator=g, device="cuda")).bfloat16()
    beta = torch.randn(B, S, h, generator=g, device="cuda").bfloat16().sigmoid()
    A = torch.empty(h, device="cuda").uniform_(0.01, 16, generator=g)  # HF's A_log init: log U(0.01, 16)
    if kind == "kda":
        f = torch.randn(B, S, h, d, generator=g, device="cuda")
        decay = (-5.0 * torch.sigmoid(A[:, None] * f)).bfloat16()  # kda_safe_gate, lower bound -5; model dtype
    else:
        a = torch.randn(B, S, h, generator=g, device="cuda")
        decay = -A * torch.nn.functional.softplus(a)  # fp32, as HF hands it
    return q, k, v, decay, beta


def _grads(fn, tensors, dtype, upstream):
    leaves = [t.to(dtype or t.dtype, copy=True).requires_grad_() for t in tensors]
    out = fn(*leaves)
    up = out.detach().float() if upstream is None else upstream
    out.backward((1 + up).to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda"])
def test_fla_matches_the_torch_delta_rule_on_packed_documents(kind):
    tensors = [t.reshape(1, 2 * 2048, *t.shape[2:]) for t in _inputs(kind)]
    cu, cu_host = kernel_cu_seqlens(_cu_seqlens(), 2, 2048, torch.device("cuda"))
    kernel = fla_kernel(kind)
    ref = _grads(lambda *a: torch_reference(*a, cu_host), tensors, torch.float32, None)
    eager = _grads(lambda *a: torch_reference(*a, cu_host), tensors, None, ref[0])
    with torch.no_grad():
        out = kernel(*tensors, cu, cu_host)
    assert _rel(out, ref[0]) <= max(2 * _rel(eager[0], ref[0]), TOL), (kind, _rel(out, ref[0]), _rel(eager[0], ref[0]))
    try:
        got = _grads(lambda *a: kernel(*a, cu, cu_host), tensors, None, ref[0])
    except RuntimeError as err:  # fla 0.6: no gated DeltaNet backward on Hopper with Triton 3.4 to 3.7.0 (#640)
        pytest.skip(f"{kind}: forward within the bound ({_rel(out, ref[0]):.2e}); fla refuses its backward here: {err}")
    report = []
    for name, a, e, r in zip(NAMES, got, eager, ref):
        report.append((name, _rel(a, r), _rel(e, r)))
    print(kind, "  ".join(f"{n}: fla {x:.2e} torch {y:.2e}" for n, x, y in report))
    for name, err, eager_err in report:
        assert err <= max(2 * eager_err, TOL), (kind, name, err, eager_err)
    # the state restarts at each document: the second document alone gives the same output
    a, b = cu_host[1].item(), cu_host[2].item()
    alone = kernel(*(t[:, a:b].contiguous() for t in tensors), torch.tensor([0, b - a], device="cuda"),
                   torch.tensor([0, b - a]))
    assert _rel(alone, got[0][:, a:b]) < 1e-3


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda"])
def test_the_layer_entry_runs_fla_after_its_check(kind, caplog):
    """DeltaRuleKernel as the layer calls it: [B S ...] in, the first-use check on the run's input, fla's output."""
    import logging
    q, k, v, decay, beta = _inputs(kind)
    entry = DeltaRuleKernel("auto")
    assert entry.uses_fla(q.device, q.dtype)
    with caplog.at_level(logging.INFO, logger=fla_kernels.__name__):
        o = entry(kind, q, k, v, decay, beta, _cu_seqlens(), 2, 2048)
    ran = f"fla's {kind} kernel checked against the torch delta rule" in caplog.text
    # or fla refused this machine (Triton < 3.7.1 on Hopper, gated DeltaNet's backward): auto fell back, and said so
    assert ran or "the torch delta rule (model.linear_attn_kernel=auto: fla's" in caplog.text, caplog.text
    print(kind, "ran fla" if ran else "fell back to torch")
    cu, cu_host = kernel_cu_seqlens(_cu_seqlens(), 2, 2048, torch.device("cuda"))
    ref = torch_reference(*(t.reshape(1, 4096, *t.shape[2:]).float() for t in (q, k, v, decay, beta)), cu_host)
    assert o.shape == v.shape and _rel(o.reshape(ref.shape), ref) < TOL
    assert not entry.uses_fla(q.device, torch.float32)  # auto keeps fp32 runs on torch

