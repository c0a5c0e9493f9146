"""The MoE block against references: HF's Qwen3-MoE sparse block (same weights), and the single-rank block for
the EP all-to-all dispatcher at ep=2 and 4 (outputs, input and weight gradients; fp32, rel 1e-5)."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from ds_ulysses_ext.moe import AllToAllDispatcher, MoEBlock, MoEContext, MoESpec, lean_pass

RTOL = 1e-5


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err < RTOL, (what, err)


def _block(spec, seed=0, skew=3.0):
    torch.manual_seed(seed)
    block = MoEBlock(spec)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        # skew the router so some experts receive no token at all
        block.gate.weight[-2:] -= skew
    return block


def test_matches_hf_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                             norm_topk_prob=norm)
        torch.manual_seed(0)
        hf = Qwen3MoeSparseMoeBlock(cfg).float()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.5)
        ours = MoEBlock(MoESpec(16, 8, 2, 12, norm_topk_prob=norm))
        ours.load_state_dict(hf.state_dict())
        x = torch.randn(3, 10, 16, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out_hf, out = hf(x), ours(x2)
        _close(out, out_hf, f"output norm={norm}")
        g = torch.randn_like(out)
        (out_hf * g).sum().backward()
        (out * g).sum().backward()
        _close(x2.grad, x.grad, "input grad")
        hf_params = dict(hf.named_parameters())
        assert set(hf_params) == {n for n, _ in ours.named_parameters()}
        for n, p in ours.named_parameters():
            _close(p.grad, hf_params[n].grad, n)


SPECS = {
    "softmax_norm": MoESpec(12, 8, 2, 10, "softmax", True),
    "softmax_raw": MoESpec(12, 8, 3, 10, "softmax", False),
    "sigmoid_latent_shared": MoESpec(12, 8, 2, 10, "sigmoid", True, latent_size=8, shared_intermediate_size=6),
}


def _ep_case(rank, world, ep, spec_name):
    from ds_ulysses_ext import init_topology
    spec = SPECS[spec_name]
    topo = init_topology(cp_size=1, ep_size=ep)
    ref = _block(spec)
    torch.manual_seed(100)
    xs = [torch.randn(2, 5 + r, spec.hidden_size) for r in range(world)]  # uneven token counts per rank
    gs = [torch.randn_like(x) for x in xs]
    # reference: every rank's tokens through the unsharded block in one process
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_out = [ref(x) for x in ref_x]
    sum((o * g).sum() for o, g in zip(ref_out, gs)).backward()

    block = _block(spec)
    block.shard(topo.ep_rank, ep)
    block._ctx[0] = MoEContext(AllToAllDispatcher(spec.num_experts, topo.ep_group))
    x = xs[rank].clone().requires_grad_()
    out = block(x)
    (out * gs[rank]).sum().backward()
    _close(out, ref_out[rank].detach(), "output")
    _close(x.grad, ref_x[rank].grad, "input grad")
    El = spec.num_experts // ep
    for name, p in block.named_parameters():
        grad = p.grad.clone()
        ref_grad = dict(ref.named_parameters())[name].grad
        if name.startswith("experts."):
            dist.all_reduce(grad, group=topo.edp_group)  # the shard's replicas saw the other EP groups' tokens
            ref_grad = ref_grad[topo.ep_rank * El:(topo.ep_rank + 1) * El]
        else:
            dist.all_reduce(grad)
        _close(grad, ref_grad, name)
    counts = torch.tensor(block.experts.num_local_experts)
    assert counts == El


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_alltoall_dispatcher_matches_single_rank(world, ep, spec_name):
    run_ranks(_ep_case, world, ep, spec_name)


def test_some_experts_get_no_tokens():
    block = _block(SPECS["softmax_norm"])
    x = torch.randn(1, 6, 12)
    _, experts, _ = block.gate(x.reshape(-1, 12))
    assert set(range(8)) - set(experts.flatten().tolist()), "the skewed router should leave an expert idle"
    block(x).sum().backward()
    assert block.experts.gate_up_proj.grad is not None


@pytest.mark.parametrize("mode,group,offload", [("act", 1, False), ("experts", 1, False), ("experts", 3, True),
                                                ("experts", 8, True)])
def test_recompute_and_offload_are_exact_and_rerun_the_experts(mode, group, offload):
    spec = SPECS["softmax_norm"]
    x = torch.randn(2, 7, spec.hidden_size)
    results = []
    for recompute, size, off in (("none", 1, False), (mode, group, offload)):
        block = _block(spec)
        block.experts.recompute, block.experts.group_size, block.experts.offload_inputs = recompute, size, off
        xi = x.clone().requires_grad_()
        out = block(xi)
        after_forward = block.experts.ffn_calls
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()},
                        after_forward, block.experts.ffn_calls))
    (ref_out, ref_x, ref_g, _, _), (out, gx, g, fwd_calls, total_calls) = results
    _close(out, ref_out, "output")
    _close(gx, ref_x, "input grad")
    for n in ref_g:
        _close(g[n], ref_g[n], n)
    groups = -(-spec.num_experts // group)
    if mode == "experts":  # each group's FFN ran once in forward and once more in backward
        assert (fwd_calls, total_calls) == (groups, 2 * groups)
    else:
        assert (fwd_calls, total_calls) == (1, 1)


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_matches_hf_deepseek_v3_router(norm):
    # sigmoid scores honour norm_topk_prob as DeepSeek-V3's HF router does (one expert group, scaling 1); false once
    # renormalised anyway
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from ds_ulysses_ext.moe.router import TopKRouter
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, norm_topk_prob=norm)
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg).float()
    ours = TopKRouter(16, 8, 2, score="sigmoid", norm_topk_prob=norm)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        ours.weight.copy_(hf.weight)
    x = torch.randn(20, 16)
    _, w_hf, e_hf = hf(x)
    w, e, _ = ours(x)
    assert torch.equal(e, e_hf)
    _close(w, w_hf, f"weights norm_topk_prob={norm}")


def test_ep1_grouped_experts_read_no_count_on_the_host(monkeypatch):
    """At ep=1 the routed counts stay on the device for the grouped experts (on CUDA every host read is a sync in
    each layer's forward): forward and backward with every explicit tensor-to-host read failing, against the loop."""
    import ds_ulysses_ext.moe.grouped as grouped_module
    spec = MoESpec(16, 8, 2, 12, norm_topk_prob=True)
    x = torch.randn(2, 9, 16)
    ref_block, block = _block(spec), _block(spec)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref_block(x_ref)
    out_ref.square().sum().backward()

    monkeypatch.setattr(grouped_module, "_grouped_mm_ok", lambda *a: True)  # torch._grouped_mm runs on CPU too

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")
    for name in ("tolist", "item", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = block(x_new)
    out.square().sum().backward()
    monkeypatch.undo()
    _close(out.detach(), out_ref.detach(), "output")
    _close(x_new.grad, x_ref.grad, "input grad")
    for (name, p), p_ref in zip(block.named_parameters(), ref_block.parameters()):
        _close(p.grad, p_ref.grad, name)


def test_fused_combine_and_swiglu_wiring_on_cpu(monkeypatch):
    """The CUDA path's plumbing (the combine's and the expansion's per-token sums, kernels/slot_sum.py; the experts'
    SwiGLU, kernels/glu.py) on CPU in fp32, each Triton kernel replaced by the torch formula it must compute (written
    here from its docstring, not taken from the module): which rows each token reads, which gradient goes where. The
    kernels themselves run in tests/test_gpu_moe_kernels.py."""
    import ds_ulysses_ext.moe.dispatch as dispatch_module
    import ds_ulysses_ext.moe.experts as experts_module
    import ds_ulysses_ext.moe.grouped as grouped_module
    calls = {"sum": 0, "weighted": 0, "backward": 0, "glu": 0}

    def slot_sum(y, pos, w=None):
        calls["weighted" if w is not None else "sum"] += 1
        rows = y[pos]  # [T, k, D]
        return (rows if w is None else rows * w[..., None]).sum(1)

    def slot_sum_backward(g, y, pos, w):
        calls["backward"] += 1
        grad_y = torch.full_like(y, float("nan"))  # every row must be written
        grad_y[pos.reshape(-1)] = (w[..., None] * g[:, None, :]).reshape(-1, y.shape[1])
        return grad_y, (g[:, None, :] * y[pos]).sum(-1)

    class Glu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            calls["glu"] += 1
            ctx.save_for_backward(h)
            gate, up = h.chunk(2, -1)
            return gate * torch.sigmoid(gate) * up

        @staticmethod
        def backward(ctx, g):
            h, = ctx.saved_tensors
            gate, up = h.chunk(2, -1)
            s = torch.sigmoid(gate)
            return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], -1)

    spec = MoESpec(16, 8, 2, 12, norm_topk_prob=True)
    x = torch.randn(2, 9, 16)
    ref_block, block = _block(spec), _block(spec)
    ref_block.experts.fused = False
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref_block(x_ref)
    out_ref.square().sum().backward()
    monkeypatch.setattr(dispatch_module, "_slot_sum_ok", lambda t: True)
    monkeypatch.setattr(dispatch_module, "slot_sum", slot_sum)
    monkeypatch.setattr(dispatch_module, "slot_sum_backward", slot_sum_backward)
    monkeypatch.setattr(experts_module, "glu_ok", lambda *a: True)
    monkeypatch.setattr(experts_module, "FusedSwiGLU", Glu)
    monkeypatch.setattr(grouped_module, "_grouped_mm_ok", lambda *a: True)  # one activation call, as on CUDA
    monkeypatch.setattr(lean_pass, "applies", lambda *a: False)  # the three-function path (ep > 1 runs it)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the experts ask the tensor
    out = block(x_new)
    out.square().sum().backward()
    monkeypatch.undo()
    assert calls == {"sum": 1, "weighted": 1, "backward": 1, "glu": 1}, calls
    _close(out.detach(), out_ref.detach(), "output")
    _close(x_new.grad, x_ref.grad, "input grad")
    for (name, p), p_ref in zip(block.named_parameters(), ref_block.parameters()):
        _close(p.grad, p_ref.grad, name)


def _lean_run(monkeypatch, spec, x, skew=3.0, recompute="none"):
    """The block through lean_pass.py (CPU: torch's formulas, per-expert matmuls), recording every tensor autograd
    saves during its forward."""
    block = _block(spec, skew=skew)
    block.experts.recompute = recompute
    calls, saved = [], []
    real = lean_pass.LeanExpertPass.forward

    def forward(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(lean_pass, "applies", lambda *a: True)
    monkeypatch.setattr(lean_pass.LeanExpertPass, "forward", staticmethod(forward))
    xi = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = block(xi)
    out.square().sum().backward()
    monkeypatch.undo()
    assert calls == [1], "the lean pass did not run"
    return block, xi, out, saved


@pytest.mark.parametrize("norm,recompute", [(True, "none"), (False, "none"), (True, "experts")])
def test_lean_pass_matches_the_three_functions(monkeypatch, norm, recompute):
    """lean_pass.py (dispatch, experts and combine as one function that keeps only x, the routing and h; what CUDA
    runs at ep=1) against the three-function path on CPU in fp32, with experts that get no token: output, input
    and every parameter gradient (the router's through the routing weights) to rel 1e-5. It recomputes act and
    never needs y: the routing weights' gradient comes from <g @ down, act>; with moe.recompute=experts it computes h
    again in backward."""
    spec = MoESpec(16, 8, 2, 12, norm_topk_prob=norm)
    x = torch.randn(2, 9, 16).abs()
    ref_block = _block(spec, skew=30.0)  # positive tokens on their negative router rows: two experts get no token
    x_ref = x.clone().requires_grad_()
    out_ref = ref_block(x_ref)
    out_ref.square().sum().backward()
    block, x_new, out, _ = _lean_run(monkeypatch, spec, x, skew=30.0, recompute=recompute)
    _close(out.detach(), out_ref.detach(), "output")
    _close(x_new.grad, x_ref.grad, "input grad")
    for (name, p), p_ref in zip(block.named_parameters(), ref_block.parameters()):
        _close(p.grad, p_ref.grad, name)
    assert any(float(c) == 0 for c in torch.bincount(ref_block.gate(x.view(-1, 16))[1].reshape(-1), minlength=8))


@pytest.mark.parametrize("recompute,kept", [("none", [(36, 24)]), ("experts", [])])
def test_lean_pass_keeps_no_slot_row_but_h(monkeypatch, recompute, kept):
    """What the lean pass saves for backward: of the [N, *] slot tensors only h [N, 2I] (and the int64 routing
    order), none with moe.recompute=experts; never x_N [N, D], act [N, I], y [N, D], which the three-function path
    keeps (N = T * k = 36 here)."""
    spec = MoESpec(16, 8, 2, 12, norm_topk_prob=True)
    T, N = 18, 36
    _, _, _, saved = _lean_run(monkeypatch, spec, torch.randn(2, 9, 16), recompute=recompute)
    slot_rows = sorted(shape for shape in saved if shape and shape[0] == N and len(shape) == 2)
    assert slot_rows == kept, slot_rows  # order and inverse are 1-D
    assert (T, 16) in saved  # x itself, shared with the router's saved input


def test_lean_pass_applies_only_where_it_is_exact_and_fast(monkeypatch):
    """layer.py runs the lean pass only at ep=1, on the fused paths, for Qwen3's bias-free SwiGLU experts without
    their inputs in host memory: everything else keeps the three functions."""
    import ds_ulysses_ext.moe.grouped as grouped_module
    from ds_ulysses_ext.kernels import glu, slot_sum
    for module, name in ((grouped_module, "_grouped_mm_ok"), (glu, "glu_ok"), (slot_sum, "slot_sum_ok")):
        monkeypatch.setattr(module, name, lambda *a: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.randn(4, 16)

    def case(change=lambda dispatcher, experts: None, spec=MoESpec(16, 8, 2, 12)):
        dispatcher, experts = AllToAllDispatcher(spec.num_experts), MoEBlock(spec).experts
        change(dispatcher, experts)
        return lean_pass.applies(dispatcher, experts, x)
    base = [case(), case(lambda d, e: setattr(e, "recompute", "act")),
            case(lambda d, e: setattr(e, "recompute", "experts"))]
    excluded = {
        "ep=2": case(lambda d, e: setattr(d, "ep", 2)),
        "dispatcher on torch": case(lambda d, e: setattr(d, "fused", False)),
        "experts on torch": case(lambda d, e: setattr(e, "fused", False)),
        "experts' inputs offloaded": case(lambda d, e: setattr(e, "offload_inputs", True)),
        "gpt_oss": case(spec=MoESpec.gpt_oss(16, 8, 2, 12)),
        "gpt_oss layout alone": case(spec=MoESpec(16, 8, 2, 12, weight_layout="gpt_oss")),
    }
    monkeypatch.undo()
    assert all(base), ("the lean pass should apply to the plain Qwen3 block at ep=1, any moe.recompute", base)
    assert not any(excluded.values()), excluded
    assert not lean_pass.applies(AllToAllDispatcher(8), MoEBlock(MoESpec(16, 8, 2, 12)).experts, x), "CPU"


def test_fused_moe_kernels_follow_model_kernels():
    """model.kernels=none keeps the MoE glue on the torch path too (the exactness reference on any device)."""
    from configs import compose_config
    from engine.ds.build import moe_settings
    base = ["model=tiny_moe", "device=cpu", "precision=fp32"]
    assert moe_settings(compose_config(base + ["model.kernels=none"])).fused_kernels is False
    assert moe_settings(compose_config(base + ["model.kernels=auto"])).fused_kernels is True
