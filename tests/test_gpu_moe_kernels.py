"""The MoE glue's Triton kernels on a CUDA SM90 GPU (skipped elsewhere; `bash scripts/bench/bench_gpu.sh gpu_tests`):
kernels/slot_sum.py (the combine and the slot expansion's backward) and kernels/glu.py (the experts' SwiGLU),
against fp32 formulas written here, and the whole MoE block with them against the same block on the torch path.
fp32: relative 1e-5 per tensor; bf16: one rounding of the output (2**-8 relative per element, the values being
sums in fp32 rounded once) unless a test says why not."""
import pytest
import torch

import test_gpu_paths
from test_gpu_paths import _rel

pytestmark = test_gpu_paths.pytestmark  # the same SM90 skip


def _within_one_rounding(got, ref_fp32, what, magnitude=None):
    """`magnitude`: the sum of the terms' absolute values, where the value is a sum computed in fp32 (its own
    rounding errors, a few fp32 ulps of that, matter where the terms cancel)."""
    err = (got.float() - ref_fp32).abs()
    bound = 2.0 ** -8 * ref_fp32.abs() + (0 if magnitude is None else 2.0 ** -20 * magnitude) + 1e-30
    assert bool((err <= bound).all()), (what, float((err / ref_fp32.abs().clamp_min(1e-30)).max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_sum_kernels_against_the_fp32_formula(dtype):
    from ds_ulysses_ext.kernels.slot_sum import slot_sum, slot_sum_backward, slot_sum_ok
    dev = torch.device("cuda", torch.cuda.current_device())
    assert slot_sum_ok(dev, dtype), "see the log line that says why"
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, k, D = 3000, 8, 2048  # Qwen3-30B-A3B's top-8 and hidden size
    y = torch.randn(T * k, D, device="cuda", generator=gen).to(dtype)
    pos = torch.randperm(T * k, device="cuda", generator=gen).view(T, k)
    w = torch.rand(T, k, device="cuda", generator=gen).to(dtype)
    g = torch.randn(T, D, device="cuda", generator=gen).to(dtype)
    y32, w32, g32 = y.double(), w.double(), g.double()
    ref = (y32[pos] * w32[..., None]).sum(1)
    ref_gy = torch.empty_like(y32)
    ref_gy[pos.reshape(-1)] = (w32[..., None] * g32[:, None, :]).reshape(-1, D)
    ref_gw = (g32[:, None, :] * y32[pos]).sum(-1)
    got_gy, got_gw = slot_sum_backward(g, y, pos, w)
    if dtype == torch.float32:
        for name, got, want in (("forward", slot_sum(y, pos, w), ref), ("sum", slot_sum(y, pos), y32[pos].sum(1)),
                                ("grad_y", got_gy, ref_gy), ("grad_w", got_gw, ref_gw)):
            assert _rel(got.double(), want) < 1e-5, name
    else:
        # products of two bf16 values are exact in fp32, their sums of k = 8 nearly so: one rounding at the store
        _within_one_rounding(slot_sum(y, pos, w), ref.float(), "forward", (y32[pos] * w32[..., None]).abs().sum(1))
        _within_one_rounding(slot_sum(y, pos), y32[pos].sum(1).float(), "sum", y32[pos].abs().sum(1))
        _within_one_rounding(got_gy, ref_gy.float(), "grad_y")
        assert _rel(got_gw.double(), ref_gw) < 2 ** -8, "grad_w"  # a 2048-term dot product: norm-wise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernels_against_the_fp32_formula(dtype):
    from ds_ulysses_ext.kernels.glu import FusedSwiGLU, glu_ok
    dev = torch.device("cuda", torch.cuda.current_device())
    assert glu_ok(dev, dtype), "see the log line that says why"
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, I = 5000, 768  # Qwen3-30B-A3B's expert intermediate size
    h = (3 * torch.randn(N, 2 * I, device="cuda", generator=gen)).to(dtype).requires_grad_()
    g = torch.randn(N, I, device="cuda", generator=gen).to(dtype)
    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, -1)
    ref = gate * torch.sigmoid(gate) * up
    ref_grad, = torch.autograd.grad(ref, h64, g.double())
    out = FusedSwiGLU.apply(h)
    out.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert _rel(out.double(), ref) < tol and _rel(h.grad.double(), ref_grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_backward_against_the_fp32_formula(dtype):
    """kernels/glu.py glu_weighted_backward (the lean pass's): grad_h for grad_act = w * u, <u, act> per row, w * act;
    a width over one block (the kernel loops over column blocks)."""
    from ds_ulysses_ext.kernels.glu import glu_ok, glu_weighted_backward
    dev = torch.device("cuda", torch.cuda.current_device())
    assert glu_ok(dev, dtype), "see the log line that says why"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, I in ((5000, 768), (300, 1500)):
        h = (3 * torch.randn(N, 2 * I, device="cuda", generator=gen)).to(dtype)
        u = torch.randn(N, I, device="cuda", generator=gen).to(dtype)
        w = torch.rand(N, device="cuda", generator=gen).to(dtype)
        gate, up = h.double().chunk(2, -1)
        sig = torch.sigmoid(gate)
        act = (gate * sig * up).to(dtype).double()  # as the forward stored it
        grad_act = w.double()[:, None] * u.double()
        ref = (torch.cat([grad_act * up * sig * (1 + gate * (1 - sig)), grad_act * gate * sig], -1),
               (u.double() * act).sum(-1), w.double()[:, None] * act)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        for name, got, want in zip(("grad_h", "grad_w", "w * act"), glu_weighted_backward(u, h, w), ref):
            assert _rel(got.double(), want) < tol, (name, N, I)


@pytest.mark.parametrize("dtype,path", [(torch.float32, "three functions"), (torch.bfloat16, "three functions"),
                                        (torch.bfloat16, "lean"), (torch.bfloat16, "lean, h recomputed")])
def test_moe_block_with_the_kernels_against_the_torch_path(dtype, path, monkeypatch):
    """The Qwen3-30B-A3B block at ep=1 on CUDA, the same weights and input, kernels on and off (the torch path, what
    model.kernels=none runs): output, input and parameter gradients, two experts getting no token. With the kernels
    the block runs moe/lean_pass.py at ep=1 (`lean`), or the dispatcher's and experts' kernels as ep > 1 does (`three
    functions`); the lean pass needs the grouped GEMMs, which are bf16 only (fp32 runs the experts' loop). The routing
    is the same in both (the router runs the same ops); the kernels change only roundings:
    fp32 rel 1e-5, bf16 2e-2 as test_gpu_paths."""
    from ds_ulysses_ext.kernels.glu import glu_ok
    from ds_ulysses_ext.kernels.slot_sum import slot_sum_ok
    from ds_ulysses_ext.moe import AllToAllDispatcher, MoEBlock, MoEContext, MoESpec, lean_pass
    dev = torch.device("cuda", torch.cuda.current_device())
    assert slot_sum_ok(dev, dtype) and glu_ok(dev, dtype)
    spec = MoESpec(2048, 128, 8, 768, norm_topk_prob=True)
    blocks = []
    for fused in (False, True):
        torch.manual_seed(0)
        block = MoEBlock(spec).to(device="cuda", dtype=dtype)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            block.gate.weight[-2:] = -1.0  # on positive tokens: experts 126 and 127 get none
        block.experts.fused = fused
        block.experts.recompute = "experts" if fused and path == "lean, h recomputed" else "none"
        block._ctx[0] = MoEContext(dispatcher=AllToAllDispatcher(128, fused=fused), balance="none")
        blocks.append(block)
    x = torch.randn(1, 4096, 2048, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    x = x.abs()
    grad = torch.randn_like(x)
    lean = [lean_pass.applies(b.context.dispatcher, b.experts, x) for b in blocks]
    assert lean == [False, dtype == torch.bfloat16], lean
    if not path.startswith("lean"):
        monkeypatch.setattr(lean_pass, "applies", lambda *a: False)
    outs, xs = [], []
    for block in blocks:
        xi = x.clone().requires_grad_()
        out = block(xi)
        out.backward(grad)
        outs.append(out.detach())
        xs.append(xi.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(outs[1], outs[0]) < tol and _rel(xs[1], xs[0]) < tol
    for (name, p), q in zip(blocks[1].named_parameters(), blocks[0].parameters()):
        assert _rel(p.grad, q.grad) < tol, name
    assert float(blocks[1].experts.gate_up_proj.grad[-2:].abs().max()) == 0  # the empty experts' gradients


def test_first_use_checks_save_nothing_for_backward():
    """The checks run at the first call, which may be inside a checkpointed layer's forward: a check that saved
    tensors for backward there would make the recomputation save fewer (torch.utils.checkpoint's CheckpointError,
    seen on the H200 with full_recompute)."""
    from ds_ulysses_ext.kernels.glu import glu_ok
    from ds_ulysses_ext.kernels.slot_sum import slot_sum_ok
    dev = torch.device("cuda", torch.cuda.current_device())

    def pack(t):
        raise AssertionError("a first-use check saved a tensor for backward")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert slot_sum_ok.__wrapped__(dev, torch.bfloat16) and glu_ok.__wrapped__(dev, torch.bfloat16)
