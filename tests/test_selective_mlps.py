"""Selective recompute's MLP rewrite (memory/recompute.py): which MLPs it rebuilds only the product of (those whose
class forward is HF's gated MLP to the bytecode, hf_code.py), and that a changed SwiGLU is recomputed whole instead;
either way the model's loss and gradients are the no-policy model's (fp32, rel 1e-5)."""
import logging
import re

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from ds_ulysses_ext import init_topology, shard_batch
from ds_ulysses_ext.memory import SelectiveRecompute
from policy_helpers import LAYERS, RTOL, _assert_close_dicts, _batch, _lm, _rel, _run
from tiny_models import tiny_model


def _hf_loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# every family's dense MLPs (each a copy of LlamaMLP's forward in its own modeling file) are rewritten, and the
# rewritten model is the model: the count is the tiny config's dense layers (tests/tiny_models.py); MoE layers have
# none. Until 2026-12-08 the rewrite took a hand list of five classes, and the rest recomputed their whole MLP
@pytest.mark.parametrize("family, overrides, dense", [
    ("llama", {}, 2), ("llama", {"mlp_bias": True}, 2), ("qwen2", {}, 2), ("qwen3", {}, 2), ("mistral", {}, 2),
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, 2), ("deepseek_v3", {}, 1), ("glm4_moe_lite", {}, 1),
    ("glm4_moe", {}, 1), ("mistral4", {}, 1), ("qwen3_vl", {}, 2), ("qwen3_5_text", {}, 3), ("bailing_hybrid", {}, 1)])
def test_selective_rewrites_every_dense_gated_mlp_and_matches_no_policy(family, overrides, dense):
    model = tiny_model(family, **overrides)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _hf_loss_and_grads(model, ids)
    policy = SelectiveRecompute().apply(model)
    assert (policy.num_mlps, policy.num_whole_mlps) == (dense, 0)
    loss, grads = _hf_loss_and_grads(model, ids)
    assert _rel(loss, ref_loss) < RTOL and set(grads) == set(ref_grads)
    _assert_close_dicts(grads, ref_grads, (family,))


class _ClampedBiasedMLP(torch.nn.Module):
    """A SwiGLU that is not down(act(gate) * up): clamped, with the +1 on up that GPT-OSS's MLP has."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        gate, up = self.gate_proj(x).clamp(max=0.05), self.up_proj(x).clamp(-0.05, 0.05)
        return self.down_proj(self.act_fn(gate) * (up + 1))


def _halved_forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


class _SubclassedMLP(LlamaMLP):
    """A LlamaMLP subclass with its own forward: the class name alone must not make it a known MLP."""

    forward = _halved_forward


@pytest.mark.parametrize("changed", ["clamped_biased", "subclass", "patched_class"])
def test_selective_leaves_a_changed_swiglu_whole_and_exact(changed, caplog, monkeypatch):
    topo = init_topology(1)
    lm = _lm(topo)
    if changed == "patched_class":  # LlamaMLP itself, its forward replaced: the class name is not enough
        monkeypatch.setattr(LlamaMLP, "forward", _halved_forward)
    for layer in lm.hf.model.layers:
        if changed == "clamped_biased":
            layer.mlp = _ClampedBiasedMLP(layer.mlp)
        elif changed == "subclass":
            layer.mlp.__class__ = _SubclassedMLP
    local = shard_batch(dict(zip(("input_ids", "labels"), _batch())), topo)
    ref_loss, ref_grads = _run(lm, local)
    with caplog.at_level(logging.INFO, logger="ds_ulysses_ext.memory.recompute"):
        policy = SelectiveRecompute().apply(lm.hf)
    assert (policy.num_mlps, policy.num_whole_mlps) == (0, LAYERS)
    assert re.search(rf"{type(lm.hf.model.layers[0].mlp).__qualname__} is not a known down\(act\(gate\) \* up\) "
                     rf"MLP; its {LAYERS} layers recompute their whole MLP forward instead", caplog.text)
    loss, grads = _run(lm, local)
    assert _rel(loss, ref_loss) < RTOL
    _assert_close_dicts(grads, ref_grads, (changed,))
