"""GPT-OSS's MoE through our block (fp32, rel 1e-5 unless said): HF's GptOssMLP, the EP all-to-all, a whole tiny
GPT-OSS under CP x EP, a saved checkpoint and our export, and scripts/train.py at ep2 cp2 against world 1.

References are stock HF: `GptOssMLP` with the same weights, and the unsplit `GptOssForCausalLM` with eager attention
(learned sinks, a sliding-window layer then a full one). Weights are drawn large enough that the SwiGLU clamp at
`swiglu_limit` clips on the routed slots (`_clamp_hits` shows it, on both sides of the up clamp and above on the
gate) and the biases are non-zero, so a dropped clamp, a wrong interleave, a lost bias or another score rule moves
the output far past the tolerance. The router bias also skews two experts away, so some experts receive no token.
"""
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP

from dist_harness import run_ranks
from moe_check import assert_moe_split_matches, moe_batch
from ds_ulysses_ext import UnsupportedError, enable_context_parallel, init_topology
from ds_ulysses_ext.moe import AllToAllDispatcher, MoEBlock, MoEContext, moe_blocks
from ds_ulysses_ext.moe.parallel import MoESettings, enable_expert_parallel, hf_moe_spec, replace_hf_blocks

RTOL = 1e-5
H, I, E = 16, 12, 8
LIMIT = 7.0
IDLE = (6, 7)  # experts the router bias pushes away: no token reaches them


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _close(a, b, what):
    err = _rel(a, b)
    assert err < RTOL, (what, err)


def _mlp_config(top_k=2):
    return GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k)


@torch.no_grad()
def _make_large(mlp, seed=0):
    """Non-trivial GPT-OSS MLP weights: h = x @ W + b has std ~4.5 on unit inputs, so the clamp at 7 clips often
    but not everywhere; every bias non-zero; the router bias keeps IDLE experts out of every top-k."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(mlp.named_parameters()):
        std = {"router.weight": 0.5, "experts.down_proj": 0.3}.get(name, 1.0)
        p.copy_(torch.randn(p.shape, generator=g) * std)
    mlp.router.bias[list(IDLE)] -= 100.0
    return mlp


def _hf_mlp(top_k=2, seed=0):
    return _make_large(GptOssMLP(_mlp_config(top_k)).float(), seed)


def _clamp_hits(mlp, x_TH):
    """(gate slots above the limit, up slots above it, up slots below -limit, all routed slots) of HF's MLP on x."""
    _, _, idx_Tk = mlp.router(x_TH)
    ex = mlp.experts
    h = torch.einsum("td,tkdf->tkf", x_TH, ex.gate_up_proj[idx_Tk]) + ex.gate_up_proj_bias[idx_Tk]
    gate, up = h[..., ::2], h[..., 1::2]
    return (int((gate > LIMIT).sum()), int((up > LIMIT).sum()), int((up < -LIMIT).sum()), gate.numel())


def _ours_from(hf_mlp):
    block = MoEBlock(hf_moe_spec(hf_mlp.experts.config))
    block.load_state_dict(hf_mlp.state_dict())
    return block


@pytest.mark.parametrize("top_k", [2, 4])
def test_block_matches_hf_gpt_oss_mlp(top_k):
    hf = _hf_mlp(top_k)
    ours = _ours_from(hf)
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {n for n, _ in ours.named_parameters()}  # HF's names ...
    assert all(p.shape == hf_params[n].shape for n, p in ours.named_parameters())  # ... and HF's layout
    assert ours.experts.gate_up_proj.shape == (E, H, 2 * I) and ours.experts.down_proj.shape == (E, I, H)
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    gate_hi, up_hi, up_lo, slots = _clamp_hits(hf, x.detach().reshape(-1, H))
    assert min(gate_hi, up_hi, up_lo) > 0 and max(gate_hi, up_hi + up_lo) < slots * I / 2, "the clamp must clip some"
    x2 = x.detach().clone().requires_grad_()
    out_hf, scores = hf(x)
    out, none = ours(x2)  # the (out, router_scores) tuple GptOssDecoderLayer unpacks
    assert none is None and scores.shape == (30, top_k)
    _close(out, out_hf, "output")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out_hf * g).sum().backward()
    (out * g).sum().backward()
    _close(x2.grad, x.grad, "input grad")
    for n, p in ours.named_parameters():
        _close(p.grad, hf_params[n].grad, n)
    _, experts, _ = ours.router(x.detach().reshape(-1, H))
    assert not set(IDLE) & set(experts.flatten().tolist())  # idle experts: zero gradient on both sides
    assert ours.experts.gate_up_proj_bias.grad[list(IDLE)].abs().sum() == 0


def _ep_case(rank, world, ep, top_k):
    topo = init_topology(cp_size=1, ep_size=ep)
    ref = _ours_from(_hf_mlp(top_k))
    xs = [torch.randn(2, 5 + r, H, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    gs = [torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + r)) for r, x in enumerate(xs)]
    ref_x = [x.clone().requires_grad_() for x in xs]  # every rank's tokens through the unsharded block
    ref_out = [ref(x)[0] for x in ref_x]
    sum((o * g).sum() for o, g in zip(ref_out, gs)).backward()

    block = _ours_from(_hf_mlp(top_k))
    block.shard(topo.ep_rank, ep)
    El = E // ep
    assert block.experts.gate_up_proj_bias.shape == (El, 2 * I) and block.experts.down_proj_bias.shape == (El, H)
    block._ctx[0] = MoEContext(AllToAllDispatcher(E, topo.ep_group))
    x = xs[rank].clone().requires_grad_()
    out, _ = block(x)
    (out * gs[rank]).sum().backward()
    _close(out, ref_out[rank].detach(), "output")
    _close(x.grad, ref_x[rank].grad, "input grad")
    ref_grads = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        grad, ref_grad = p.grad.clone(), ref_grads[name].grad
        if name.startswith("experts."):  # biases included: they go with their experts
            dist.all_reduce(grad, group=topo.edp_group)
            ref_grad = ref_grad[topo.ep_rank * El:(topo.ep_rank + 1) * El]
        else:
            dist.all_reduce(grad)
        _close(grad, ref_grad, name)
    if topo.ep_rank == ep - 1:  # the shard holding the idle experts: they got no rows and a zero gradient
        local_idle = [e - topo.ep_rank * El for e in IDLE if e // El == topo.ep_rank]
        assert local_idle and block.experts.down_proj_bias.grad[local_idle].abs().sum() == 0


@pytest.mark.parametrize("world,ep,top_k", [(2, 2, 2), (4, 4, 4), (4, 2, 2)])
def test_ep_alltoall_matches_single_rank_block(world, ep, top_k):
    run_ranks(_ep_case, world, ep, top_k)


@pytest.mark.parametrize("mode,group,offload", [("act", 1, False), ("experts", 1, False), ("experts", 3, True)])
def test_recompute_and_offload_are_exact(mode, group, offload):
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3))
    results = []
    for recompute, size, off in (("none", 1, False), (mode, group, offload)):
        block = _ours_from(_hf_mlp())
        block.experts.recompute, block.experts.group_size, block.experts.offload_inputs = recompute, size, off
        xi = x.clone().requires_grad_()
        out, _ = block(xi)
        after_forward = block.experts.ffn_calls
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()},
                        after_forward, block.experts.ffn_calls))
    (ref_out, ref_x, ref_g, _, _), (out, gx, g, fwd_calls, total_calls) = results
    _close(out, ref_out, "output")
    _close(gx, ref_x, "input grad")
    assert {n for n in g if n.endswith("bias")} == {"router.bias", "experts.gate_up_proj_bias",
                                                      "experts.down_proj_bias"}
    for n in ref_g:
        _close(g[n], ref_g[n], n)
    groups = -(-E // group)
    assert (fwd_calls, total_calls) == ((groups, 2 * groups) if mode == "experts" else (1, 1))


def test_segment_bias_equals_the_gathered_bias():
    """The grouped path's bias add (its backward a segment sum, no scatter-add) against HF's bias[expert_ids]."""
    from ds_ulysses_ext.moe.experts import _SegmentBias
    counts = torch.tensor([3, 0, 5, 1])
    h = torch.randn(9, 6, requires_grad=True)
    b = torch.randn(4, 6, requires_grad=True)
    h2, b2 = h.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    dy = torch.randn(9, 6)
    (_SegmentBias.apply(h, b, counts) * dy).sum().backward()
    ((h2 + b2[torch.repeat_interleave(torch.arange(4), counts)]) * dy).sum().backward()
    _close(h.grad, h2.grad, "rows")
    _close(b.grad, b2.grad, "bias")
    assert b.grad[1].abs().sum() == 0


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _sm90(), reason="torch._grouped_mm in bf16 needs a CUDA SM90 GPU")
@pytest.mark.parametrize("recompute", ["none", "act", "experts"])
@pytest.mark.parametrize("layout", ["gpt_oss", "qwen3"])
def test_grouped_mm_path_in_bf16_matches_the_loop(layout, recompute):
    """The CUDA bf16 path (torch._grouped_mm, the bias added per expert segment, its gradient a segment sum) against
    the bf16 loop on the same weights and rows, empty experts included, and its output against the fp32 loop.

    Why not every gradient against fp32: the clamp's derivative jumps at the limit, and bf16 rounding moves the
    pre-activations near it across (measured: 5.6% norm error of the input gradient against fp32 at h std 8). The
    grouped and the loop bf16 paths round the same inputs and weights, so they agree far closer."""
    import ds_ulysses_ext.moe.experts as experts_module
    import ds_ulysses_ext.moe.grouped as grouped_module
    from ds_ulysses_ext.moe import GroupedExperts
    opts = dict(layout="gpt_oss", bias=True, activation="gpt_oss") if layout == "gpt_oss" else {}
    D, I_, El, counts = 64, 32, 8, [37, 0, 81, 5, 64, 0, 100, 13]
    g = torch.Generator().manual_seed(4)
    weights = {n: torch.randn(p.shape, generator=g) for n, p in GroupedExperts(El, D, I_, **opts).named_parameters()}
    x = torch.randn(sum(counts), D, generator=g).cuda()
    dy = torch.randn(sum(counts), D, generator=g).cuda()

    def run(dtype, grouped):  # x @ W has std ~8 on unit rows: the GPT-OSS clamp at 7 clips
        m = GroupedExperts(El, D, I_, recompute if dtype == torch.bfloat16 else "none", 3, **opts)
        m.load_state_dict(weights)
        m = m.cuda().to(dtype)
        xi = x.detach().to(dtype).requires_grad_()  # a leaf of its own: the fp32 run's .to() returns x itself
        calls, real, ok, layouts = [], torch._grouped_mm, grouped_module._grouped_mm_ok, experts_module.GROUPED_LAYOUTS
        torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
        grouped_module._grouped_mm_ok = ok if grouped else (lambda *a: False)
        experts_module.GROUPED_LAYOUTS = experts_module.LAYOUTS  # every layout, whatever the default lists
        try:
            y = m(xi, counts)
            (y.float() * dy).sum().backward()
        finally:
            torch._grouped_mm, grouped_module._grouped_mm_ok, experts_module.GROUPED_LAYOUTS = real, ok, layouts
        assert bool(calls) == grouped
        return [y.float(), xi.grad.float()] + [p.grad.float() for p in m.parameters()], m

    def nrel(a, b):
        return ((a - b).norm() / b.norm()).item()
    ref, _ = run(torch.float32, False)
    loop, _ = run(torch.bfloat16, False)
    fast, module = run(torch.bfloat16, True)
    assert nrel(fast[0], ref[0]) < 2e-2
    names = ["output", "input grad"] + [n for n, _ in module.named_parameters()]
    for name, a, b in zip(names, fast, loop):
        assert nrel(a, b) < 1e-2, (name, nrel(a, b))
    assert module.down_proj.grad[[1, 5]].abs().sum() == 0  # empty experts: zero gradient


# --- the whole model -------------------------------------------------------------------------------------------

COEF = 0.1  # large, so the balance loss moves the router gradient far beyond the tolerance
MODEL_E, MODEL_K = 8, 2


def _model_config(**kw):
    args = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, num_local_experts=MODEL_E, num_experts_per_tok=MODEL_K,
                sliding_window=4, max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=False)
    return GptOssConfig(**{**args, **kw})


def tiny_gpt_oss(seed=0, **overrides):
    """A tiny GPT-OSS whose experts clip at the limit (hidden states after the RMSNorm are ~unit: W std 0.8 gives
    h std ~4.5), with non-zero expert and router biases and large, distinct sinks; eager attention. overrides:
    config fields (tests/test_model_features.py)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_model_config(**overrides), attn_implementation="eager",
                                             dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(8, generator=g) * 2)
            mlp = layer.mlp
            for p, std in ((mlp.experts.gate_up_proj, 0.8), (mlp.experts.gate_up_proj_bias, 1.0),
                           (mlp.experts.down_proj, 0.2), (mlp.experts.down_proj_bias, 0.5),
                           (mlp.router.weight, 0.5), (mlp.router.bias, 0.5)):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.train()


def _reference_aux(router_logits, mask):
    """The per-sequence balance loss from HF's router logits (bias included): f_e = E/(k n) count_e, P_e the mean
    softmax over all E on the sequence's real tokens, the choice the top-k of the logits."""
    B, S = mask.shape
    total = 0.0
    for logits in router_logits:  # one [B*S, E] per layer
        probs = torch.softmax(logits.float(), -1).view(B, S, MODEL_E)
        top = torch.topk(logits.view(B, S, MODEL_E), MODEL_K, dim=-1).indices
        for b in range(B):
            real = mask[b].bool()
            counts = torch.bincount(top[b][real].flatten(), minlength=MODEL_E).float()
            total = total + (counts * MODEL_E / (MODEL_K * real.sum()) * probs[b][real].mean(0)).sum()
    return total / B


def _reference():
    model = tiny_gpt_oss()
    ids, labels, mask = moe_batch()
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), ignore_index=-100)
    aux = _reference_aux(out.router_logits, mask)
    (ce + COEF * aux).backward()
    return ce.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_case(rank, world, cp, ep):
    ref_ce, ref_aux, ref_grads = _reference()
    topo = init_topology(cp, ep_size=ep)
    model = enable_context_parallel(tiny_gpt_oss(), topo, backend="sdpa")
    enable_expert_parallel(model, topo, MoESettings(dispatcher="alltoall", aux_loss_coef=COEF))
    assert not any(isinstance(m, GptOssMLP) for m in model.modules()) and len(moe_blocks(model)) == 2
    names = assert_moe_split_matches(model, topo, moe_batch(), COEF, ref_ce, ref_aux, ref_grads, MODEL_E, RTOL)
    assert names == set(ref_grads)  # every HF parameter, sinks and all biases, under HF's name


@pytest.mark.parametrize("world,cp,ep", [(2, 2, 2), (4, 2, 2), (4, 4, 2)])
def test_model_cp_ep_matches_unsplit_hf(world, cp, ep):
    run_ranks(_model_case, world, cp, ep)


def test_model_experts_clip_and_the_balance_loss_counts():
    """The model reference exercises what the layout tests claim: the clamp clips in its MoE layers and the balance
    term moves the router gradient well past the tolerance."""
    model = tiny_gpt_oss()
    ids, _, mask = moe_batch()
    hits = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(
        lambda m, args: hits.append(_clamp_hits(m, args[0].detach().reshape(-1, 32))))
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    hook.remove()
    gate_hi, up_hi, up_lo, slots = hits[0]
    assert min(gate_hi, up_hi, up_lo) > 0 and gate_hi < slots * 16 / 2
    (COEF * _reference_aux(out.router_logits, mask)).backward()
    assert model.model.layers[0].mlp.router.weight.grad.norm() > 1e-3
    assert model.model.layers[0].mlp.router.bias.grad.norm() > 1e-3


def test_saved_checkpoint_loads_into_ours_and_our_state_saves_as_hf(tmp_path):
    """save_pretrained -> from_pretrained -> our blocks: HF's logits (rel 1e-6); our model's state dict saved as an HF
    folder loads into stock HF GPT-OSS with equal tensors and logits (the export writes HF's names and layout)."""
    tiny_gpt_oss().save_pretrained(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
    assert replace_hf_blocks(ours) == 2
    assert not any(isinstance(m, GptOssMLP) for m in ours.modules())
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    a, b = hf(ids, labels=ids), ours(ids, labels=ids)
    assert _rel(b.logits, a.logits) < 1e-6 and abs(a.loss.item() - b.loss.item()) / a.loss.item() < 1e-6
    ours.save_pretrained(str(tmp_path / "ours"), state_dict=ours.state_dict())
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                attn_implementation="eager")
    assert type(back.model.layers[0].mlp) is GptOssMLP
    ref_state, back_state = hf.state_dict(), back.state_dict()
    assert ref_state.keys() == back_state.keys() and all(torch.equal(ref_state[k], back_state[k]) for k in ref_state)
    assert _rel(back(ids).logits, a.logits) < 1e-6


def test_refusals_and_what_is_no_longer_refused():
    from configs import ConfigError, compose_config, validate
    base = ["model=tiny_gpt_oss", "trainer.global_batch_size=4"]
    for extra in (["parallelism.ep=2", "parallelism.cp=2"], ["parallelism.ep=4", "moe=expert_recompute"],
                  ["moe.recompute=experts", "moe.offload_inputs=true"], ["moe.balance=bias"]):
        validate(compose_config(base + extra), world_size=4)  # the MoE runs as ours: ep and moe.* apply
    with pytest.raises(ConfigError, match=r"parallelism.ep=3 does not divide model.arch.num_local_experts=8"):
        validate(compose_config(base + ["parallelism.ep=3"]), world_size=6)
    with pytest.raises(ConfigError, match=r"output_router_logits=true .* moe.balance=aux"):
        validate(compose_config(base + ["+model.arch.output_router_logits=true"]), world_size=4)
    with pytest.raises(UnsupportedError, match=r"output_router_logits=true"):
        hf_moe_spec(_model_config(output_router_logits=True))

    class QuantizedExperts(GptOssExperts):  # stands in for transformers' Mxfp4GptOssExperts
        pass

    model = tiny_gpt_oss()
    model.model.layers[1].mlp.experts.__class__ = QuantizedExperts
    with pytest.raises(UnsupportedError, match=r"layer 1: GPT-OSS experts of type QuantizedExperts.*dequantize"):
        replace_hf_blocks(model)


# --- scripts/train.py -------------------------------------------------------------------------------------------

def _train(tmp_path, name, world, extra):
    from test_moe_engine import BASE
    from test_engine import _run
    out = tmp_path / name
    run_ranks(_run, world, BASE + ["model=tiny_gpt_oss", f"run.out_dir={out}"] + extra)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_py_ep2_cp2_matches_world_1(tmp_path):
    from test_moe_engine import assert_same
    # BASE: 5 steps at lr 3e-3. (At lr 1e-2, step 5's grad_norm differed by 4e-5 between the layouts while steps
    # 1-4 agreed to 4e-7: most likely a top-k near-tie that 1e-7 of rounding flips, not checked further)
    ref = _train(tmp_path, "w1", 1, ["parallelism.cp=1"])
    # uniform random tokens: the loss starts near ln(vocab) and its step-to-step noise hides the progress; the
    # gradient norm shows the steps do train (it shrinks as the output distribution flattens)
    assert ref[-1]["grad_norm"] < 0.8 * ref[0]["grad_norm"], "the reference run must train"
    assert all(r["moe_aux_loss"] > 0 and r["moe_imbalance"] >= 1.0 for r in ref)
    assert_same(_train(tmp_path, "w2", 2, ["parallelism.cp=2", "parallelism.ep=2"]), ref, "gpt_oss w2 ep2 cp2")


def test_train_py_export_gathers_every_expert_in_hf_layout(tmp_path):
    """The ep=2 run's export is a stock HF GPT-OSS folder holding every expert (and bias) in order: one step at lr
    1e-9 (Adam moves each weight by ~lr), so the w1 and w2 exports agree unless an expert is missing or misplaced."""
    extra = ["trainer.max_steps=1", "trainer.export_hf=true", "trainer.lr=1e-9"]
    _train(tmp_path, "w1_export", 1, extra + ["parallelism.cp=1"])
    _train(tmp_path, "w2_export", 2, extra + ["parallelism.cp=2", "parallelism.ep=2"])
    models = [AutoModelForCausalLM.from_pretrained(str(tmp_path / n / "hf_export"), dtype=torch.float32,
                                                   attn_implementation="eager") for n in ("w1_export", "w2_export")]
    assert type(models[1].model.layers[0].mlp) is GptOssMLP
    experts = models[1].model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj_bias.shape == (8, 64)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = [m(ids).logits for m in models]
    assert _rel(logits[1], logits[0]) < RTOL
