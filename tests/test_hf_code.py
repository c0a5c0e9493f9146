"""ds_ulysses_ext/hf_code.py: HF's gated MLP recognised by its forward's bytecode, in every supported family's dense
and shared MLPs, and in nothing that computes anything else (the fused kernels, selective recompute and FP8's whole-MLP
paths rewrite only what it recognises)."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from ds_ulysses_ext.hf_code import is_plain_gated_mlp
from tiny_models import tiny_model

# family: the classes of its modules named gate_proj/up_proj/down_proj/act_fn, read in transformers 5.22.2's modeling
# files (the MoE families' experts are not such modules; qwen3_moe's are dense only under mlp_only_layers)
FAMILY_MLPS = {
    "llama": {"LlamaMLP"}, "qwen2": {"Qwen2MLP"}, "qwen3": {"Qwen3MLP"}, "mistral": {"MistralMLP"},
    "qwen3_moe": set(), "deepseek_v3": {"DeepseekV3MLP"}, "glm4_moe_lite": {"Glm4MoeLiteMLP"},
    "glm4_moe": {"Glm4MoeMLP"}, "mistral4": {"Mistral4MLP"}, "cohere2_moe": {"Cohere2MoeMLP"},
    "qwen3_vl": {"Qwen3VLTextMLP"}, "qwen3_vl_moe": set(), "qwen3_5_text": {"Qwen3_5MLP"},
    "qwen3_5_moe_text": {"Qwen3_5MoeMLP"}, "qwen3_next": {"Qwen3NextMLP"}, "bailing_hybrid": {"BailingHybridMLP"},
}


def _gated_looking(model):
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))]


@pytest.mark.parametrize("family", list(FAMILY_MLPS))
def test_every_supported_familys_mlp_is_recognised(family):
    found = _gated_looking(tiny_model(family))
    assert {type(m).__name__ for m in found} == FAMILY_MLPS[family]
    assert all(is_plain_gated_mlp(m) for m in found), [type(m).__name__ for m in found if not is_plain_gated_mlp(m)]


def _mlp():
    return tiny_model("llama").model.layers[0].mlp


class _Swapped(LlamaMLP):
    def forward(self, x):  # act on up instead of gate
        down_proj = self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))
        return down_proj


class _Clamped(LlamaMLP):
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=7.0)) * self.up_proj(x))
        return down_proj


class _Inherited(LlamaMLP):
    """A subclass that keeps LlamaMLP's forward: the same function, so recognised."""


def test_a_changed_forward_is_not_recognised_and_an_inherited_one_is(monkeypatch):
    mlp = _mlp()
    assert is_plain_gated_mlp(mlp)
    for cls in (_Swapped, _Clamped):
        mlp.__class__ = cls
        assert not is_plain_gated_mlp(mlp), cls
    mlp.__class__ = _Inherited
    assert is_plain_gated_mlp(mlp)
    mlp.__class__ = LlamaMLP
    monkeypatch.setattr(LlamaMLP, "forward", _Clamped.forward)  # HF's class itself patched
    assert not is_plain_gated_mlp(mlp)


def test_projections_that_are_not_linears_are_not_recognised():
    mlp = _mlp()
    mlp.up_proj = torch.nn.Sequential(mlp.up_proj)
    assert not is_plain_gated_mlp(mlp)
