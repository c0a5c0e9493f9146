"""The model registry at model time: which modules get the CP attention, and what a family's notes do."""
import logging

import pytest
import torch

from ds_ulysses_ext import Topology, UnsupportedError, check_model_config, enable_context_parallel
from ds_ulysses_ext.integrate import attention_modules
from ds_ulysses_ext.models import SUPPORTED, Family
from tiny_models import tiny_config, tiny_model

CP2 = Topology(world_size=2, rank=0, cp_size=2, dp_size=1)  # no group needed: nothing below communicates


class PoolingAttention(torch.nn.Module):
    """Not an attention layer of the decoder, whatever its class name says (e.g. an attention-pooling head)."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"])
def test_the_cp_attention_goes_to_each_decoder_layers_self_attn_only(family):
    model = tiny_model(family)
    model.pooler = PoolingAttention()
    layers = model.get_decoder().layers
    assert [id(m) for m in attention_modules(model)] == [id(layer.self_attn) for layer in layers]
    enable_context_parallel(model, CP2)
    assert all(layer.self_attn._cp_state is model._cp_state for layer in layers)
    assert not hasattr(model.pooler, "_cp_state")


def test_a_decoder_layer_without_self_attn_is_refused():
    model = tiny_model("llama", num_hidden_layers=3)
    del model.get_decoder().layers[1].self_attn  # e.g. a recurrent mixer CP cannot split
    with pytest.raises(UnsupportedError, match=r"decoder layers \[1\] of LlamaForCausalLM have no `self_attn` "
                                               r"attention module.*parallelism\.cp=1"):
        enable_context_parallel(model, CP2)


def test_a_family_note_is_logged_when_cp_is_enabled(monkeypatch, caplog):
    monkeypatch.setitem(SUPPORTED, "llama", Family("llama", notes="experts run unsplit on every rank"))
    with caplog.at_level(logging.INFO, logger="ds_ulysses_ext.models"):
        check_model_config(tiny_config("llama"), 2)
    assert "llama under context parallelism (cp=2): experts run unsplit on every rank" in caplog.text
