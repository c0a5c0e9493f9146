"""ds_ulysses_ext.kernels: the fused per-token ops bound to a model instance, on CPU.

On CPU no provider is chosen (HF's eager modules are the reference), so the binding is exercised with the
reference functions as a stand-in provider, in bf16, where the two RMSNorm orders (cast before the weight, or scale
in fp32: GPT-OSS) round differently: the bound model must give bitwise HF's logits and gradients. The first-use
check must stop a provider that disagrees with the reference. GPU providers: tests/test_gpu_paths.py.
"""
import pytest
import torch

from ds_ulysses_ext.kernels import apply_fused_kernels
from ds_ulysses_ext.kernels import providers
from ds_ulysses_ext.kernels.providers import Checked, Provider

_MOE = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
            topk_group=1)
_MLA = dict(_MOE, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4)
FAMILIES = {  # family: (extra HF config, RMSNorms, SwiGLU MLPs, RoPEs bound) for 2 layers
    "llama": ({}, 5, 2, 2),
    "mistral": ({}, 5, 2, 2),
    "qwen2": ({}, 5, 2, 2),
    "qwen3": ({}, 9, 2, 2),  # q/k norms too
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), 9, 0, 2),  # experts: ours
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2), 5, 0, 0),  # half-width cos/sin: HF's RoPE
    # MLA: q/kv latent norms too; the first layer dense, the second's shared experts a SwiGLU MLP
    "deepseek_v3": (dict(_MLA, num_key_value_heads=4), 9, 2, 2),  # RoPE on the rope part
    "glm4_moe_lite": (dict(_MLA, num_key_value_heads=4), 9, 2, 2),
    "glm4_moe": (dict(_MOE, use_qk_norm=True), 9, 2, 0),  # q/k norms; partial rotation: HF's RoPE
}


def _model(family, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)
    cfg = AutoConfig.for_model(family, attn_implementation="eager", **{**shape, **FAMILIES[family][0], **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norms away from 1, so a dropped weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bound_ops_give_hf_bitwise(family):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _logits_and_grads(_model(family), ids)
    model = _model(family)
    report = apply_fused_kernels(model, "auto", torch.device("cpu"), provider=Provider(), projections=False)
    assert (report.norms, report.mlps, report.ropes) == FAMILIES[family][1:], report
    logits, grads = _logits_and_grads(model, ids)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_mla_rope_part_without_interleave_goes_through_the_provider():
    """DeepSeek-V3's default (rope_interleave) calls HF's interleaved function, which stays eager; without it, the
    rope part [B, H, s, rope dim] and the shared k part [B, 1, s, rope dim] take the bound RoPE, bitwise HF's."""
    class Counting(Provider):
        calls = 0

        def rope(self, q, k, cos, sin):
            Counting.calls += 1
            return super().rope(q, k, cos, sin)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _logits_and_grads(_model("deepseek_v3", rope_interleave=False), ids)
    model = _model("deepseek_v3", rope_interleave=False)
    apply_fused_kernels(model, "auto", torch.device("cpu"), provider=Counting(), projections=False)
    logits, grads = _logits_and_grads(model, ids)
    assert Counting.calls == 2
    assert torch.equal(logits, ref_logits)
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_a_non_silu_mlp_stays_eager_and_is_reported():
    model = _model("llama", hidden_act="gelu")
    report = apply_fused_kernels(model, "auto", torch.device("cpu"), provider=Provider())
    assert report.mlps == 0 and report.skipped_mlps == ["LlamaMLP", "LlamaMLP"]
    assert "forward" not in model.model.layers[0].mlp.__dict__


class _NormedProductMLP(torch.nn.Module):
    """HF's names and a SiLU act_fn, but a norm on the product (as BitNet's MLP has): not down(silu(gate) * up)."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6))


def test_an_mlp_of_hf_names_that_computes_something_else_stays_eager():
    """Bound by its names alone, this MLP would lose its norm with no error (so it was, until 2026-12-08)."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    models = [_model("llama") for _ in range(2)]
    for model in models:
        for layer in model.model.layers:
            layer.mlp = _NormedProductMLP(layer.mlp)
    ref_logits, ref_grads = _logits_and_grads(models[0], ids)
    report = apply_fused_kernels(models[1], "auto", torch.device("cpu"), provider=Provider(), projections=False)
    assert report.mlps == 0 and report.skipped_mlps == ["_NormedProductMLP", "_NormedProductMLP"]
    logits, grads = _logits_and_grads(models[1], ids)
    assert torch.equal(logits, ref_logits)
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_rope_bound_per_instance_runs_the_provider():
    """The bound forward runs HF's code with the provider's RoPE; another instance and HF's module keep theirs."""
    from transformers.models.llama import modeling_llama

    class Counting(Provider):
        calls = 0

        def rope(self, q, k, cos, sin):
            Counting.calls += 1
            return super().rope(q, k, cos, sin)
    model, other = _model("llama"), _model("llama")
    apply_fused_kernels(model, "auto", torch.device("cpu"), provider=Counting())
    ids = torch.randint(0, 64, (1, 6))
    other(input_ids=ids)
    assert Counting.calls == 0
    model(input_ids=ids)
    assert Counting.calls == 2  # one per layer
    assert "forward" not in other.model.layers[0].self_attn.__dict__
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"
    assert modeling_llama.LlamaAttention.forward.__globals__["apply_rotary_pos_emb"] is \
        modeling_llama.apply_rotary_pos_emb


def test_cpu_keeps_hf_modules():
    model = _model("llama")
    report = apply_fused_kernels(model, "auto", torch.device("cpu"))
    assert report.provider == "none"
    assert not any("forward" in m.__dict__ for m in model.modules())


class _NoWeight(Provider):
    name = "broken"

    def rms_norm(self, x, weight, eps, weight_in_fp32):
        return super().rms_norm(x, torch.ones_like(weight), eps, weight_in_fp32)


class _Swapped(Provider):
    name = "broken"

    def silu_mul(self, gate, up):
        return super().silu_mul(up, gate)

    def rope(self, q, k, cos, sin):
        return super().rope(q, k, sin, cos)


class _HeadOffByOne(Provider):
    name = "broken"
    fused_head = True

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        return super().linear_cross_entropy_sum(hidden, weight, torch.where(labels < 0, labels, (labels + 1) % 1000))


def test_first_use_check_stops_a_wrong_kernel():
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.raises(RuntimeError, match="model.kernels=none"):
        Checked(_NoWeight()).rms_norm(x, w, 1e-6, False)
    with pytest.raises(RuntimeError, match="model.kernels=none"):
        Checked(_Swapped()).silu_mul(x, x + 1)
    q, k, cs = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 5, 8)
    with pytest.raises(RuntimeError, match="model.kernels=none"):
        Checked(_Swapped()).rope(q, k, cs, cs + 1)
    h, wv, y = torch.randn(6, 16), torch.randn(1000, 16), torch.randint(0, 1000, (6,))
    with pytest.raises(RuntimeError, match="model.kernels=none"):
        Checked(_HeadOffByOne()).linear_cross_entropy_sum(h, wv, y)
    out = Checked(Provider()).rms_norm(x, w, 1e-6, False)  # the reference passes its own check
    assert torch.equal(out, Provider().rms_norm(x, w, 1e-6, False))


def test_liger_asked_for_without_liger_is_refused_on_cuda(monkeypatch):
    from ds_ulysses_ext import UnsupportedError
    monkeypatch.setattr(providers, "liger_available", lambda: False)
    with pytest.raises(UnsupportedError, match="model.kernels=compile"):
        providers.provider_for("liger", torch.device("cuda"))
    assert providers.provider_for("none", torch.device("cuda")) is None
    assert providers.provider_for("liger", torch.device("cpu")) is None


def test_bound_ops_compose_with_the_memory_policies_and_context_parallel():
    """The policies wrap whatever forward a module has: the bound RoPE's attention under except_attention (replayed,
    its tensors on the 'host'), the bound SwiGLU under the tiled MLP; fp32, against the same model unbound."""
    from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology, shard_batch
    from ds_ulysses_ext.memory import ExceptAttentionRecompute, TiledMLP
    from tiny_models import tiny_model
    topo = init_topology(1)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    local = shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)

    def step(bind):
        torch.manual_seed(0)
        hf = enable_context_parallel(tiny_model("llama", num_hidden_layers=2), topo, backend="sdpa")
        report = apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=Provider()) if bind else None
        policies = [ExceptAttentionRecompute(offload=True).apply(hf), TiledMLP(4).apply(hf)] if bind else []
        lm = CPCausalLM(hf, loss_chunk_size=5)
        loss_sum, count = lm(**local)
        (loss_sum / count).backward()
        for p in policies:
            p.remove()
        return report, loss_sum.detach(), {n: p.grad for n, p in lm.named_parameters()}
    _, ref_loss, ref_grads = step(False)
    report, loss, grads = step(True)
    assert (report.norms, report.mlps, report.ropes) == (5, 2, 2)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        assert ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, name


class _CountingHead(Provider):
    """The reference head as a fused provider's would be used (it materialises [T, V]: fine at these sizes)."""
    fused_head = True
    calls = 0

    def linear_cross_entropy_sum(self, hidden, weight, labels):
        _CountingHead.calls += 1
        return super().linear_cross_entropy_sum(hidden, weight, labels)


def test_a_providers_loss_head_replaces_the_torch_head_and_agrees():
    """A provider with a fused head (Liger's on CUDA) is what CPCausalLM's head runs; fp32, against loss.py's chunked
    head on the same model: loss and every gradient (lm_head's included), relative 1e-5; masked labels too."""
    from ds_ulysses_ext import CPCausalLM, init_topology, shard_batch
    from tiny_models import tiny_model
    topo = init_topology(1)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :5] = -100
    local = shard_batch({"input_ids": ids, "labels": labels}, topo)

    def step(bind):
        torch.manual_seed(0)
        hf = tiny_model("llama", num_hidden_layers=2)
        report = apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=Checked(_CountingHead()) if bind else None,
                                     loss_head="liger")
        lm = CPCausalLM(hf, loss_chunk_size=5, head_kernel=report.head)
        loss_sum, count = lm(**local)
        (loss_sum / count).backward()
        return report, loss_sum.detach(), {n: p.grad for n, p in lm.named_parameters()}
    ref_report, ref_loss, ref_grads = step(False)
    report, loss, grads = step(True)
    # twice: its first-use check, then the step
    assert ref_report.head is None and report.head is not None and _CountingHead.calls == 2
    assert "and the loss head" in str(report)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert "hf.lm_head.weight" in grads
    for name, g in grads.items():
        assert ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, name


def test_the_loss_head_setting_picks_whose_head_runs():
    """model.loss_head: auto keeps loss.py's head (report.head None) even where the provider has a fused one; liger
    takes the provider's; liger where the provider has none is refused, naming the fix."""
    from ds_ulysses_ext import UnsupportedError
    from tiny_models import tiny_model
    hf = tiny_model("llama", num_hidden_layers=1)
    assert apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=_CountingHead()).head is None
    assert apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=_CountingHead(), loss_head="liger").head \
        is not None
    with pytest.raises(UnsupportedError, match="model.loss_head=auto"):
        apply_fused_kernels(hf, "auto", torch.device("cpu"), provider=Provider(), loss_head="liger")


def test_first_use_check_keeps_the_torch_path_unless_the_kernel_agrees(caplog):
    """kernels/first_use.py, which every hand-written Triton kernel's check goes through: agreement within the
    tolerance passes; a disagreement in any pair, or a kernel that raises (a Triton build failure), keeps torch's
    path and says why in a warning."""
    import logging

    from ds_ulysses_ext.kernels.first_use import agrees
    ref = torch.arange(1.0, 9.0)
    dev = torch.device("cpu")
    assert agrees("k", dev, torch.float32, lambda: [("a", ref * (1 + 1e-7), ref, 1e-5)])
    with caplog.at_level(logging.WARNING):
        assert not agrees("k", dev, torch.float32, lambda: [("a", ref, ref, 1e-5), ("b", ref * 1.01, ref, 1e-5)])
        assert "disagree with torch" in caplog.text and "(b)" in caplog.text

        def broken():
            raise RuntimeError("no Triton here")
        assert not agrees("k", dev, torch.float32, broken)
        assert "RuntimeError: no Triton here" in caplog.text
